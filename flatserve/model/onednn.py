"""bf16 linears on the CPU through oneDNN's pre-packed weight layout (`cpu_gemm="onednn"`).

Why: a CPU decode step is weight-read bound, and `F.linear` in bf16 reads the weights at under
half of this box's copy bandwidth. The same GEMM on a weight reordered once into oneDNN's blocked
layout (`torch.ops.mkldnn._reorder_linear_weight`, the op inductor's CPU freezing uses) ran
1.1-2.5x faster at 1 and 16 rows (`benchmarks/dev/cpu_gemv.py`, dev box with AMX: Gemma 3's 262k x
640 LM head 28.6 -> 17.1 ms at 1 row, 29.6 -> 18.8 ms at 16; 640 x 2048 0.30 -> 0.12 ms at 1
row) and about even at 512 rows (0.78-1.0x: prefill chunks are compute-bound either way). Same
error against a float64 reference as `F.linear` (both accumulate in fp32). In fp32 it was slower
at 1-3 rows, so only bf16 weights are packed. End to end: the git history of docs/benchmarks/cpu.md.

Memory: the packed weight replaces the plain one, except where the LM head is tied to the
embedding: the embedding keeps its plain rows for the lookup, so that one matrix is held twice
(Gemma 3 270M: +335 MB; the AMX path instead reads those rows in place). `pack_linears` returns
the bytes it added so the budget counts them.
"""
from __future__ import annotations

from typing import Callable

import torch
from torch import nn


def available(dtype: torch.dtype) -> bool:
    """oneDNN packing is used for bf16 weights where torch was built with it and the CPU runs
    bf16 natively (elsewhere oneDNN emulates bf16 and the plain path is as good)."""
    from flatserve import device as dev

    return (dtype == torch.bfloat16 and torch.backends.mkldnn.is_available()
            and hasattr(torch.ops.mkldnn, "_linear_pointwise") and dev.cpu_has_fast_bf16())


class OneDNNLinear(nn.Module):
    """y = x @ W.T + b with W held in oneDNN's blocked layout (opaque: no row access)."""

    cpu_packed = True  # quant.quantize_model refuses a model holding these (quantize first)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # The batch-size hint (1) only picks the initial layout; any row count runs on it.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)
        self.bias = None if bias is None else bias.detach()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        lead = x.shape[:-1]
        x2 = x.reshape(-1, self.in_features)
        if x2.shape[0] == 0:
            return x.new_empty(*lead, self.out_features)
        y = torch.ops.mkldnn._linear_pointwise(x2.contiguous(), self.packed, self.bias,
                                               "none", [], "")
        return y.reshape(*lead, self.out_features)


def pack_linears(model: nn.Module,
                 make: Callable[..., nn.Module] = lambda w, b, tied: OneDNNLinear(w, b)) -> int:
    """Swap every nn.Linear for `make(weight, bias, tied)` (OneDNNLinear unless given) in place;
    `tied`: the weight is the embedding table's. -> bytes added: a tied LM head's copy, where
    the module made for it holds its own (anything but the very tensor it was given)."""
    emb = getattr(getattr(model, "model", None), "embed_tokens", None)
    tied_weight = getattr(emb, "weight", None)
    added = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                tied = child.weight is tied_weight
                new = make(child.weight, child.bias, tied)
                held = getattr(new, "weight", None)
                if tied and not (isinstance(held, torch.Tensor)
                                 and held.data_ptr() == tied_weight.data_ptr()):
                    added += child.weight.numel() * child.weight.element_size()
                setattr(parent, name, new)
    return added
