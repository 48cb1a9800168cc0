"""Write a random-weight HF model as a GGUF file the way llama.cpp's convert_hf_to_gguf.py does:
tensor names from the `gguf` package's own HF -> GGUF name map, its metadata keys, q/k rows
permuted for the Llama-derived converters, Gemma's norm weights stored as 1 + w, Phi-3's LongRoPE
factors as tensors. fp32 tensors (no quantization: the comparison is about wiring, not rounding)."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

_ARCH = {"LlamaForCausalLM": "llama", "MistralForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2",
         "Phi3ForCausalLM": "phi3", "SmolLM3ForCausalLM": "smollm3", "GraniteForCausalLM": "granite",
         "Gemma2ForCausalLM": "gemma2"}
_PERMUTED = ("llama", "smollm3", "granite")


def _permute(w: np.ndarray, n_head: int) -> np.ndarray:
    # convert_hf_to_gguf.LlamaModel.permute: rows of each head interleaved for llama.cpp's rope
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama3_factors(cfg: Any) -> np.ndarray:
    """llama.cpp's rope_freqs for Llama 3 scaling: each frequency's divisor (base / scaled)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    base = 1.0 / (cfg.rope_parameters["rope_theta"] ** (np.arange(0, head_dim, 2) / head_dim))
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](cfg, "cpu")
    return (base / scaled.double().numpy()).astype(np.float32)


def write_gguf(model: Any, tokenizer: Any, path: Path, quant: dict[str, str] | None = None) -> Path:
    """`quant`: HF weight-name suffix -> block format (flatserve/model/qformats.py names): those
    tensors are stored quantized, as a llama.cpp quantization of the file would store them."""
    import gguf

    cfg = model.config
    arch = _ARCH[cfg.architectures[0]]
    enum = next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch)
    names = gguf.get_tensor_name_map(enum, cfg.num_hidden_layers)
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name(cfg.architectures[0])
    _metadata(w, cfg, arch)
    _tokenizer(w, tokenizer)
    rope = cfg.rope_parameters or {}
    if rope.get("rope_type") == "longrope":  # Phi3MiniModel.generate_extra_tensors
        w.add_tensor("rope_factors_long.weight", np.asarray(rope["long_factor"], dtype=np.float32))
        w.add_tensor("rope_factors_short.weight", np.asarray(rope["short_factor"], dtype=np.float32))
    if rope.get("rope_type") == "llama3":  # LlamaModel.generate_extra_tensors: 1 / (scaled / base)
        w.add_tensor("rope_freqs.weight", _llama3_factors(cfg))
    heads, kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
    for hf_name, t in model.state_dict().items():
        if hf_name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        a = t.detach().float().numpy()
        if arch in _PERMUTED and hf_name.endswith(("q_proj.weight", "k_proj.weight")):
            a = _permute(a, heads if "q_proj" in hf_name else kv_heads)
        if arch == "gemma2" and hf_name.endswith("norm.weight"):
            a = a + 1.0  # Gemma2Model.modify_tensors
        name = names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        assert name is not None, f"no GGUF name for {hf_name}"
        fmt = next((f for suffix, f in (quant or {}).items() if hf_name.endswith(suffix)), None)
        if fmt is None:
            w.add_tensor(name, np.ascontiguousarray(a))
            continue
        import torch

        from flatserve.model.qformats import FORMATS, quantize

        q = quantize(torch.from_numpy(a), FORMATS[fmt]).numpy()
        w.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType(FORMATS[fmt].ggml_type))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _metadata(w: Any, cfg: Any, arch: str) -> None:
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    rope = cfg.rope_parameters or {}
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(rope.get("rope_theta", 10000.0))
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_dimension_count(int(head_dim * rope.get("partial_rotary_factor", 1.0)))
    if getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        w.add_sliding_window(cfg.sliding_window)
    if arch == "phi3":
        w.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
        if rope.get("rope_type") == "longrope" and rope.get("attention_factor"):
            w.add_rope_scaling_attn_factors(rope["attention_factor"])
    if arch == "granite":
        w.add_attention_scale(cfg.attention_multiplier)
        w.add_embedding_scale(cfg.embedding_multiplier)
        w.add_residual_scale(cfg.residual_multiplier)
        w.add_logit_scale(cfg.logits_scaling)
    if arch == "gemma2":
        w.add_attn_logit_softcapping(cfg.attn_logit_softcapping)
        w.add_final_logit_softcapping(cfg.final_logit_softcapping)


def _tokenizer(w: Any, tok: Any) -> None:
    """The test tokenizer's vocabulary as a BPE ("gpt2") vocabulary without merges: every test
    word is one token, so ids survive the round trip."""
    vocab = sorted(tok.get_vocab().items(), key=lambda kv: kv[1])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list([t for t, _ in vocab])
    w.add_token_scores([0.0] * len(vocab))
    w.add_token_types([3 if t in tok.all_special_tokens else 1 for t, _ in vocab])
    w.add_token_merges([])
    w.add_bos_token_id(tok.bos_token_id)
    w.add_eos_token_id(tok.eos_token_id)
    w.add_pad_token_id(tok.pad_token_id)
    if tok.chat_template:
        w.add_chat_template(tok.chat_template)
