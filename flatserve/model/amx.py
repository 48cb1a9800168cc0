"""bf16 linears on Intel AMX tiles with our own kernel (`cpu_gemm="amx"`, the default where it runs).

Why: oneDNN's pre-packed path (flatserve/model/onednn.py) left a third of the copy bandwidth
unused on the LM head and spent about as long in per-call overhead as in reading the small
per-layer weights. `csrc/amx_gemm_cpu.cpp` streams a weight packed once into 64-column panels of
AMX tiles; `benchmarks/cpu_gemv.py` compares the two per shape and row count, and
docs/benchmarks/cpu.md (session 8) end to end. Same fp32 accumulation and one bf16 rounding as
oneDNN and F.linear.

Linears whose shapes do not tile (out_features % 64, in_features % 32) stay on oneDNN. Like
oneDNN's, the packed weight replaces the plain one, except a tied LM head (counted by
`pack_linears`).
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from flatserve import device as dev
from flatserve.model import onednn

_SRC = Path(__file__).parents[1] / "ops" / "csrc" / "amx_gemm_cpu.cpp"
_EMPTY = torch.empty(0, dtype=torch.bfloat16)
_ext = dev.CpuExtension("flatserve_amx_gemm", str(_SRC), "linears use oneDNN")


def available(dtype: torch.dtype) -> bool:
    """bf16 weights, oneDNN present (the fallback for shapes that do not tile), a CPU with AMX
    bf16, the kernel built with it, and the kernel granted tile state by the OS."""
    if not (onednn.available(dtype) and dev.cpu_has_amx_bf16()):
        return False
    ext = _ext()
    return ext is not None and ext.available()


def fits(weight: torch.Tensor) -> bool:
    n, k = weight.shape
    return weight.dtype == torch.bfloat16 and n % 64 == 0 and k % 32 == 0


class AMXLinear(nn.Module):
    """y = x @ W.T + b with W held as AMX B tiles, [N/64, K/32, 4, 16, 16, 2]."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        assert fits(weight), weight.shape
        self._ext = _ext()
        assert self._ext is not None and self._ext.available(), "AMX kernel not available here"
        self.out_features, self.in_features = n, k = weight.shape
        # W[64g + 16j + c, 32s + 2p + e] -> packed[g, s, j, p, c, e]: k pairs interleaved (VNNI).
        self.packed = (weight.detach().reshape(n // 64, 4, 16, k // 32, 16, 2)
                       .permute(0, 3, 1, 4, 2, 5).contiguous())
        self.bias = _EMPTY if bias is None else bias.detach().to(torch.bfloat16).contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        lead = x.shape[:-1]
        y = self._ext.linear(x.reshape(-1, self.in_features), self.packed, self.bias)  # [M, N]
        return y.reshape(*lead, self.out_features)


def _make(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module:
    return AMXLinear(weight, bias) if fits(weight) else onednn.OneDNNLinear(weight, bias)


def pack_linears(model: nn.Module) -> int:
    """Swap every nn.Linear for AMXLinear (oneDNN where the shape does not tile) in place;
    -> bytes added (a tied LM head's copy)."""
    return onednn.pack_linears(model, make=_make)
