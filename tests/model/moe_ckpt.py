"""Tiny random-weight Qwen3-MoE and GPT-OSS checkpoints (no hub), shared by the MoE tests."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

VOCAB = 512


def moe_hf_config(family: str) -> Any:
    from transformers import GptOssConfig, Qwen3MoeConfig

    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.1,
                  tie_word_embeddings=False)
    if family == "qwen3_moe":
        # Layer 1 dense (mlp_only_layers), the rest sparse; renormalized top-k.
        return Qwen3MoeConfig(**common, intermediate_size=96, moe_intermediate_size=32,
                              num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                              mlp_only_layers=[1], decoder_sparse_step=1,
                              architectures=["Qwen3MoeForCausalLM"])
    if family == "gpt_oss":
        # Sliding (24) / full layers alternating; YaRN whose ramp falls inside the head's
        # frequencies (original context 256); a SwiGLU limit low enough to clamp some rows.
        return GptOssConfig(**common, intermediate_size=32, num_local_experts=8,
                            num_experts_per_tok=2, sliding_window=24, swiglu_limit=1.0,
                            rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0,
                                             "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                             "truncate": False,
                                             "original_max_position_embeddings": 256},
                            architectures=["GptOssForCausalLM"])
    raise ValueError(family)


def build_moe_checkpoint(family: str, root: Path, seed: int = 0) -> tuple[Path, Any]:
    from transformers import AutoModelForCausalLM

    from flatserve.bench.random_ckpt import word_tokenizer

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(moe_hf_config(family), attn_implementation="eager",
                                             dtype=torch.float32).eval()
    with torch.no_grad():  # sinks and router biases of a real model's size, not init's 0.1
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "router.bias")):
                p.normal_(0.0, 1.0)
    path = root / family
    model.save_pretrained(path)
    word_tokenizer(VOCAB).save_pretrained(path)
    return path, model
