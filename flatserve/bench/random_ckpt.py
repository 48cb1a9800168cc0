"""Random-weight checkpoints at real sizes (no hub here): published configs, random weights.

    python -m flatserve.bench.random_ckpt qwen3-0.6b /tmp/ckpt   # writes config, safetensors, tokenizer
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

SHAPES: dict[str, dict[str, Any]] = {
    # Published configs (Qwen/Qwen3-0.6B, Qwen/Qwen3-8B, meta-llama/Meta-Llama-3-8B).
    "qwen3-0.6b": dict(arch="Qwen3ForCausalLM", vocab_size=151936, hidden_size=1024,
                       intermediate_size=3072, num_hidden_layers=28, num_attention_heads=16,
                       num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                       rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=True),
    "qwen3-8b": dict(arch="Qwen3ForCausalLM", vocab_size=151936, hidden_size=4096,
                     intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                     rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False),
    "llama-3-8b": dict(arch="LlamaForCausalLM", vocab_size=128256, hidden_size=4096,
                       intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                       num_key_value_heads=8, head_dim=128, max_position_embeddings=8192,
                       rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False),
    # Published configs (Qwen/Qwen3-30B-A3B, openai/gpt-oss-20b); bf16 experts (61 GB and 42 GB
    # on disk: more than a 64 GiB device disk holds for the first, see docs/performance-gpu.md).
    "qwen3-30b-a3b": dict(arch="Qwen3MoeForCausalLM", model_type="qwen3_moe", vocab_size=151936,
                          hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
                          num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                          head_dim=128, num_experts=128, num_experts_per_tok=8,
                          norm_topk_prob=True, max_position_embeddings=40960,
                          rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False),
    "gpt-oss-20b": dict(arch="GptOssForCausalLM", model_type="gpt_oss", vocab_size=201088,
                        hidden_size=2880, intermediate_size=2880, num_hidden_layers=24,
                        num_attention_heads=64, num_key_value_heads=8, head_dim=64,
                        num_local_experts=32, num_experts_per_tok=4, sliding_window=128,
                        max_position_embeddings=131072, rms_norm_eps=1e-5,
                        tie_word_embeddings=False),
}


def word_tokenizer(vocab_size: int) -> Any:
    """A word-level tokenizer over `vocab_size` made-up words ("w17"): offline, exact counts."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3}
    vocab.update({f"w{i}": i for i in range(4, vocab_size)})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>", pad_token="<pad>")


def build(shape: str, out: Path, device: str = "cuda", std: float = 0.02, seed: int = 0,
          weights: bool = True) -> Path:
    """`weights` False: config.json and the tokenizer only, for `load_format="dummy"` (the
    engine draws the weights itself; 61 GB of Qwen3-30B-A3B never touch the disk)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(SHAPES[shape])
    arch = spec.pop("arch")
    model_type = spec.pop("model_type", "qwen3" if arch.startswith("Qwen3") else "llama")
    cfg = AutoConfig.for_model(model_type, architectures=[arch], bos_token_id=1, eos_token_id=2,
                               pad_token_id=0, initializer_range=std, **spec)
    if not weights:
        out.mkdir(parents=True, exist_ok=True)
        cfg.save_pretrained(out)
        word_tokenizer(spec["vocab_size"]).save_pretrained(out)
        return out
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out)
    word_tokenizer(spec["vocab_size"]).save_pretrained(out)
    # Free the GPU for the engine under test: its memory budget counts what others hold
    # (an 8B build left 16 GiB behind and flatserve rightly refused to start).
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


if __name__ == "__main__":
    print(build(sys.argv[1], Path(sys.argv[2]), sys.argv[3] if len(sys.argv) > 3 else "cuda"))
