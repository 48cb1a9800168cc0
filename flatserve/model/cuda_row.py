"""One-row CUDA decode with each RMSNorm folded into the 4-bit GEMV that reads it.

Why: a one-row decode step of Llama-3-8B at q4_0 ran 65 RMSNorm launches of ~3 us each, 0.20 ms
of a 2.86 ms forward on an H100 (2026-11-27, docs/performance-gpu.md), for 8 KB of work apiece.
The q4_0 GEMV after the input and post-attention norms (q|k|v and gate|up) normalizes the row
itself: each of its CTAs forms the running residual h = delta + residual and
w * h / rms(h) in shared memory before its loop (ops/csrc/q4_gemv_cuda.cu, q4_gemv_norm_*), and CTA
0 stores h as the next residual. Only the model's last norm still runs on its own.

`FoldedNorms` is `DecoderLayers.fast` on CUDA (the runner installs what `build` returns): a step
of one token runs each layer as LlamaDecoderLayer.forward does, with the two norms folded; any
other step returns None and the Python layers run. The bits differ from the unfolded path only
where the norm's sum of squares, added in another order, rounds differently.
"""
from __future__ import annotations

import os

import torch
from torch import nn

from flatserve.model import cuda_gemv, quant_planar
from flatserve.model.layers import GatedMLP, RMSNorm
from flatserve.model.llama import LlamaDecoderLayer
from flatserve.model.quant import QuantLinear

ENABLED = os.environ.get("FLATSERVE_FOLD_NORMS", "1") != "0"  # "0": the Python layers (the A/B)


def _foldable(norm: RMSNorm, lin: nn.Module) -> bool:
    """A Llama norm on its Triton kernel, then a linear whose segments are all planar q4_0."""
    return (norm.fused is not None and not norm.offset and isinstance(lin, QuantLinear)
            and lin.use_kernel and not lin.perm.numel() and lin.in_features <= cuda_gemv.MAX_NORM_K
            and len(lin.planar) == len(lin.fmts) and all(f.name == "q4_0" for f in lin.fmts))


def build(layers: nn.ModuleList) -> FoldedNorms | None:
    """The fold for these decoder layers, or None where a layer is not Llama-shaped with q4_0
    q|k|v and gate|up and the Triton norm and activation kernels (any other model, format or
    backend keeps the Python layers)."""
    if not ENABLED or not len(layers):
        return None
    for layer in layers:
        if type(layer) is not LlamaDecoderLayer or layer.residual_multiplier != 1.0:
            return None
        mlp = layer.mlp
        if not isinstance(mlp, GatedMLP) or mlp.fused is None or mlp.gated:
            return None
        if not (_foldable(layer.input_layernorm, layer.self_attn.qkv_proj)
                and _foldable(layer.post_attention_layernorm, mlp.gate_up_proj)):
            return None
    return FoldedNorms(layers)


def _normed(norm: RMSNorm, lin: QuantLinear, d: torch.Tensor, residual: torch.Tensor | None
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """(lin(norm(d + residual)), d + residual) for one row, the norm inside lin's GEMVs
    (residual None: lin(norm(d)), d); the unfolded ops where the kernel does not take it."""
    r_new = d if residual is None else torch.empty_like(d)
    y = torch.empty(1, lin.out_features, dtype=d.dtype, device=d.device)
    col = 0
    for i, (fmt, q) in enumerate(lin.segments()):
        codes, scales, nblk = quant_planar._views(q, fmt)
        n = q.shape[0]
        store = r_new if i == 0 and residual is not None else None
        if not cuda_gemv.gemv_norm(d, residual, norm.weight, norm.eps, store, codes, scales,
                                   y[:, col:col + n], n, nblk):
            assert i == 0, "a later segment of the same linear took another path"
            x, r_new = (norm(d), d) if residual is None else norm(d, residual)
            return lin(x), r_new
        col += n
    return (y if lin.bias is None else y + lin.bias), r_new


class FoldedNorms:
    """Callable as `DecoderLayers.fast`: (h, residual, positions) -> (h, residual) for a one-token
    bf16 step, else None."""

    def __init__(self, layers: nn.ModuleList) -> None:
        self.layers = list(layers)

    def __call__(self, h: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor] | None:
        if h.shape[0] != 1 or h.dtype != torch.bfloat16 or h.device.type != "cuda":
            return None
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv, residual = _normed(layer.input_layernorm, attn.qkv_proj, h, residual)
            a = attn.attend(qkv, positions)  # [1, H]
            gu, residual = _normed(layer.post_attention_layernorm, mlp.gate_up_proj, a, residual)
            h = mlp.down_proj(mlp.fused(gu, mlp.act_name))
        return h, residual
