"""Weight-only int8 (`--quantization int8`): per-output-channel symmetric int8 weights.

Why: a CPU decode step is weight-read bound and torch's bf16 GEMV runs at ~12 GB/s on the dev
box (a third of its copy bandwidth), while `torch._weight_int8pack_mm` reads half the bytes and
ran 1.7x (262k x 640 LM head, 1 row: 26.7 -> 15.6 ms) to 5x (640 x 1536, 1 row: 0.36 -> 0.07 ms)
faster (`benchmarks/cpu_gemv.py`; the end-to-end figures are in docs/benchmarks/cpu.md). Only the int8
copy is kept (weights take half the RAM of bf16); calls with many rows (prefill chunks)
dequantize 4 MiB slices of rows on the fly and run the dense matmul, so every path computes
with the same int8 weights and batch size never changes which weights a request sees.
Error: |w - w_q| <= max|w_row| / 254 per element.
"""
from __future__ import annotations

import torch
from torch import nn

# At most this many rows use the int8 GEMV kernel: at 16 rows it lost to bf16 in
# benchmarks/cpu_gemv.py (LM head 112 ms int8pack vs 47 ms bf16).
GEMV_ROWS = 4
SLICE_BYTES = 4 << 20


def quantize_rows(w: torch.Tensor, chunk: int = 8192) -> tuple[torch.Tensor, torch.Tensor]:
    """[N, K] float -> (int8 [N, K], scales [N] fp32): w ~= q * scale[:, None].

    In chunks of rows: an fp32 copy of the 262k-row LM head alone would be 671 MB of peak RAM."""
    q = torch.empty(w.shape, dtype=torch.int8, device=w.device)
    scale = torch.empty(w.shape[0], dtype=torch.float32, device=w.device)
    for i in range(0, w.shape[0], chunk):
        wf = w[i:i + chunk].float()
        s = wf.abs().amax(dim=1).clamp(min=1e-12) / 127.0
        q[i:i + chunk] = torch.round(wf / s[:, None]).clamp_(-127, 127).to(torch.int8)
        scale[i:i + chunk] = s
    return q, scale


class Int8Linear(nn.Module):
    def __init__(self, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.register_buffer("qweight", q)  # [N, K] int8
        self.register_buffer("scales", scale.to(dtype))  # [N]
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)

    def dequant(self, rows: slice | torch.Tensor) -> torch.Tensor:
        return self.qweight[rows].to(self.scales.dtype) * self.scales[rows, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M, N]
        if x.shape[0] <= GEMV_ROWS and x.device.type == "cpu":
            y = torch._weight_int8pack_mm(x.contiguous(), self.qweight, self.scales)
        else:
            N, K = self.qweight.shape
            step = max(1, SLICE_BYTES // (K * self.scales.element_size()))
            y = torch.empty(x.shape[0], N, dtype=x.dtype, device=x.device)
            for i in range(0, N, step):
                y[:, i:i + step] = x @ self.dequant(slice(i, i + step)).t()
        return y if self.bias is None else y + self.bias


class Int8Embedding(nn.Module):
    """Row lookup from an Int8Linear's weights (tied embedding and LM head share one copy)."""

    def __init__(self, lin: Int8Linear) -> None:
        super().__init__()
        self.lin = lin

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        return self.lin.dequant(ids)


def quantize_model(model: nn.Module) -> None:
    """Swap every nn.Linear (decoder projections and the LM head) for Int8Linear in place."""
    tied = getattr(model.lm_head, "weight", None) is getattr(model.model.embed_tokens, "weight", 0)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                q, s = quantize_rows(child.weight.data)
                setattr(parent, name, Int8Linear(q, s, child.bias, child.weight.dtype))
    if tied:
        model.model.embed_tokens = Int8Embedding(model.lm_head)
