"""Frozen model description derived once from an HF config; layers never see the HF object."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class RopeConfig:
    theta: float
    rope_type: str = "default"  # default | linear | llama3 | yarn
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
    attention_bias: bool
    ropes: tuple[RopeConfig, ...]  # one per layer
    sliding_windows: tuple[int | None, ...]  # one per layer; None = full attention
    query_scale: float  # softmax scale
    attn_logit_softcap: float | None = None
    final_logit_softcap: float | None = None
    eos_token_ids: tuple[int, ...] = ()
    attention_sinks: bool = False  # GPT-OSS: one learned logit per head in every softmax
    moe: MoeConfig | None = None

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
        layer_types = list(getattr(text, "layer_types", None) or ["full_attention"] * n_layers)
        window = getattr(text, "sliding_window", None)
        windows = tuple(window if t == "sliding_attention" and window else None
                        for t in layer_types)
        ropes = tuple(_rope_for(text, t) for t in layer_types)
        qpas = getattr(text, "query_pre_attn_scalar", None)
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
            ropes=ropes, sliding_windows=windows,
            query_scale=(qpas if qpas else head_dim) ** -0.5,
            attn_logit_softcap=getattr(text, "attn_logit_softcapping", None),
            final_logit_softcap=getattr(text, "final_logit_softcapping", None),
            eos_token_ids=eos_ids,
            attention_sinks=arch == "GptOssForCausalLM",
            moe=_moe_for(text, n_layers),
        )


def _moe_for(text: Any, n_layers: int) -> MoeConfig | None:
    """Qwen3-MoE's `num_experts` or GPT-OSS's `num_local_experts`; None for dense models."""
    if getattr(text, "model_type", "") == "gpt_oss":
        return MoeConfig(
            num_experts=text.num_local_experts, top_k=text.num_experts_per_tok,
            intermediate_size=text.intermediate_size, sparse_layers=(True,) * n_layers,
            router="topk_softmax", router_bias=True, expert_bias=True,
            swiglu_limit=float(text.swiglu_limit), swiglu_alpha=float(text.swiglu_alpha))
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
    if rope_type not in ("default", "linear", "llama3", "yarn"):
        raise ValueError(f"unsupported rope_type {rope_type!r} (supported: default, linear, llama3, yarn)")
    af = params.get("attention_factor")
    return RopeConfig(
        theta=float(params.get("rope_theta", 10000.0)), rope_type=rope_type,
        factor=float(params.get("factor", 1.0) or 1.0),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position=int(params.get("original_max_position_embeddings", 8192)),
        beta_fast=float(params.get("beta_fast") or 32.0),
        beta_slow=float(params.get("beta_slow") or 1.0),
        truncate=bool(params.get("truncate", True)),
        attention_factor=None if af is None else float(af),
    )
