"""Fused ops, chosen by name: the torch layers run by default; `enable` swaps in kernels.

Names: "rmsnorm" (RMSNorm with the residual add folded in), "rope" (per-head q/k RMSNorm +
rotary, in place), "act" (SiLU / GELU-tanh and the gate*up product). They follow the attention
backend: Triton kernels with "triton" (CUDA; `triton_ops`), C++ ones with "cpu" and "cpu-sdpa"
(`cpu_ops`, where they compile), none with "torch" (the reference path). "auto" = all three where there is
an implementation. Measured in docs/performance-gpu.md and docs/performance-cpu.md.
"""
from __future__ import annotations

import logging

from torch import nn

log = logging.getLogger("flatserve")

FUSED_OPS = ("rmsnorm", "rope", "act")


CPU_BACKENDS = ("cpu", "cpu-sdpa")  # the C++ attention backends, which the C++ fused ops follow


def parse_fused_ops(spec: str, backend: str) -> frozenset[str]:
    """'auto' | 'none' | comma list of FUSED_OPS -> the set to enable (ValueError on a typo)."""
    if spec == "auto":
        return frozenset(FUSED_OPS) if _available(backend) else frozenset()
    if spec in ("none", ""):
        return frozenset()
    names = frozenset(s.strip() for s in spec.split(","))
    bad = sorted(names - set(FUSED_OPS))
    if bad:
        raise ValueError(f"unknown fused op(s) {', '.join(bad)}; choose from {', '.join(FUSED_OPS)}, "
                         f"auto or none")
    if not _available(backend):
        raise ValueError(f"fused ops {', '.join(sorted(names))} need the triton (CUDA) or a C++ "
                         f"(cpu, cpu-sdpa) attention backend with its kernels built, not {backend!r}")
    return names


def _available(backend: str) -> bool:
    if backend == "triton":
        return True
    if backend in CPU_BACKENDS:
        from flatserve.ops import cpu_ops

        return cpu_ops.available()
    return False


def enable(model: nn.Module, names: frozenset[str], backend: str) -> None:
    """Point each layer at its fused kernel for `backend` (None keeps the torch reference)."""
    if not names:
        return
    from flatserve.model.layers import Attention, GatedMLP, RMSNorm

    if backend == "triton":
        from flatserve.ops import triton_ops as impl
    else:
        from flatserve.ops import cpu_ops as impl
    for m in model.modules():
        if isinstance(m, RMSNorm) and "rmsnorm" in names:
            m.fused = impl.rms_norm
            m.fused_pair = getattr(impl, "rms_norm_pair", None)  # the C++ ops have it
        elif isinstance(m, Attention) and "rope" in names:
            m.fused = _rope_op(m, impl)
            m.rope_stores_kv = m.fused is not None and getattr(impl, "ROPE_STORES_KV", False)
            if m.backend is not None:  # already bound: settle stores_kv again for the new kernel
                m.bind(m.backend, m.kv_cache)
        elif isinstance(m, GatedMLP) and "act" in names and m.act_name in impl.ACTS:
            m.gated = impl.fuse_gate_up(m)  # the activation in the gate_up GEMM where it can be
            m.fused = None if m.gated else impl.act_and_mul


def _rope_op(attn: nn.Module, impl: object) -> object:
    """The fused q/k norm + rotary for this layer, or None (the torch layers) where the kernel
    cannot take it: a NoPE layer has nothing to fuse; partial rotary where the op rotates the
    whole head only (the C++ op); a head size the op does not take."""
    if attn.rotary is None:
        return None
    ok, why = impl.rope_fits(attn.d, attn.rotary.dim)
    if not ok:
        log.info("fused rope off for head size %d, rotary dims %d: %s; the torch layer runs",
                 attn.d, attn.rotary.dim, why)
        return None
    return impl.qk_norm_rope
