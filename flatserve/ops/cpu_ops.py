"""Fused element-wise C++ ops for the CPU path, same signatures as `triton_ops`; the torch layers
are their reference. `csrc/fused_cpu.cpp`, built at every ISA level (flatserve/kernels.py); where
the build fails, `available()` is False and `--fused-ops auto` enables nothing on the CPU (logged)."""
from __future__ import annotations

from pathlib import Path

import torch

from flatserve.kernel_build import CpuKernel

_SRC = Path(__file__).parent / "csrc" / "fused_cpu.cpp"
ACTS = ("silu", "gelu_pytorch_tanh")
module = CpuKernel("flatserve_fused_cpu", _SRC, "the torch layers run instead")


def available() -> bool:
    return module() is not None


_EMPTY = torch.empty(0)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, offset: bool,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [N, H] -> [N, H]. With `residual`: residual += x in place first, then its norm."""
    return module().rms_norm(x, w, eps, offset, _EMPTY if residual is None else residual)


def rms_norm_pair(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, eps: float, offset: bool,
                  residual: torch.Tensor) -> torch.Tensor:
    """x [N, H] -> norm(residual += norm(x, w1), w2), residual in place: the two rms_norm calls'
    bits in one pass (the first result stays in a row buffer)."""
    return module().rms_norm_pair(x, w1, w2, eps, offset, residual)


def act_and_mul(x: torch.Tensor, act: str) -> torch.Tensor:
    """x [T, 2I] = gate | up -> act(gate) * up [T, I]."""
    assert act in ACTS
    return module().act_and_mul(x, act == "gelu_pytorch_tanh")


def fuse_gate_up(mlp: torch.nn.Module) -> bool:
    """Folds act(gate) * up into an AMX or AVX2 gate_up GEMM's epilogue (model/amx.py,
    model/avx2.py: make_gated): -> whether it took (other linears keep act_and_mul)."""
    from flatserve.model.amx import AMXLinear
    from flatserve.model.avx2 import AVX2Linear

    lin = mlp.gate_up_proj
    return isinstance(lin, (AMXLinear, AVX2Linear)) and lin.make_gated(mlp.act_name)


def rope_fits(head_dim: int, rotary_dim: int) -> tuple[bool, str]:
    """The C++ op rotates whole heads of an even size (its table is [2, P, D])."""
    if rotary_dim != head_dim:
        return False, "the C++ op rotates whole heads only"
    return head_dim % 2 == 0, "odd head size"


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                 q_w: torch.Tensor | None, k_w: torch.Tensor | None, eps: float,
                 offset: bool) -> None:
    """In place on q [T, Hq, D] and k [T, Hkv, D]: optional per-head RMSNorm, neox rotary."""
    norm = q_w is not None
    module().qk_norm_rope(q, k, positions.contiguous(), cos_sin, q_w if norm else _EMPTY,
                          k_w if norm else _EMPTY, eps, norm, offset)


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [R, V] -> int64 [R], the rule of x.max(dim=-1).indices (first index among equals, NaN
    highest), in 16-lane vector code (two __m256 on AVX2): 16 x 262k bf16 logits in 0.47 ms
    against torch's 5.0 on a 2-core AMD EPYC (`benchmarks/dev/cpu_argmax.py`, 2026-11-26)."""
    return module().argmax_rows(x.contiguous())
