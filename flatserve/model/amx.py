"""bf16 linears on Intel AMX tiles with our own kernel (`cpu_gemm="amx"`, the default where it runs).

Why: oneDNN's pre-packed path (flatserve/model/onednn.py) left a third of the copy bandwidth
unused on the LM head and spent about as long in per-call overhead as in reading the small
per-layer weights. `csrc/amx_gemm_cpu.cpp` streams a weight packed once into 64-column panels of
AMX tiles; `benchmarks/dev/cpu_gemv.py` compares the two per shape and row count, and
the git history of docs/benchmarks/cpu.md end to end. Same fp32 accumulation and one bf16 rounding as
oneDNN and F.linear.

Linears whose shapes do not tile (out_features % 64, in_features % 32) stay on oneDNN. Like
oneDNN's, the packed weight replaces the plain one. A tied LM head is not packed: the plain
kernel reads the embedding table it shares, so no second copy is held.
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from flatserve import device as dev
from flatserve.kernel_build import CpuKernel
from flatserve.model import onednn

_SRC = Path(__file__).parents[1] / "ops" / "csrc" / "amx_gemm_cpu.cpp"
_EMPTY = torch.empty(0, dtype=torch.bfloat16)
_ext = CpuKernel("flatserve_amx_gemm", _SRC, "linears use oneDNN", levels=("amx",))


def available(dtype: torch.dtype) -> bool:
    """bf16 weights, oneDNN present (the fallback for shapes that do not tile), this run's ISA
    level amx, the kernel built at it, and the kernel granted tile state by the OS."""
    if not (onednn.available(dtype) and dev.cpu_isa() == "amx"):
        return False
    ext = _ext()
    return ext is not None and ext.available()


def fits(weight: torch.Tensor) -> bool:
    n, k = weight.shape
    return weight.dtype == torch.bfloat16 and n % 64 == 0 and k % 32 == 0


def _pack(w: torch.Tensor) -> torch.Tensor:
    """W [N, K] -> [N/64, K/32, 4, 16, 16, 2]: W[64g + 16j + c, 32s + 2p + e] at [g, s, j, p, c, e],
    k pairs interleaved (VNNI)."""
    n, k = w.shape
    return w.reshape(n // 64, 4, 16, k // 32, 16, 2).permute(0, 3, 1, 4, 2, 5).contiguous()


# Activations the GEMM epilogue applies (the kernel's Act codes).
GATED_ACTS = {"silu": 1, "gelu_pytorch_tanh": 2}


class AMXLinear(nn.Module):
    """y = x @ W.T + b with W held as AMX B tiles, [N/64, K/32, 4, 16, 16, 2]; or, with
    `plain`, W read as it is stored ([N, K], no copy: a tied LM head reads the embedding table).

    The plain kernel (`linear_plain`) computes C^T = W x^T with A tiles taken straight from W's
    rows. On the 262k x 640 LM head it ran 0.88-1.04x of the packed kernel at 1-32 rows and
    0.87-0.90x at 64 (benchmarks/dev/cpu_plain_gemm.py and its scratch forerunner, two runs), and it
    saves the packed copy (335 MB for Gemma 3 270M).
    The per-layer weights stay packed: their plain reads were up to 2.7x slower where rows sit
    2-4 KB apart (K = 1,024 / 2,048: L1 set conflicts), and packing them costs no memory.
    """

    cpu_packed = True  # quant.quantize_model refuses a model holding these (quantize first)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, plain: bool = False) -> None:
        super().__init__()
        assert fits(weight), weight.shape
        self._ext = _ext()
        assert self._ext is not None and self._ext.available(), "AMX kernel not available here"
        self.out_features, self.in_features = n, k = weight.shape
        self.plain = plain
        self.act = 0  # GATED_ACTS code once `make_gated` folds an activation into the epilogue
        if plain:
            self.weight = weight.detach()  # [N, K], shared with its owner
            self.packed = _EMPTY
        else:
            self.packed = _pack(weight.detach())
        self.bias = _EMPTY if bias is None else bias.detach().to(torch.bfloat16).contiguous()

    def make_gated(self, act: str) -> bool:
        """A gate_up projection (gate rows, then up rows) becomes x -> act(gate) * up [.., N/2],
        the activation applied in the GEMM's epilogue with act_and_mul's maths and roundings
        (bit-identical to the two calls; csrc/amx_gemm_cpu.cpp, store_gated). Each 64-row group
        is repacked as gate 16 | up 16 | gate 16 | up 16 rows of the same output columns.
        -> whether it took (packed, no bias, an activation it knows; N % 64 == 0 already makes
        N/2 whole 32-column runs)."""
        i = self.out_features // 2
        if self.plain or self.act or self.bias.numel() or act not in GATED_ACTS:
            return False
        half = torch.arange(i).view(-1, 2, 16)  # [I/32, 2, 16]: two 16-column runs per group
        order = torch.stack([half, half + i], dim=2).reshape(-1)  # gate run, its up run, ...
        self.packed = _pack(self.plain_weight()[order])
        self.act, self.out_features = GATED_ACTS[act], i
        return True

    @property
    def ext(self):  # noqa: ANN201 - the built extension module
        return self._ext

    def plain_weight(self) -> torch.Tensor:
        """W [N, K]: the weight itself (plain) or an unpacked copy (packed)."""
        assert not self.act, "a gated linear's rows are interleaved"
        if self.plain:
            return self.weight
        n, k = self.out_features, self.in_features
        return self.packed.permute(0, 2, 4, 1, 3, 5).reshape(n, k)

    def rows(self, idx: torch.Tensor) -> torch.Tensor:
        """W[idx] [U, K], contiguous."""
        assert not self.act, "a gated linear's rows are interleaved"
        if self.plain:
            return self.weight.index_select(0, idx)
        g, j, c = idx // 64, idx % 64 // 16, idx % 16
        return self.packed[g, :, j, :, c, :].reshape(idx.numel(), self.in_features)  # [U, K/32, 16, 2]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        flat = x.dim() == 2  # the model's [T, K] strips: no reshapes (host time, 72 calls a step)
        x2 = x if flat else x.reshape(-1, self.in_features)
        if self.plain:
            y = self._ext.linear_plain(x2, self.weight, self.bias)  # [M, N]
        else:
            y = self._ext.linear(x2, self.packed, self.bias, self.act)  # [M, N] (gated: N / 2)
        return y if flat else y.reshape(*x.shape[:-1], self.out_features)


def pack_linears(model: nn.Module, copy_tied: bool = False) -> int:
    """Swap every nn.Linear for AMXLinear (oneDNN where the shape does not tile) in place; a
    tied LM head reads the embedding's rows in place unless `copy_tied` packs a copy of it.
    -> bytes added (a tied head's copy, where one is made)."""
    def make(weight: torch.Tensor, bias: torch.Tensor | None, tied: bool) -> nn.Module:
        if not fits(weight):
            return onednn.OneDNNLinear(weight, bias)
        plain = tied and not copy_tied
        if plain:
            # The loader adopts checkpoint tensors as file-backed mmap pages; the head read them
            # ~12% slower than anonymous memory (in-engine LM head 14.9-15.0 -> 13.2-13.3 ms at
            # 16 rows; a scratch A/B before this copy),
            # so the shared table moves to memory of its own, lookup included. The file pages
            # go with the mapping; the copy is transient at load.
            weight.data = torch.empty_like(weight.data, memory_format=torch.contiguous_format)\
                .copy_(weight.data)
        return AMXLinear(weight, bias, plain=plain)

    return onednn.pack_linears(model, make=make)
