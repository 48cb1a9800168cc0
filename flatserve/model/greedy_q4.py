"""Exact greedy decoding on a Q8_0 LM head that reads about half its bytes (CPU, `greedy_int8_head`).

Why: at one request a decode step of the default GGUF spends ~12.5 ms of ~30 reading the tied
Q8_0 head (262k x 640, 178 MB at the ~13 GB/s a 2-core EPYC copies). For greedy rows only the
argmax matters, so the candidate pass (flatserve/csrc/greedy_q4t.h) reads a 4-bit copy instead
(one fp16 scale per 32 weights, 94 MB) and keeps the rows that could hold the argmax; those rows
are then rescored on the Q8_0 head by QuantLinear._int16's own kernel calls (quantize_act, gemm),
so the token is the one `row_argmax(head(x))` gives, ties to the first index included.

The bound (rigorous, not statistical). The head computes, for x's int16 codes xr = xd * xq (per
32 values), Y_n = sum_k W_nk xr_k in fp32; the copy holds W4_nk = d_nb c_nk with |W_nk - W4_nk|
<= d_nb / 2 (d_nb = max_b |W| / 7 rounded up to fp16, c = round(W / d) in [-7, 7]: checked in
float64, where W = D q is exact). So
    |Y_n - A_n| <= sum_b (d_nb / 2) |xr_b|_1 + slack,
A_n being the pass's fp32 value of sum_k W4_nk xr_k. slack covers both fp32 dots: each term
rounds at most nb + 5 times (nb = K / 32 accumulations per lane, the scale product, the
horizontal sum), so (nb + 16) 2^-23 (twice that) times sum_k (|W_nk| + |W4_nk|) |xr_k| <=
2.02 wmax |xr|_1 (wmax: the largest |W| or |W4| of the head, |W4| <= 7 d <= max |W| (1 + 2^-10)).
The bound's own fp32 sums are rounded up in the kernel.

The candidates are the rows whose upper bound reaches an exact logit v (less a bf16 tie margin);
the pass scores exactly each row whose estimate is the best so far, so v is close to the maximum
and the set small: on the default model ~3k rows a token (max 4.9k) of 262k, where the best
lower bound max(A - B) as threshold keeps ~119k (csrc/greedy_q4.h).

Memory: N x (K / 2 + K / 16) bytes (94 MB for Gemma 3 270M), counted as weights; opt out with
`--no-greedy-int8-head`. Rows that need logits (sampling, penalties, logprobs) read the head.

Whether the copy pays depends on the CPU: where the head's bytes come fast against its arithmetic
it may not. A row-major copy (a row's blocks in a register, a horizontal sum a row; this
project's layout until 2026-11-28) ran at 1.23x the full head's speed at one row on a 2-core
AVX2 EPYC and at 0.68x on a 2-core Zen 5 forced to avx2; the copy now has 16 head rows in the
vector lanes (csrc/greedy_q4t.h, the avx512 level's layout, in two ymm here): served, 1.2-1.3x
the head's speed at one row on that Zen 5 (docs/performance-cpu.md, AVX2 section). The served
one (greedy_q8.py's `one_row` at the AVX2 levels, built with `trial`) still times both on its
first one-row calls, alternated (TRIAL of each, the first of each dropped: cold caches), and
keeps the pass only where its best time is under KEEP x the head's; else it frees the copy. The
tokens are the same either way.
"""
from __future__ import annotations

import logging
import time

import torch
from torch import nn

from flatserve import device as dev
from flatserve import kernels
from flatserve.model import quant
from flatserve.model.qformats import FORMATS

# Rows per call the pass takes; more go to the full head (greedy_q8.py's int8 pass from a few
# rows). The pass grows with the rows, while the head streams its bytes once for all rows: the
# default model's head, the pass with its rescoring against head + argmax, at 1 and 2 rows 2.36 /
# 4.63 against 3.59 / 4.16 ms at avxvnni, at 1-4 rows 2.73 / 6.25 / 8.37 / 10.34 against 3.58 /
# 4.49 / 5.97 / 7.25 at avx2 (`FLATSERVE_CPU_ISA=... benchmarks/dev/cpu_greedy_head.py --gguf
# --rows 1,2,3,4,5,8,16 --reps 10`, its kernel column, 2-core Zen 5, 2026-11-28). So one row: a
# one-stream decode step.
MAX_ROWS = 1
KERNEL_ROWS = 8  # the pass's own limit (greedy_q4t.h kMaxRows)
TRIAL = 8  # one-row calls timed on each path before the choice
KEEP = 0.95  # the pass stays where its best one-row time is under this fraction of the head's
Q8_0 = FORMATS["q8_0"]
log = logging.getLogger("flatserve")


def quantize_q4(q8: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """Q8_0 rows [N, K / 32 * 34] -> (codes [G, nb x 256] uint8, scales [G, nb x 16] int16 (fp16
    bits), wmax), G = ceil(N / 16): the copy with 16 head rows in the vector lanes (layout:
    csrc/greedy_q4t.h). In C++: the same in float64 torch took 23 s for the default model's head,
    a start-up cost."""
    ext = quant.kernel()
    assert ext is not None, "the quantized-linear kernel did not build"
    codes, scales, wmax = ext.greedy_q4t_copy(q8.contiguous(), k)
    return codes, scales, wmax * (1 + 2.0**-20)


def eligible(head: nn.Module) -> bool:
    """A QuantLinear LM head of one Q8_0 segment, no bias, no act-order permutation, whose
    kernel is an AVX2 build (avx2, avxvnni). The portable build keeps the full head (its scalar pass would be
    slower than the head it saves), and so do the avx512 and amx builds: their full head at one
    row (rows16, csrc/quant_rows.h) took 11.3-13.7 ms against the pass's 11.6-14.1 on the default
    model (`benchmarks/dev/cpu_greedy_head.py --gguf --rows 1`, 2-core Xeon with AMX, 2026-11-27),
    so the copy's 93 MiB bought nothing there. The avx512 build lays the same codes out with rows
    in the lanes instead (greedy_q8.py, csrc/greedy_q4t.h): no horizontal sums, 1.7x the head there."""
    if not isinstance(head, quant.QuantLinear) or head.bias is not None or head.perm.numel():
        return False
    ext = quant.kernel()
    return head.fmts == [Q8_0] and ext is not None and ext.isa() in dev.AVX2_LEVELS


class BoundedHead(nn.Module):
    """What the bounded greedy heads of a Q8_0 QuantLinear head share (this one's 4-bit copy,
    greedy_q8's int8 pass): tokens = argmax over the vocabulary of `head(x)`, for a head whose
    logits the model uses as they are (no softcap, no scaling); the full head where the pass
    does not run."""

    def __init__(self, head: quant.QuantLinear) -> None:
        super().__init__()
        assert head.fmts == [Q8_0] and head.bias is None and not head.perm.numel()
        self.head = head
        self.calls = self.fallbacks = 0  # calls, and those the full head answered
        self.last_counts = torch.empty(0, dtype=torch.int64)  # candidate rows per token, last call

    def _full(self, x: torch.Tensor) -> torch.Tensor:
        self.fallbacks += 1
        return kernels.row_argmax(self.head(x))


class Q4GreedyHead(BoundedHead):
    """The 4-bit copy's pass (AVX2 build). With `trial`, the first one-row calls alternate
    between the pass and the full head, timed, until TRIAL of each; then the copy stays or is
    freed (module docstring)."""

    def __init__(self, head: quant.QuantLinear, trial: bool = False) -> None:
        super().__init__(head)
        codes, scales, self.wmax = quantize_q4(head.qweight0, head.in_features)
        self.register_buffer("copy", codes)             # [N / 16, K / 32 x 256] uint8 (greedy_q4t.h)
        self.register_buffer("copy_scales", scales)     # [N / 16, K / 32 x 16] fp16 bits
        self.times: dict[str, list[float]] | None = {"pass": [], "head": []} if trial else None
        self.clock = time.perf_counter  # the trial's timer (tests put in their own)

    @property
    def nbytes(self) -> int:
        return 0 if self.copy is None else self.copy.numel() + self.copy_scales.numel() * 2

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M] int64
        self.calls += 1
        ext = quant.kernel()
        if self.copy is None or ext is None or not 0 < x.shape[0] <= min(MAX_ROWS, KERNEL_ROWS) \
                or not bool(torch.isfinite(x).all()):
            return self._full(x)  # NaN / inf: the bound means nothing there
        if self.times is None:
            return self._pass(ext, x)
        kind = "pass" if len(self.times["pass"]) <= len(self.times["head"]) else "head"
        t = self.clock()
        tokens = self._pass(ext, x) if kind == "pass" else kernels.row_argmax(self.head(x))
        self.times[kind].append(self.clock() - t)
        if len(self.times["head"]) == TRIAL:
            self._choose()
        return tokens

    def _pass(self, ext: object, x: torch.Tensor) -> torch.Tensor:
        # The pass and the candidates' rescoring on the head's own dot, in one call: a parallel
        # region per kernel call costs a scheduler slice whenever the box is shared.
        tokens, self.last_counts = ext.greedy_q4t_argmax(x.contiguous(), self.head.qweight0, self.copy,
                                                         self.copy_scales, self.wmax)
        return tokens

    def _choose(self) -> None:
        best = {k: min(v[1:]) for k, v in self.times.items()}
        self.times = None
        keep = best["pass"] < KEEP * best["head"]
        mib = self.nbytes / 2**20
        if not keep:
            self.copy = self.copy_scales = None
        log.info("greedy LM head at one row: the 4-bit copy's pass %.2f ms, the head %.2f ms (best "
                 "of %d each): %s", best["pass"] * 1e3, best["head"] * 1e3, TRIAL - 1,
                 "keeping the pass" if keep else f"reading the head, the copy's {mib:.0f} MiB freed")


def plain_logits(mcfg: object) -> bool:
    """Whether the model uses the head's logits as they are: no softcap, no logits scaling (either
    rounds in the model's dtype after the head, which can merge logits into ties the head did
    not have), so the head's argmax is the model's."""
    softcap = getattr(mcfg, "final_logit_softcap", None)
    return softcap is None and getattr(mcfg, "logits_scaling", 1.0) == 1.0
