"""bf16-weight linears on CPUs without native bf16 arithmetic (`cpu_gemm="avx2"`): AVX2 + FMA,
e.g. AMD Zen 2/3 and Intel before Sapphire Rapids.

Why: there torch's bf16 matmul is emulated and slower than fp32, so without this path the engine
kept fp32 weights: twice the bytes per decode step (a weight read) and twice the memory.
`ops/csrc/avx2_gemm_cpu.cpp` keeps the weights bf16, packed once at load into 16-column panels,
and widens them to fp32 in registers (a 16-bit shift) for fp32 FMAs: the same sums as F.linear
in fp32 on the same (bf16) weights, one rounding to x's dtype at the end.

Every linear whose out_features is a multiple of 16 is packed (Gemma 3, Qwen3, Llama: all);
others stay torch's. A tied LM head is not packed: the plain kernel reads the embedding table
in place, so no second copy is held (335 MB for Gemma 3 270M).
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from flatserve import device as dev
from flatserve.kernel_build import CpuKernel

_SRC = Path(__file__).parents[1] / "ops" / "csrc" / "avx2_gemm_cpu.cpp"
_EMPTY = torch.empty(0, dtype=torch.bfloat16)
_ext = CpuKernel("flatserve_avx2_gemm", _SRC, "linears use torch")


def available(dtype: torch.dtype) -> bool:
    """bf16 weights, a CPU with AVX2 + FMA, the kernel built with them."""
    if dtype != torch.bfloat16 or not dev.cpu_has_avx2_fma():
        return False
    ext = _ext()
    return ext is not None and ext.vectorized()


def fits(weight: torch.Tensor) -> bool:
    return weight.dtype == torch.bfloat16 and weight.dim() == 2 and weight.shape[0] % 16 == 0


def pack(w: torch.Tensor) -> torch.Tensor:
    """W [N, K] -> [N/16, K, 16]: W[16g + j + 8h, k] at [g, k, 2j + h] (j < 8, h < 2), so that
    32-bit lane j of a k step holds columns j and j + 8 (the kernel's shift and mask)."""
    n, k = w.shape
    return w.reshape(n // 16, 2, 8, k).permute(0, 3, 2, 1).reshape(n // 16, k, 16).contiguous()


def unpack(p: torch.Tensor) -> torch.Tensor:
    """pack's inverse: [N/16, K, 16] -> W [N, K]."""
    g, k, _ = p.shape
    return p.reshape(g, k, 8, 2).permute(0, 3, 2, 1).reshape(g * 16, k)


class AVX2Linear(nn.Module):
    """y = x @ W.T + b with W held packed, [N/16, K, 16] bf16; or, with `plain`, W read as stored
    ([N, K], no copy: a tied LM head reads the embedding table)."""

    cpu_packed = True  # quant.quantize_model refuses a model holding these (quantize first)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, plain: bool = False) -> None:
        super().__init__()
        assert fits(weight), (weight.shape, weight.dtype)
        self._ext = _ext()
        assert self._ext is not None, "AVX2 GEMM kernel not built here"
        self.out_features, self.in_features = weight.shape
        self.plain = plain
        self.act = 0  # GATED_ACTS code once `make_gated` folds an activation into the epilogue
        if plain:
            self.weight = weight.detach()  # [N, K], shared with its owner
            self.packed = _EMPTY
        else:
            self.packed = pack(weight.detach())
        self.bias = _EMPTY if bias is None else bias.detach().float().contiguous()

    def make_gated(self, act: str) -> bool:
        """A gate_up projection (gate rows, then up rows) becomes x -> act(gate) * up [.., N/2],
        the activation in the epilogue with act_and_mul's maths and roundings. Panels are
        repacked gate 16 | up 16 columns of the same outputs. -> whether it took (packed, no
        bias, an activation it knows, N/2 a multiple of 16)."""
        from flatserve.model.amx import GATED_ACTS

        i = self.out_features // 2
        if self.plain or self.act or self.bias.numel() or act not in GATED_ACTS or i % 16:
            return False
        w = self.plain_weight()
        order = torch.stack([torch.arange(i).view(-1, 16), torch.arange(i, 2 * i).view(-1, 16)], 1)
        self.packed = pack(w[order.reshape(-1)])
        self.act, self.out_features = GATED_ACTS[act], i
        return True

    @property
    def ext(self):  # noqa: ANN201 - the built extension module
        return self._ext

    def plain_weight(self) -> torch.Tensor:
        """W [N, K]: the weight itself (plain) or an unpacked copy (packed)."""
        assert not self.act, "a gated linear's panels are interleaved"
        return self.weight if self.plain else unpack(self.packed)

    def rows(self, idx: torch.Tensor) -> torch.Tensor:
        """W[idx] [U, K], contiguous (packed: gathered from the panels, not a whole unpack)."""
        if self.plain:
            return self.weight.index_select(0, idx)
        assert not self.act, "a gated linear's panels are interleaved"
        r = idx % 16  # row r of a panel sits in lane (r % 8) * 2 + r // 8 (pack, unpack)
        return self.packed[idx // 16, :, (r % 8) * 2 + r // 8].contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        flat = x.dim() == 2
        x2 = x if flat else x.reshape(-1, self.in_features)
        if self.plain:
            y = self._ext.linear_plain(x2, self.weight, self.bias)
        else:
            y = self._ext.linear(x2, self.packed, self.bias, self.act)  # gated: [M, N / 2]
        return y if flat else y.reshape(*x.shape[:-1], self.out_features)


def pack_linears(model: nn.Module) -> int:
    """Swap every bf16 nn.Linear that fits for AVX2Linear in place (a tied LM head reads the
    embedding's rows in place). -> bytes added: none."""
    from flatserve.model import onednn

    def make(weight: torch.Tensor, bias: torch.Tensor | None, tied: bool) -> nn.Module:
        if not fits(weight):
            lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
            lin.weight = nn.Parameter(weight, False)
            lin.bias = None if bias is None else nn.Parameter(bias, False)
            return lin
        if tied:
            # File-backed mmap pages of the checkpoint read slower than anonymous memory
            # (amx.pack_linears: ~12% on the AMX box's LM head): the table moves once.
            weight.data = torch.empty_like(weight.data, memory_format=torch.contiguous_format)\
                .copy_(weight.data)
        return AVX2Linear(weight, bias, plain=tied)

    return onednn.pack_linears(model, make=make)
