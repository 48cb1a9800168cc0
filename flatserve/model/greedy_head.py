"""Exact greedy decoding that reads half the LM head's bytes (CPU, AMX or AVX2; `greedy_int8_head`).

Why: at 16 requests the bf16 LM head of Gemma 3 270M (262k x 640, 335 MB) is ~13.7 ms of a
~37 ms decode step, and a step cannot read it faster than DRAM does (~27 GB/s here). For greedy
rows only the argmax matters, so the kernel streams a one-byte-per-weight copy instead (171 MB)
with a bound per row on how far its estimate can be from the bf16 kernel's logit, and keeps the
rows that could be the argmax (~200 of 262k per token for the default model:
benchmarks/dev/cpu_greedy_head.py). The bf16 kernel itself then computes those rows, so the token is
the one `row_argmax(lm_head(x))` gives, ties included: the bounds are rigorous, not statistical.

The copy is 7-bit (q in [-63, 63], stored as u = q + 64 in [1, 127]) and goes to AMX int8 tiles
as it is: u8 x s8 products (TDPBUSD) against x split into integers, x ~= sx (256 xh + xl)
with xh, xl in s8 (ops/csrc, greedy_amx.h). 7 bits, not 8, because the bf16 kernel before
this one turned a byte into the bf16 of 128 + u in one unpack, which the int8 tiles no longer
need; kept, since 8 bits would change the candidates' bound for nothing the kernel gains.
Candidates: ~200 a token; gathering and rescoring a few hundred to ~2,000 rows takes 0.1-0.4 ms
a step.

Bound for W row n and x row t, w ~= s_n q_n (per-row symmetric, s_n = max|w_n| / 63), x^ = 256
xh + xl, E = |x - sx x^|_1 (the kernel's split, computed exactly in float64, rounded up):
    |s_n sx (x^ . q_n) as the kernel computes it - the bf16 kernel's fp32 sum for row n|
        <= |x|_1 c_n + 63 s_n E,
    c_n = max_k |w_nk - s_n q_nk|                    (quantization of w)
        + s_n * 640 * gamma                          (fp32 rounding, below)
and 63 s_n E covers s_n (x - sx x^) . q_n. gamma = 2K * 2^-24 over-covers one K-term fp32 sum
(K 2^-24 to first order). The rounding terms, in units of s_n |x|_1 gamma: the bf16 kernel's own
sum (|w| <= 63 s_n: 63); the integer sums are exact in int32 and the kernel's few fp32 steps on
them (two int -> float conversions, 256 h + l, sx s_n, the product) round 5 times a value of at
most 63 s_n |x|_1 (1 + 0.008 K): under 4 units for any K >= 64. The spare units cover the rest:
fp32 rounding of c itself (|q s - w| <= 63 s 2^-24 off) and of the kernel's approx +- bound
(2^-24 of |approx|, twice). The kernel keeps rows whose upper bound reaches the best lower bound
less a bf16 tie margin (ops/csrc/amx_gemm_cpu.cpp, `greedy_candidates`).

The copy costs memory (N x K bytes + 12 N: 171 MB for Gemma 3 270M), counted as weights; rows
that need logits (sampling, penalties, logprobs) still read the bf16 head.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flatserve import kernels

# One tile of tokens; verify steps with more rows take the bf16 head. On AVX2 too: the bounded
# head took 0.64-0.74x the bf16 head's time at 1-16 rows (benchmarks/dev/cpu_greedy_head.py).
MAX_ROWS = 16
UNION_CAP = 8  # past N / UNION_CAP candidate rows, gathering them costs more than the head
RESCORE_ROWS = 4096  # candidate rows rescored a call (a multiple of 64): a 5 MiB gather for K = 640
LEVELS = 63  # |q| <= 63: u = q + 64 in [1, 127]


def quantize_7bit(w: torch.Tensor, chunk: int = 8192) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """w [N, K] -> (u = q + 64 [N, K] uint8, s [N] fp32, c [N] fp32 (module docstring)), in
    chunks of rows: an fp32 copy of the 262k-row head alone would be 671 MB."""
    n, k = w.shape
    gamma = 2 * k * 2.0**-24
    u = torch.empty(n, k, dtype=torch.uint8)
    s = torch.empty(n, dtype=torch.float32)
    c = torch.empty(n, dtype=torch.float32)
    for i in range(0, n, chunk):
        wf = w[i:i + chunk].float()
        sc = wf.abs().amax(1).clamp(min=1e-30) / LEVELS
        q = torch.round(wf / sc[:, None]).clamp_(-LEVELS, LEVELS)
        u[i:i + chunk] = (q + 64).to(torch.uint8)
        s[i:i + chunk] = sc
        c[i:i + chunk] = (wf - q * sc[:, None]).abs().amax(1) + sc * (640 * gamma)
    # Rounded up once more for the fp32 arithmetic of c itself and of |x|_1 c in the kernel.
    return u, s, c * (1 + 2.0**-16)


def greedy_layout(u: torch.Tensor, chunk: int = 8192) -> torch.Tensor:
    """u [N, K] -> the kernel's order, [N, K64] in memory (K64: K rounded up to 64, the extra
    columns u = 64, i.e. q = 0): [N/32, K64/64] pieces of 32 rows x 64 k, each 32-row group's
    pieces one contiguous stream, each piece two 16-row AMX A tiles (ops/csrc, greedy_amx.h).
    In chunks of rows (multiples of 32), so that no whole-head temporary is made."""
    n, k = u.shape
    k64 = (k + 63) // 64 * 64
    out = torch.full((n, k64), 64, dtype=torch.uint8)
    for i in range(0, n, chunk):
        c = u[i:i + chunk]
        g = c.shape[0] // 32
        padded = F.pad(c, (0, k64 - k), value=64)
        out[i:i + chunk].view(g, k64 // 64, 32, 64).copy_(
            padded.view(g, 32, k64 // 64, 64).transpose(1, 2))
    return out


def q_norms(u: torch.Tensor, chunk: int = 8192) -> torch.Tensor:
    """u [N, K] (q + 64) -> [N] fp32 |q_n|_2, in float64 and rounded up: the AVX2 pass's first
    stage bounds s_n (x - x') . q_n by s_n |x - x'|_2 |q_n|_2 (csrc/greedy_avx2.h, rows)."""
    out = torch.empty(u.shape[0], dtype=torch.float32)
    for i in range(0, u.shape[0], chunk):
        q = u[i:i + chunk].double() - 64
        out[i:i + chunk] = (q.pow(2).sum(1).sqrt() * (1 + 2.0**-20)).float()
    return out


def x_stats(x: torch.Tensor) -> torch.Tensor:
    """[M] fp32: |x_t|_1, rounded up for its own K-term sum."""
    return (x.float().abs().sum(1) * (1 + x.shape[1] * 2.0**-23)).contiguous()


class Int8GreedyHead(nn.Module):
    """tokens = argmax over the vocabulary of `head(x)`: the model's LM head, an AMXLinear or
    AVX2Linear (plain or packed) without bias, whose logits the model uses as they are (no
    softcap); `head.rows(idx)` gives the bf16 rows the candidates are rescored with, through the
    head's own kernel (each logit the same bits whichever rows share the call)."""

    def __init__(self, head: nn.Module) -> None:
        super().__init__()
        self.head = head
        w = head.plain_weight()  # [N, K] bf16 (a view, or a transient unpacked copy)
        u, s, c = quantize_7bit(w)
        n, k = u.shape
        self.register_buffer("qweight", greedy_layout(u))  # uint8: q + 64
        self.register_buffer("scales", s)  # [N] fp32
        self.register_buffer("bounds", c)  # [N] fp32
        # [N] fp32 |q_n|_2 for the AVX2 pass's first stage (the AMX pass has one stage)
        from flatserve.model import avx2

        self.register_buffer("qnorms", q_norms(u) if isinstance(head, avx2.AVX2Linear) else torch.empty(0))
        self.calls = self.fallbacks = 0  # calls, and those the bf16 head answered

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.buffers())

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] bf16 -> [M] int64
        self.calls += 1
        if x.shape[0] > MAX_ROWS or x.shape[0] == 0:
            return self._full(x)
        x = x.contiguous()
        offsets, _, union = self.candidates(x)
        # No candidate (NaN in x), or so many that gathering them costs more than the head
        # (near-uniform logits, e.g. untrained weights): let the full head decide.
        empty = bool((offsets[1:] == offsets[:-1]).any())
        if empty or union.numel() > self.qweight.shape[0] // UNION_CAP:
            return self._full(x)
        pad = (-union.numel()) % 64  # the kernel takes whole 64-row groups
        idx = torch.cat([union, union[-1:].expand(pad)]) if pad else union  # ascending
        # The union holds every row that can reach each token's maximum, so the first maximum
        # over it is the first over the vocabulary; padding only repeats the last row after its
        # own place (clamped back onto it). Rescored RESCORE_ROWS at a time: a row's logit is the
        # same bits in any call, and at 16 rows the union reached 6k-30k rows on random prompts
        # (a 7.5-38 MiB gather of bf16 rows, kept in the heap between steps).
        best_pos = best = None
        for i in range(0, idx.numel(), RESCORE_ROWS):
            exact = self.head.ext.linear_plain(x, self.head.rows(idx[i:i + RESCORE_ROWS]),
                                               self.head.bias)  # no bias: empty
            pos = kernels.row_argmax(exact)  # [M] into this chunk
            val = exact.gather(1, pos[:, None])[:, 0]
            if best is None:
                best_pos, best = pos, val
                continue
            # torch's max rule across chunks: a later chunk wins only if strictly greater, or
            # NaN (which max takes as largest) where the earlier best is not
            win = (val > best) | (val.isnan() & ~best.isnan())
            best_pos = torch.where(win, pos + i, best_pos)
            best = torch.where(win, val, best)
        return union[best_pos.clamp(max=union.numel() - 1)]

    def candidates(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x [M <= 16, K] bf16, contiguous -> (offsets [M + 1], rows, union) int64: each token's
        candidate rows, ascending, and the union of them all (the kernels' greedy_candidates)."""
        extra = (self.qnorms,) if self.qnorms.numel() else ()
        return self.head.ext.greedy_candidates(x, self.qweight, self.scales, self.bounds, x_stats(x), *extra)

    def _full(self, x: torch.Tensor) -> torch.Tensor:
        self.fallbacks += 1
        return kernels.row_argmax(self.head(x))
