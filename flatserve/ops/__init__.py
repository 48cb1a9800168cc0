"""Fused ops, chosen by name: the torch layers run by default; `enable` swaps in Triton kernels.

Names: "rmsnorm" (RMSNorm with the residual add folded in), "rope" (per-head q/k RMSNorm +
rotary, in place), "act" (SiLU / GELU-tanh and the gate*up product). "auto" = all three where
the attention backend is Triton (CUDA), none elsewhere. Each is measured on its own in
docs/benchmarks/gpu.md (`benchmarks/offline_gpu.py --fused-ops ...`).
"""
from __future__ import annotations

from torch import nn

FUSED_OPS = ("rmsnorm", "rope", "act")


def parse_fused_ops(spec: str, backend: str) -> frozenset[str]:
    """'auto' | 'none' | comma list of FUSED_OPS -> the set to enable (ValueError on a typo)."""
    if spec == "auto":
        return frozenset(FUSED_OPS) if backend == "triton" else frozenset()
    if spec in ("none", ""):
        return frozenset()
    names = frozenset(s.strip() for s in spec.split(","))
    bad = sorted(names - set(FUSED_OPS))
    if bad:
        raise ValueError(f"unknown fused op(s) {', '.join(bad)}; choose from {', '.join(FUSED_OPS)}, "
                         f"auto or none")
    if backend != "triton":
        raise ValueError(f"fused ops {', '.join(sorted(names))} need the triton backend (CUDA), "
                         f"not {backend!r}")
    return names


def enable(model: nn.Module, names: frozenset[str]) -> None:
    """Point each layer at its Triton kernel (None keeps the torch reference)."""
    if not names:
        return
    from flatserve.model.layers import Attention, GatedMLP, RMSNorm
    from flatserve.ops import triton_ops

    for m in model.modules():
        if isinstance(m, RMSNorm) and "rmsnorm" in names:
            m.fused = triton_ops.rms_norm
        elif isinstance(m, Attention) and "rope" in names:
            m.fused = triton_ops.qk_norm_rope
        elif isinstance(m, GatedMLP) and "act" in names and m.act_name in triton_ops.ACTS:
            m.fused = triton_ops.act_and_mul
