"""Shared layers. Token-wise layers see a flat [T, ...] strip; only `Attention` reads metadata."""
from __future__ import annotations

import math
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from flatserve.attention.base import AttentionBackend, LayerAttnParams
from flatserve.attention.metadata import current_metadata
from flatserve.model.config import ModelConfig, RopeConfig


class Embedding(nn.Embedding):
    """nn.Embedding that skips its random initialiser on the meta device (weights are loaded
    over it). On meta, `normal_` runs through torch's Python refs, whose first call imports
    torch._dynamo and with it triton: 66 MB of libtriton.so resident (~90 MB RSS in all) in a
    CPU-only engine, which never compiles anything (docs/performance-cpu.md)."""

    def reset_parameters(self) -> None:
        if not self.weight.is_meta:
            super().reset_parameters()


class RMSNorm(nn.Module):
    """x / rms(x) * w (Llama, Qwen) or * (1 + w) (Gemma: `offset=1`), computed in fp32 like HF.

    With `residual`: returns (norm(x + residual), x + residual), the decoder's running sum
    (the fused kernel updates `residual` in place and returns it)."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))
        self.eps, self.offset = eps, offset
        self.fused: Callable[..., torch.Tensor] | None = None  # flatserve.ops.enable sets it
        self.fused_pair: Callable[..., torch.Tensor] | None = None  # and this, where it exists

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> Any:
        if residual is not None:
            if self.fused is not None:
                return self.fused(x, self.weight, self.eps, bool(self.offset), residual), residual
            residual = x + residual
            return self._norm(residual), residual
        if self.fused is not None and x.dim() == 2:
            return self.fused(x, self.weight, self.eps, bool(self.offset))
        return self._norm(x)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:  # Gemma multiplies in fp32, then casts
            return (xf * (self.offset + self.weight.float())).to(x.dtype)
        return self.weight * xf.to(x.dtype)


def norm_then_add_norm(first: RMSNorm, second: RMSNorm, x: torch.Tensor, residual: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """second(first(x) + residual), residual updated: Gemma's post-attention norm, then the
    pre-MLP norm of the running sum; one pass where the fused pair op is set (C++ on the CPU,
    the two calls' bits), else the two norms."""
    if first.fused_pair is not None and second.fused is not None and x.dim() == 2 \
            and first.eps == second.eps and first.offset == second.offset:
        return first.fused_pair(x, first.weight, second.weight, first.eps, bool(first.offset),
                                residual), residual
    return second(first(x), residual)


def rope_inv_freq(rope: RopeConfig, dim: int, long: bool = False) -> torch.Tensor:
    """[dim/2] inverse frequencies; `long` picks LongRoPE's long factors (else its short ones)."""
    inv = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))  # [D/2]
    if rope.rope_type == "longrope":
        return inv / torch.tensor(rope.long_factor if long else rope.short_factor, dtype=torch.float32)
    if rope.rope_type == "linear":
        return inv / rope.factor
    if rope.rope_type == "llama3":
        low_wl = rope.original_max_position / rope.low_freq_factor
        high_wl = rope.original_max_position / rope.high_freq_factor
        wavelen = 2 * math.pi / inv
        scaled = torch.where(wavelen > low_wl, inv / rope.factor, inv)
        smooth = (rope.original_max_position / wavelen - rope.low_freq_factor) / (
            rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wl) & ~(wavelen > low_wl)
        return torch.where(medium, smoothed, scaled)
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(rope, dim, inv)
    return inv


def _yarn_inv_freq(rope: RopeConfig, dim: int, inv: torch.Tensor) -> torch.Tensor:
    """YaRN: frequencies that turn fewer than beta_slow times over the original context are
    interpolated (/ factor), those above beta_fast kept, a linear ramp between (HF's maths)."""
    def corr(rot: float) -> float:  # the dimension that turns `rot` times over the context
        return dim * math.log(rope.original_max_position / (rot * 2 * math.pi)) / (2 * math.log(rope.theta))
    lo, hi = corr(rope.beta_fast), corr(rope.beta_slow)
    if rope.truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - lo) / ((hi - lo) or 0.001)).clamp(0, 1)
    extra = 1 - ramp  # [D/2] share of the unscaled frequency
    pos = rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)  # HF's rounding
    return 1.0 / (rope.factor * pos) * (1 - extra) + inv * extra


def rope_attention_factor(rope: RopeConfig) -> float:
    """The factor on cos and sin (YaRN's 0.1 ln(factor) + 1 unless given); 1 for other ropes."""
    if rope.rope_type == "longrope":
        return rope.attention_factor or 1.0  # set from the config (model/config.py)
    if rope.rope_type != "yarn":
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor
    return 1.0 if rope.factor <= 1 else 0.1 * math.log(rope.factor) + 1.0


class RopeTable:
    """An fp32 [2, P, D] cos|sin table, shared by every layer with the same rope and head size."""
    __slots__ = ("t",)

    def __init__(self) -> None:
        self.t: torch.Tensor | None = None


class Rotary(nn.Module):
    """Neox-style (rotate-half) rotary embedding on a head's first `dim` dims (the rest pass
    through: Phi-4-mini's partial rotary); the cos/sin table grows on demand.

    Layers with the same rope and head size share one table (`share_rope_tables`): each held its
    own before, and Gemma 3 270M's 18 layers then kept 18 copies of its two tables, 288 MB at
    a 4,096-token max_model_len, grown after start-up had planned the memory budget.

    LongRoPE (Phi-3): the table holds the short factors' rows for positions 0..P-1, then the long
    factors' at P..2P-1, both scaled by the attention factor; `index` sends the tokens of a
    sequence longer than original_max_position to the second half, so that the fused kernels
    take the same table and an index like any other rope."""

    def __init__(self, rope: RopeConfig, dim: int) -> None:
        super().__init__()
        self.rope, self.dim = rope, dim
        self.longrope = rope.rope_type == "longrope"
        # On the meta device (the loader's skeleton) only the shape: reset_buffers fills it after
        # to_empty. Computed there, it ran torch's Python refs, whose first call imports
        # torch._dynamo and triton (66 MB of libtriton.so resident in a CPU-only engine).
        meta = torch.empty(0).is_meta
        inv = torch.empty((dim + 1) // 2) if meta else rope_inv_freq(rope, dim)  # [D/2]
        self.register_buffer("inv_freq", inv, persistent=False)
        self.store = RopeTable()

    def reset_buffers(self) -> None:
        """Recompute in fp32 on the current device (after meta init or a dtype cast)."""
        device = self.inv_freq.device
        self.inv_freq = rope_inv_freq(self.rope, self.dim).to(device)
        self.store.t = None

    def table(self, n: int) -> torch.Tensor:
        """fp32 [2, P, D] cos|sin for positions < P (P >= n; grown lazily to a power of two);
        LongRoPE: [2, 2P, D], short rows then long rows."""
        t = self.store.t
        if t is None or t.shape[1] >> self.longrope < n:
            self.build(1 << max(10, (n - 1).bit_length()))
        return self.store.t

    def build(self, size: int) -> int:
        """The shared table for exactly `size` positions, replacing the old one; -> its bytes."""
        pos = torch.arange(size, device=self.inv_freq.device, dtype=torch.float32)
        freqs = [pos[:, None] * self.inv_freq[None, :]]  # [P, D/2]
        if self.longrope:
            long = rope_inv_freq(self.rope, self.dim, long=True).to(pos.device)
            freqs.append(pos[:, None] * long[None, :])
        emb = torch.cat([torch.cat([f, f], dim=-1) for f in freqs])  # [P or 2P, D]
        self.store.t = None  # the old table goes before the new one is built
        self.store.t = torch.stack([emb.cos(), emb.sin()])  # [2, P, D]
        if (af := rope_attention_factor(self.rope)) != 1.0:  # YaRN scales both, as HF does
            self.store.t *= af
        return self.store.t.numel() * 4

    def index(self, positions: torch.Tensor, meta: Any) -> torch.Tensor:
        """Table rows for `positions` [T]: the positions themselves, or for LongRoPE + P where
        the token takes the long factors. transformers' generate picks them per forward by the
        longest position it is given: a prompt of L tokens takes them iff L > original_max, the
        decode step at position p iff p + 1 > original_max. Per token that is
        max(p + 1, L) > original_max, a rule that holds whatever the chunking, speculation or
        preemption (a per-step rule would not). Device ops only on the decode-graph path."""
        if not self.longrope:
            return positions
        orig = self.rope.original_max_position
        P = self.table(meta.max_seq_len + 1).shape[1] // 2
        long = positions + 1 > orig  # [T]
        lens = meta.prompt_lens_host
        if lens is not None and max(lens, default=0) > orig:  # some prompt is itself long
            flags = meta.derived.get("longrope")
            if flags is None:  # once per step, reused by every layer
                cu = meta.cu_seqlens_q_host
                per_seq = torch.tensor([L > orig for L in lens])  # [S], then one row per token
                per_tok = per_seq.repeat_interleave(torch.tensor([b - a for a, b in zip(cu, cu[1:])]))
                flags = meta.derived["longrope"] = per_tok.to(positions.device)
            long = long | flags
        return positions + long.to(positions.dtype) * P

    def forward(self, index: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                max_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        cs = self.table(max_pos + 1)[:, index]  # [2, T, R]
        cos, sin = cs[0, :, None, :].to(q.dtype), cs[1, :, None, :].to(q.dtype)  # [T, 1, R]
        if self.dim == q.shape[-1]:
            return _rotate(q, cos, sin), _rotate(k, cos, sin)
        R = self.dim
        return (torch.cat([_rotate(q[..., :R], cos, sin), q[..., R:]], dim=-1),
                torch.cat([_rotate(k[..., :R], cos, sin), k[..., R:]], dim=-1))


def share_rope_tables(model: nn.Module) -> list[Rotary]:
    """Point every Rotary with the same rope config, head size and device at one table;
    -> one Rotary per distinct table."""
    first: dict[tuple, Rotary] = {}
    for m in model.modules():
        if isinstance(m, Rotary):
            key = (m.rope, m.dim, str(m.inv_freq.device))  # rope configs are frozen: hashable
            if key in first:
                m.store = first[key].store
            else:
                first[key] = m
    return list(first.values())


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class PackedLinear(nn.Linear):
    """Several HF projections fused along the output dim at load time (q|k|v, gate|up)."""

    def __init__(self, in_features: int, shards: dict[str, int], bias: bool) -> None:
        super().__init__(in_features, sum(shards.values()), bias=bias)
        self.offsets: dict[str, tuple[int, int]] = {}
        off = 0
        for name, size in shards.items():
            self.offsets[name] = (off, size)
            off += size

    def load_shard(self, param: nn.Parameter, tensor: torch.Tensor, shard: str) -> None:
        off, size = self.offsets[shard]
        dst = param.data.narrow(0, off, size)
        assert dst.shape == tensor.shape, f"{shard}: {tuple(tensor.shape)} != {tuple(dst.shape)}"
        dst.copy_(tensor)


ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


class GatedMLP(nn.Module):
    def __init__(self, hidden: int, inter: int, act: str) -> None:
        super().__init__()
        if act not in ACTIVATIONS:
            raise ValueError(f"unsupported activation {act!r}")
        self.gate_up_proj = PackedLinear(hidden, {"gate_proj": inter, "up_proj": inter}, False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)
        self.act, self.act_name = ACTIVATIONS[act], act
        self.fused: Callable[[torch.Tensor, str], torch.Tensor] | None = None
        self.gated = False  # gate_up_proj itself returns act(gate) * up (flatserve.ops.enable)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gated:
            return self.down_proj(self.gate_up_proj(x))
        if self.fused is not None:
            return self.down_proj(self.fused(self.gate_up_proj(x), self.act_name))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [T, I] each
        return self.down_proj(self.act(gate) * up)


class DecoderLayers(nn.ModuleList):
    """A model's decoder layers, run in order on (h, residual). `fast`, where the runner sets
    one (the C++ decoder stack of CPU decode steps, model/cpu_stack.py), takes the steps it
    can: it returns None for the others, which run here."""

    def __init__(self, layers: Any) -> None:
        super().__init__(layers)
        self.fast: Callable[..., tuple[torch.Tensor, torch.Tensor] | None] | None = None

    def forward(self, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor
                ) -> tuple[torch.Tensor, torch.Tensor]:
        if self.fast is not None:
            out = self.fast(h, residual, positions)
            if out is not None:
                return out
        for layer in self:
            h, residual = layer(h, residual, positions)
        return h, residual


class Attention(nn.Module):
    """q/k/v projections (+ optional per-head q/k RMSNorm), rotary, then one backend call."""

    def __init__(self, cfg: ModelConfig, layer: int, qk_norm: bool, norm_offset: float = 0.0) -> None:
        super().__init__()
        self.hq, self.hkv, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.qkv_proj = PackedLinear(cfg.hidden_size, {
            "q_proj": self.hq * self.d, "k_proj": self.hkv * self.d, "v_proj": self.hkv * self.d,
        }, cfg.qkv_bias or cfg.attention_bias)
        self.o_proj = nn.Linear(self.hq * self.d, cfg.hidden_size, bias=cfg.attention_bias)
        if qk_norm:
            self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps, norm_offset)
            self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps, norm_offset)
        self.qk_norm = qk_norm
        rope = cfg.ropes[layer]  # None: a NoPE layer (SmolLM3), nothing rotates
        self.rotary = None if rope is None else Rotary(rope, cfg.rotary_dim or self.d)
        self.params = LayerAttnParams(cfg.query_scale, cfg.sliding_windows[layer],
                                      cfg.attn_logit_softcap)
        # GPT-OSS: one logit per query head that joins every softmax with no value (HF's name).
        self.sinks = nn.Parameter(torch.zeros(self.hq)) if cfg.attention_sinks else None
        # Bound by the runner once the KV pool exists (bind).
        self.backend: AttentionBackend | None = None
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None
        self.fused: Callable[..., None] | None = None  # q/k norm + rotary in one kernel
        self.rope_stores_kv = False  # and it takes the KV write (flatserve.ops.enable)
        self.stores_kv = False  # ... and the bound backend only attends (bind)

    def bind(self, backend: AttentionBackend, kv_cache: tuple[torch.Tensor, torch.Tensor]) -> None:
        """The runner's backend and this layer's [num_blocks, block_size, Hkv, D] caches. The fused
        rope writes k and v into the caches where it can (Triton) and the backend has `attend`."""
        self.backend, self.kv_cache = backend, kv_cache
        self.stores_kv = self.fused is not None and self.rope_stores_kv and hasattr(backend, "attend")

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.o_proj(self.attend_qkv(self.qkv_proj(x), positions))

    def attend_qkv(self, qkv: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """q|k|v [T, (Hq + 2 Hkv) D] -> the heads' outputs [T, Hq D], before o_proj (q/k norm,
        rotary, the KV write, attention)."""
        T = qkv.shape[0]
        q, k, v = qkv.split([self.hq * self.d, self.hkv * self.d, self.hkv * self.d], -1)
        q = q.view(T, self.hq, self.d)  # [T, Hq, D]
        k = k.view(T, self.hkv, self.d)  # [T, Hkv, D]
        v = v.view(T, self.hkv, self.d)
        meta = current_metadata()
        assert self.backend is not None and self.kv_cache is not None, "runner binds the KV pool"
        stored = self.stores_kv  # the fused rope writes k and v, the backend only attends
        extra = () if self.sinks is None else (self.sinks,)
        if self.fused is not None:  # in place on the q/k views of the qkv output
            n = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps, bool(self.q_norm.offset)) \
                if self.qk_norm else (None, None, 0.0, False)
            rope = (self.rotary.index(positions, meta), self.rotary.table(meta.max_seq_len + 1), *n)
            if stored and getattr(self.backend, "decode_fits", None) \
                    and self.backend.decode_fits(meta, self.d, self.rotary.dim, self.hkv):
                # decode: the rope, KV write and attention in one launch (Triton)
                o = self.backend.decode_rope(q, k, v, *self.kv_cache, meta, self.params, rope, *extra)
                return o.reshape(T, self.hq * self.d)
            self.fused(q, k, *rope, **({"store": (v, *self.kv_cache, meta.slot_mapping)} if stored else {}))
        else:
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            if self.rotary is not None:
                q, k = self.rotary(self.rotary.index(positions, meta), q, k, meta.max_seq_len)
        if stored:
            o = self.backend.attend(q, *self.kv_cache, meta, self.params, *extra)  # [T, Hq, D]
        else:
            o = self.backend.forward(q, k, v, *self.kv_cache, meta, self.params, *extra)
        return o.reshape(T, self.hq * self.d)
