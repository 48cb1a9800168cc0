"""An HF config for the dense families from a GGUF file's llama.cpp metadata.

transformers reads no config for `granite` or `smollm3` files, and for `qwen2`, `phi3` and
`gemma2` it drops what flatserve needs (Gemma 2's soft-caps and window, Phi-3's partial rotary
and LongRoPE factors), so these architectures are read here, key by key as llama.cpp's converter
writes them. What llama.cpp itself hard-codes rather than stores is hard-coded the same way
(SmolLM3's NoPE every 4th layer, Gemma 2's alternating window and query scale). A `llama`
file with `llama.attention.sliding_window` is read here as a windowed Mistral (transformers'
llama reader drops the window); other `llama` files go to transformers as before.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

# GGUF `general.architecture` -> (HF config class, HF architecture)
ARCHS = {
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM"),
    "granite": ("GraniteConfig", "GraniteForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
}
SMOLLM3_NOPE_STEP = 4  # llama.cpp: hparams.n_no_rope_layer_step for LLM_ARCH_SMOLLM3
GEMMA2_27B_LAYERS = 46  # llama.cpp scales Gemma 2 27B's queries by hidden/heads, others by head_dim


def read_fields(reader: Any) -> dict[str, Any]:
    """GGUF metadata as plain Python values (strings decoded, arrays as lists), tokenizer arrays
    left out (a 262k-entry vocabulary is not needed here)."""
    from gguf import GGUFValueType

    out: dict[str, Any] = {}
    for name, f in reader.fields.items():
        if name.startswith("tokenizer.ggml.") and name not in ("tokenizer.ggml.bos_token_id",
                                                               "tokenizer.ggml.eos_token_id"):
            continue
        if not f.types:
            continue
        vals = []
        for i in f.data:
            part = f.parts[i]
            if f.types[-1] == GGUFValueType.STRING:
                vals.append(bytes(part).decode())
            else:
                vals.append(part.tolist()[0] if len(part) == 1 else part.tolist())
        out[name] = vals if f.types[0] == GGUFValueType.ARRAY else vals[0]
    return out


def apply_rope_freqs(path: Path, cfg: Any) -> None:
    """Llama 3.x rope scaling: llama.cpp's converter writes it as a `rope_freqs` tensor (one
    divisor per frequency) and no metadata, so transformers' GGUF reader loses it. Fixed
    per-frequency divisors are LongRoPE with one factor set and no switch (original_max at the
    context length, attention factor 1); without them every position's low frequencies were
    wrong (Llama 3.1: divided by 8 in the checkpoint, not here)."""
    import gguf

    t = next((t for t in gguf.GGUFReader(str(path)).tensors if t.name == "rope_freqs.weight"), None)
    if t is None:
        return
    f = [float(x) for x in t.data]
    rope = dict(cfg.rope_parameters or {})
    rope.update(rope_type="longrope", short_factor=f, long_factor=f, attention_factor=1.0,
                original_max_position_embeddings=cfg.max_position_embeddings)
    rope.pop("factor", None)
    cfg.rope_parameters = rope


def hf_config(path: Path) -> Any | None:
    """The HF config for a dense-family GGUF, or None where transformers' own reader is used."""
    import gguf
    import transformers

    reader = gguf.GGUFReader(str(path))
    kv = read_fields(reader)
    arch = kv["general.architecture"]
    if arch == "llama" and "llama.attention.sliding_window" in kv:
        cls_name, hf_arch = "MistralConfig", "MistralForCausalLM"  # a windowed Mistral
    elif arch not in ARCHS:
        return None  # transformers' reader (Llama, Qwen3, Gemma 3)
    else:
        cls_name, hf_arch = ARCHS[arch]

    def get(key: str, default: Any = None) -> Any:
        return kv.get(f"{arch}.{key}", default)

    n_layers, hidden, n_heads = get("block_count"), get("embedding_length"), get("attention.head_count")
    head_dim = get("attention.key_length") or hidden // n_heads
    names = {t.name for t in reader.tensors}
    vocab = next(t for t in reader.tensors if t.name == "token_embd.weight").shape[-1]
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": float(get("rope.freq_base", 10000.0))}
    rot = get("rope.dimension_count")
    if rot and rot != head_dim:
        rope["partial_rotary_factor"] = rot / head_dim
    c: dict[str, Any] = dict(
        vocab_size=int(vocab), hidden_size=hidden, intermediate_size=get("feed_forward_length"),
        num_hidden_layers=n_layers, num_attention_heads=n_heads,
        num_key_value_heads=get("attention.head_count_kv", n_heads), head_dim=head_dim,
        rms_norm_eps=get("attention.layer_norm_rms_epsilon"), max_position_embeddings=get("context_length"),
        tie_word_embeddings="output.weight" not in names, rope_parameters=rope,
        bos_token_id=kv.get("tokenizer.ggml.bos_token_id"), eos_token_id=kv.get("tokenizer.ggml.eos_token_id"),
        architectures=[hf_arch])
    window = get("attention.sliding_window")
    if hf_arch == "MistralForCausalLM":
        c["sliding_window"] = window
    elif arch == "phi3":
        _phi3(reader, get, rope, c)
        c["sliding_window"] = window or None
    elif arch == "granite":
        c.update(attention_multiplier=get("attention.scale", 1.0), embedding_multiplier=get("embedding_scale", 1.0),
                 residual_multiplier=get("residual_scale", 1.0), logits_scaling=get("logit_scale", 1.0))
    elif arch == "smollm3":
        c["no_rope_layers"] = [int((i + 1) % SMOLLM3_NOPE_STEP != 0) for i in range(n_layers)]
    elif arch == "gemma2":
        c.update(attn_logit_softcapping=get("attn_logit_softcapping"),
                 final_logit_softcapping=get("final_logit_softcapping"), sliding_window=window,
                 query_pre_attn_scalar=hidden // n_heads if n_layers == GEMMA2_27B_LAYERS else head_dim,
                 layer_types=["sliding_attention" if i % 2 == 0 else "full_attention"
                              for i in range(n_layers)],
                 hidden_activation="gelu_pytorch_tanh")
    elif arch == "qwen2" and window:
        c.update(use_sliding_window=True, sliding_window=window)
    return getattr(transformers, cls_name)(**c)


def _phi3(reader: Any, get: Any, rope: dict[str, Any], c: dict[str, Any]) -> None:
    """LongRoPE: the factors are tensors (rope_factors_short / _long), the rest metadata."""
    orig = get("rope.scaling.original_context_length")
    c["original_max_position_embeddings"] = orig or c["max_position_embeddings"]
    factors = {t.name: t for t in reader.tensors if t.name.startswith("rope_factors_")}
    if not factors:
        return
    rope.update(rope_type="longrope", original_max_position_embeddings=c["original_max_position_embeddings"],
                short_factor=[float(x) for x in factors["rope_factors_short.weight"].data],
                long_factor=[float(x) for x in factors["rope_factors_long.weight"].data])
    attn = get("rope.scaling.attn_factor")
    if attn:
        rope["attention_factor"] = float(attn)
