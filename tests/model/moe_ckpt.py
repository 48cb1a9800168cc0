"""Tiny random-weight Qwen3-MoE and GPT-OSS checkpoints (no hub), shared by the MoE tests."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

VOCAB = 512


def moe_hf_config(family: str, gguf: bool = False) -> Any:
    """gguf=True: what llama.cpp's graphs can express (every Qwen3-MoE layer sparse, GPT-OSS's
    fixed SwiGLU limit of 7)."""
    from transformers import GptOssConfig, Qwen3MoeConfig

    common = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                  bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.1,
                  tie_word_embeddings=False)
    if family == "qwen3_moe":
        # Layer 1 dense (mlp_only_layers), the rest sparse; renormalized top-k.
        return Qwen3MoeConfig(**common, intermediate_size=96, moe_intermediate_size=32,
                              num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
                              mlp_only_layers=[] if gguf else [1], decoder_sparse_step=1,
                              architectures=["Qwen3MoeForCausalLM"])
    if family == "gpt_oss":
        # Sliding (24) / full layers alternating; YaRN whose ramp falls inside the head's
        # frequencies (original context 256); a SwiGLU limit low enough to clamp some rows.
        return GptOssConfig(**common, intermediate_size=32, num_local_experts=8,
                            num_experts_per_tok=2, sliding_window=24,
                            swiglu_limit=7.0 if gguf else 1.0,
                            rope_parameters={"rope_type": "yarn", "rope_theta": 150000.0,
                                             "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                             "truncate": False,
                                             "original_max_position_embeddings": 256},
                            architectures=["GptOssForCausalLM"])
    raise ValueError(family)


def build_moe_checkpoint(family: str, root: Path, seed: int = 0, gguf: bool = False
                         ) -> tuple[Path, Any]:
    from transformers import AutoModelForCausalLM

    from flatserve.bench.random_ckpt import word_tokenizer

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(moe_hf_config(family, gguf), attn_implementation="eager",
                                             dtype=torch.float32).eval()
    with torch.no_grad():  # sinks and router biases of a real model's size, not init's 0.1
        for name, p in model.named_parameters():
            if name.endswith(("sinks", "router.bias")):
                p.normal_(0.0, 1.0)
    path = root / family
    model.save_pretrained(path)
    word_tokenizer(VOCAB).save_pretrained(path)
    return path, model


def write_moe_gguf(family: str, model: Any, out: Path, mxfp4_experts: bool = False) -> Path:
    """The HF model's weights as llama.cpp names them (`qwen3moe` / `gpt-oss`), written with the
    `gguf` package: f32 tensors, or MXFP4 expert stacks (then the HF model's experts are set to
    their MXFP4 round trip, so both sides hold the same weights)."""
    import gguf
    import numpy as np
    from gguf.quants import dequantize, quantize

    cfg = model.config
    arch = "qwen3moe" if family == "qwen3_moe" else "gpt-oss"
    w = gguf.GGUFWriter(str(out), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_expert_feed_forward_length(getattr(cfg, "moe_intermediate_size", cfg.intermediate_size))
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_expert_count(cfg.num_experts if family == "qwen3_moe" else cfg.num_local_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    if family == "gpt_oss":
        rp = cfg.rope_parameters
        w.add_sliding_window(cfg.sliding_window)
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(rp["factor"])
        w.add_rope_scaling_orig_ctx_len(rp["original_max_position_embeddings"])
    toks = ["<pad>", "<s>", "</s>", "<unk>"] + [f"w{i}" for i in range(4, cfg.vocab_size)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(toks)
    w.add_token_types([gguf.TokenType.CONTROL] * 4 + [gguf.TokenType.NORMAL] * (len(toks) - 4))
    w.add_token_scores([0.0] * len(toks))
    w.add_token_merges([])
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_pad_token_id(0)

    def f32(t: torch.Tensor) -> np.ndarray:
        return t.detach().float().contiguous().numpy()

    def experts(name: str, t: torch.Tensor, param: torch.Tensor, sl: Any) -> None:
        """[E, rows, cols] stack, MXFP4 if asked (and the HF weights set to its round trip)."""
        a = f32(t)
        if not mxfp4_experts:
            w.add_tensor(name, a)
            return
        q = quantize(a, gguf.GGMLQuantizationType.MXFP4)
        w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.MXFP4)
        back = torch.from_numpy(dequantize(q, gguf.GGMLQuantizationType.MXFP4).reshape(a.shape))
        sl(param, back)

    sd = dict(model.named_parameters())
    w.add_tensor("token_embd.weight", f32(sd["model.embed_tokens.weight"]))
    w.add_tensor("output_norm.weight", f32(sd["model.norm.weight"]))
    w.add_tensor("output.weight", f32(sd["lm_head.weight"]))
    for i in range(cfg.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        names = {"input_layernorm.weight": "attn_norm.weight"}
        for x in "qkvo":
            names[f"self_attn.{x}_proj.weight"] = f"attn_{'output' if x == 'o' else x}.weight"
            names[f"self_attn.{x}_proj.bias"] = f"attn_{'output' if x == 'o' else x}.bias"
        if family == "qwen3_moe":
            names.update({"post_attention_layernorm.weight": "ffn_norm.weight",
                          "self_attn.q_norm.weight": "attn_q_norm.weight",
                          "self_attn.k_norm.weight": "attn_k_norm.weight",
                          "mlp.gate.weight": "ffn_gate_inp.weight",
                          "mlp.gate_proj.weight": "ffn_gate.weight",
                          "mlp.up_proj.weight": "ffn_up.weight",
                          "mlp.down_proj.weight": "ffn_down.weight"})
        else:
            names.update({"post_attention_layernorm.weight": "post_attention_norm.weight",
                          "self_attn.sinks": "attn_sinks.weight",
                          "mlp.router.weight": "ffn_gate_inp.weight",
                          "mlp.router.bias": "ffn_gate_inp.bias"})
        for hf, gg in names.items():
            if p + hf in sd:
                w.add_tensor(b + gg, f32(sd[p + hf]))
        ex = getattr(model.model.layers[i].mlp, "experts", None)
        if ex is None:
            continue
        if family == "qwen3_moe":  # HF v5 keeps [E, 2I, H] (gate rows, then up rows) and [E, H, I]
            I = cfg.moe_intermediate_size
            experts(b + "ffn_gate_exps.weight", ex.gate_up_proj[:, :I], ex.gate_up_proj,
                    lambda prm, v: prm.data[:, :I].copy_(v))
            experts(b + "ffn_up_exps.weight", ex.gate_up_proj[:, I:], ex.gate_up_proj,
                    lambda prm, v: prm.data[:, I:].copy_(v))
            experts(b + "ffn_down_exps.weight", ex.down_proj, ex.down_proj,
                    lambda prm, v: prm.data.copy_(v))
        else:  # GPT-OSS: [E, H, 2I] with gate/up interleaved; llama.cpp stores [E, I, H] each
            gu = ex.gate_up_proj.transpose(1, 2)  # [E, 2I, H]
            experts(b + "ffn_gate_exps.weight", gu[:, ::2], ex.gate_up_proj,
                    lambda prm, v: prm.data[..., ::2].copy_(v.transpose(1, 2)))
            experts(b + "ffn_up_exps.weight", gu[:, 1::2], ex.gate_up_proj,
                    lambda prm, v: prm.data[..., 1::2].copy_(v.transpose(1, 2)))
            experts(b + "ffn_down_exps.weight", ex.down_proj.transpose(1, 2), ex.down_proj,
                    lambda prm, v: prm.data.copy_(v.transpose(1, 2)))
            w.add_tensor(b + "ffn_gate_exps.bias", f32(ex.gate_up_proj_bias[:, ::2]))
            w.add_tensor(b + "ffn_up_exps.bias", f32(ex.gate_up_proj_bias[:, 1::2]))
            w.add_tensor(b + "ffn_down_exps.bias", f32(ex.down_proj_bias))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out


def to_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [..., K] (K % 32 == 0) -> (blocks [..., K/32, 16] uint8, scales [..., K/32] uint8, the
    values they stand for): nearest FP4 codes under a per-32 power-of-two scale (OCP MX)."""
    from flatserve.model.moe import FP4_VALUES

    lut = torch.tensor(FP4_VALUES)
    g = w.float().reshape(*w.shape[:-1], -1, 32)  # [..., G, 32]
    amax = g.abs().amax(-1).clamp_min(1e-30)
    e = torch.floor(torch.log2(amax)) - 2  # the group max lands in [4, 8) * 2^e
    codes = ((g / torch.exp2(e)[..., None])[..., None] - lut).abs().argmin(-1)  # [..., G, 32]
    vals = (lut[codes] * torch.exp2(e)[..., None]).reshape(w.shape)
    c = codes.to(torch.uint8)
    blocks = c[..., 0::2] | (c[..., 1::2] << 4)  # low nibble: the even element
    return blocks, (e + 127).to(torch.uint8), vals
