"""Frozen model description derived once from an HF config; layers never see the HF object."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"  # default | linear | llama3 | yarn | longrope
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192
    # YaRN (GPT-OSS): the ramp's rotation bounds, whether its ends are rounded, and the factor
    # that scales cos and sin (so q.k by its square); None derives it from `factor`.
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None

    # LongRoPE (Phi-3): per-frequency divisors for sequences up to / past original_max_position,
    # and the cos/sin scale (sqrt(1 + ln(factor) / ln(original)) unless the config gives it).
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()

@dataclass(frozen=True, slots=True)
class MoeConfig:
    """Sparse MLP layers: Qwen3-MoE (softmax over all experts, then top-k, renormalized with
    norm_topk_prob) or GPT-OSS (top-k of biased logits, softmax over those k; clamped SwiGLU
    with alpha and limit, biases on the experts)."""
    num_experts: int
    top_k: int
    intermediate_size: int  # per expert
    sparse_layers: tuple[bool, ...]  # one per layer; False = the dense MLP
    norm_topk_prob: bool = False
    router: str = "softmax_topk"  # softmax_topk (Qwen3-MoE) | topk_softmax (GPT-OSS)
    router_bias: bool = False
    expert_bias: bool = False
    swiglu_limit: float | None = None  # GPT-OSS's clamped SwiGLU; None: act(gate) * up
    swiglu_alpha: float = 1.702


@dataclass(frozen=True, slots=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    hidden_act: str
    attention_bias: bool  # o_proj bias (and q/k/v's unless qkv_bias says otherwise)
    ropes: tuple[RopeConfig | None, ...]  # one per layer; None = no rotary (SmolLM3's NoPE layers)
    sliding_windows: tuple[int | None, ...]  # one per layer; None = full attention
    query_scale: float  # softmax scale
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    eos_token_ids: tuple[int, ...] = ()
    attention_sinks: bool = False  # GPT-OSS: one learned logit per head in every softmax
    moe: MoeConfig | None = None
    qkv_bias: bool = False  # Qwen2: q/k/v biases without an o_proj bias
    rotary_dim: int = 0  # leading dims of each head that rotate (Phi-4-mini: 0.75 of 128); 0 = all
    # Granite's scalars: embeddings * e, each block output * r before the residual add, logits / s.
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0

    @property
    def kv_bytes_per_token(self) -> int:
        """Elements of K and V for one token over all layers (multiply by the dtype size)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    @classmethod
    def from_hf(cls, hf: Any) -> ModelConfig:
        arch = (getattr(hf, "architectures", None) or [""])[0]
        text = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
        n_layers = text.num_hidden_layers
        n_heads = text.num_attention_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // n_heads
        window = getattr(text, "sliding_window", None)
        if getattr(text, "use_sliding_window", True) is False:
            window = None
        # Mistral and Phi-3 name no layer types: their window (if any) is on every layer.
        all_types = "sliding_attention" if window else "full_attention"
        layer_types = list(getattr(text, "layer_types", None) or [all_types] * n_layers)
        windows = tuple(window if t == "sliding_attention" and window else None
                        for t in layer_types)
        no_rope = list(getattr(text, "no_rope_layers", None) or [1] * n_layers)  # 0 = NoPE layer
        ropes = tuple(_rope_for(text, t) if use else None
                      for t, use in zip(layer_types, no_rope))
        qpas = getattr(text, "query_pre_attn_scalar", None)
        scale = getattr(text, "attention_multiplier", None) or (qpas if qpas else head_dim) ** -0.5
        eos = getattr(text, "eos_token_id", None)
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        return cls(
            architecture=arch, vocab_size=text.vocab_size, hidden_size=text.hidden_size,
            intermediate_size=text.intermediate_size, num_layers=n_layers, num_heads=n_heads,
            num_kv_heads=getattr(text, "num_key_value_heads", None) or n_heads,
            head_dim=head_dim, rms_norm_eps=text.rms_norm_eps,
            max_position_embeddings=text.max_position_embeddings,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            hidden_act=getattr(text, "hidden_activation", None) or getattr(text, "hidden_act", "silu"),
            attention_bias=bool(getattr(text, "attention_bias", False)),
            ropes=ropes, sliding_windows=windows, query_scale=scale,
            attn_logit_softcap=getattr(text, "attn_logit_softcapping", None),
            final_logit_softcap=getattr(text, "final_logit_softcapping", None),
            eos_token_ids=eos_ids,
            attention_sinks=arch == "GptOssForCausalLM",
            moe=_moe_for(text, n_layers),
            qkv_bias=arch == "Qwen2ForCausalLM" or bool(getattr(text, "attention_bias", False)),
            rotary_dim=_rotary_dim(text, head_dim),
            embedding_multiplier=float(getattr(text, "embedding_multiplier", 1.0)),
            residual_multiplier=float(getattr(text, "residual_multiplier", 1.0)),
            logits_scaling=float(getattr(text, "logits_scaling", 1.0)),
        )

    @property
    def rope_switch_len(self) -> int | None:
        """LongRoPE: sequences longer than this use the long factors (None: no switch)."""
        r = next((r for r in self.ropes if r is not None), None)
        return r.original_max_position if r is not None and r.rope_type == "longrope" else None


def _rotary_dim(text: Any, head_dim: int) -> int:
    params = getattr(text, "rope_parameters", None)
    f = params.get("partial_rotary_factor") if isinstance(params, dict) else None
    f = f or getattr(text, "partial_rotary_factor", None) or 1.0
    return int(head_dim * f)


def _moe_for(text: Any, n_layers: int) -> MoeConfig | None:
    """Qwen3-MoE's `num_experts` or GPT-OSS's `num_local_experts`; None for dense models."""
    if getattr(text, "model_type", "") == "gpt_oss":
        return MoeConfig(
            num_experts=text.num_local_experts, top_k=text.num_experts_per_tok,
            intermediate_size=text.intermediate_size, sparse_layers=(True,) * n_layers,
            router="topk_softmax", router_bias=True, expert_bias=True,
            # transformers' GPT-OSS constants where a config predates the fields
            swiglu_limit=float(getattr(text, "swiglu_limit", 7.0)),
            swiglu_alpha=float(getattr(text, "swiglu_alpha", 1.702)))
    n = getattr(text, "num_experts", 0) or 0
    if not n or not hasattr(text, "moe_intermediate_size"):
        return None
    dense = set(getattr(text, "mlp_only_layers", None) or ())
    step = getattr(text, "decoder_sparse_step", 1) or 1
    return MoeConfig(
        num_experts=n, top_k=text.num_experts_per_tok, intermediate_size=text.moe_intermediate_size,
        sparse_layers=tuple(i not in dense and (i + 1) % step == 0 for i in range(n_layers)),
        norm_topk_prob=bool(getattr(text, "norm_topk_prob", False)))


def _rope_for(text: Any, layer_type: str) -> RopeConfig:
    """Read rope settings from transformers v5 `rope_parameters` or v4 `rope_theta/rope_scaling`."""
    params = getattr(text, "rope_parameters", None)
    if isinstance(params, dict) and layer_type in params:
        params = params[layer_type]  # per-layer-type dict (Gemma 3: local vs global base)
    if not isinstance(params, dict):
        params = dict(getattr(text, "rope_scaling", None) or {})
        params.setdefault("rope_theta", getattr(text, "rope_theta", 10000.0))
        if layer_type == "sliding_attention" and hasattr(text, "rope_local_base_freq"):
            params = {"rope_theta": text.rope_local_base_freq}
    rope_type = params.get("rope_type", params.get("type", "default")) or "default"
    if rope_type not in ("default", "linear", "llama3", "yarn", "longrope"):
        raise ValueError(f"unsupported rope_type {rope_type!r} "
                         f"(supported: default, linear, llama3, yarn, longrope)")
    orig = params.get("original_max_position_embeddings") or getattr(
        text, "original_max_position_embeddings", None) or 8192
    attn_factor = 1.0
    if rope_type == "longrope":
        # transformers' default: factor = max_position / original, scale from that factor
        factor = params.get("factor") or text.max_position_embeddings / orig
        attn_factor = params.get("attention_factor") or (
            1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(orig)))
    af = params.get("attention_factor")
    return RopeConfig(
        theta=float(params.get("rope_theta", 10000.0)), rope_type=rope_type,
        factor=float(params.get("factor", 1.0) or 1.0),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position=int(orig),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
        attention_factor=attn_factor if rope_type == "longrope" else (None if af is None else float(af)),
        short_factor=tuple(float(x) for x in params.get("short_factor") or ()),
        long_factor=tuple(float(x) for x in params.get("long_factor") or ()),
    )
