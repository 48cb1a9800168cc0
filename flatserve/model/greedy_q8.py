"""Exact greedy decoding on a Q8_0 LM head with int8 activations (CPU, AVX-512 VNNI; `greedy_int8_head`).

Why: at 16 requests a decode step of the default GGUF on a 2-core Zen 4 spends ~20 ms of ~53 in
the tied Q8_0 head (262k x 640; `benchmarks/dev/cpu_profile_step.py 16 --by-kernel --eager`),
bound by arithmetic, not bytes: the head dots int16 activation codes, 32 products a `vpdpwssd`.
For greedy rows only the argmax matters, so a candidate pass (flatserve/csrc/greedy_q8.h) dots
the head's own int8 codes with x requantized to int8, 64 products a `vpdpbusd`, with a rigorous
bound per row on how far that estimate is from the head's logit; the rows that could hold the
argmax are rescored with the head's own dot, so the token is the one `row_argmax(head(x))`
gives, ties to the first index included. int8 activations are what the fidelity bar declined
for logits (95.9% teacher-forced top-1 against 99%, docs/models.md); here they only choose which
rows to rescore.

Calls of 1 to FEW_ROWS rows take a second pass instead (flatserve/csrc/greedy_q4t.h): greedy_q4.py's
4-bit copy of the head (one fp16 scale per 32 weights, |w - w4| <= d / 2) laid out with 16 head
rows in the vector lanes, dotted with x's own int16 codes (no requantization: the bound is the
copy's error alone), so it reads 94 MB instead of 178 and needs no horizontal sums; ~3k rows a
token are rescored on the head.

The avx2 build (no VNNI) runs the same pass with `vpmaddubsw` (x as 7-bit codes: csrc/greedy_q8.h
says why), the avxvnni build with 256-bit `vpdpbusd` (8-bit codes), each from its
AVX2_MIN_ROWS rows; one row takes greedy_q4.py's head (the same rows-in-lanes copy, in two ymm,
with its trial against the head) and the rows between the head.

Memory: per row its L1 norm (4 bytes) and per block the sum of its codes (2 bytes), N x (4 + K /
16) bytes, 11.5 MB for Gemma 3 270M; the copy, N x K x 9 / 16 bytes, 94.4 MB; both counted as
weights. Rows that need logits (sampling, penalties, logprobs) and calls of more than MAX_ROWS
rows read the head.
"""
from __future__ import annotations

import torch
from torch import nn

from flatserve import device as dev
from flatserve.model import greedy_q4, quant
from flatserve.model.greedy_q4 import BoundedHead, plain_logits
from flatserve.model.qformats import FORMATS

MAX_ROWS = 16  # the int8 pass's lanes: one token each
# The int8 pass costs about the same at any row count (8 lanes up to 8 rows, else 16); the copy's
# pass grows with the rows (each token's dots), as the head does. Default model, real hidden
# states, 2-core Zen 4, 2026-11-28 (`benchmarks/dev/cpu_greedy_head.py --gguf --rows
# 1,2,3,4,5,6,8,16 --reps 20`, and `--rows 4,5,6,8 --few-rows 8` for the copy above 4 rows): head
# + argmax 6.3 / 6.8 / 8.8 / 11.9 / 14.6 / 16.5 / 20.0 / 20.6 ms; the copy's pass 3.7 / 4.6 / 6.3 /
# 7.7-7.8 / 9.3 / 10.3 / 12.9 (1-8 rows); the int8 pass 8.8 / 8.8 / 8.9 / 10.4 (5, 6, 8, 16 rows).
FEW_ROWS = 4  # up to this many rows: the copy's pass; above, the int8 pass
# The avx2 and avxvnni builds: the int8 pass from this many rows. Default model, real hidden states, 2-core
# Zen 5 forced to avx2, 2026-11-28 (`FLATSERVE_CPU_ISA=avx2 benchmarks/dev/cpu_greedy_head.py
# --gguf --rows 1,2,4,8,9,16 --reps 10 --int8-from 1`): head + argmax 5.5 / 5.5 / 7.6 / 19.2 /
# 22.8 / 34.2 ms, the pass 7.1 / 7.1 / 7.4 / 7.6 / 14.3 / 14.1 (8 lanes to 8 rows, then 16 as
# two ymm; ~90 rows a token rescored since 2026-11-29's outlier blocks, csrc/greedy_q8.h). The
# avxvnni build (vpdpbusd on ymm, x as 8-bit codes as at avx512: ~40 rows a token rescored), the
# same machine forced to avxvnni, `... --rows 1,2,3,4,5,8,9,16 --reps 10 --int8-from 1`: head +
# argmax 3.6 / 4.0 / 5.4 / 6.6 / 13.2 / 16.7 / 20.4 / 30.9 ms, the pass 4.7 / 4.7 / 4.7 / 4.7 /
# 4.8 / 4.9 / 8.7 / 8.9.
AVX2_MIN_ROWS = {"avx2": 5, "avxvnni": 3}  # by the build's level (dev.AVX2_LEVELS)
Q8_0 = FORMATS["q8_0"]


def eligible(head: nn.Module) -> bool:
    """A QuantLinear LM head of one Q8_0 segment, no bias, no act-order permutation, on the
    avx512 build (Zen 4 class: VNNI, no AMX) or an AVX2 one (avxvnni, avx2). The amx build keeps its tiles'
    head (AMX's goals were met without it; the pass is not measured there)."""
    if not isinstance(head, quant.QuantLinear) or head.bias is not None or head.perm.numel():
        return False
    ext = quant.kernel()
    return head.fmts == [Q8_0] and ext is not None and ext.isa() in ("avx512", *dev.AVX2_LEVELS) \
        and ext.has_greedy_q8()


class Q8GreedyHead(BoundedHead):
    """The int8 pass on the head's own codes (avx512, avxvnni and avx2 builds), and below it the
    rows-in-lanes copy (avx512) or greedy_q4's copy for one row (avx2 and avxvnni: `one_row`)."""

    def __init__(self, head: quant.QuantLinear, trial: bool = False) -> None:
        super().__init__(head)
        ext = quant.kernel()
        self.isa = ext.isa()
        sums, norms = ext.greedy_q8_prep(head.qweight0, head.in_features)
        self.register_buffer("sums", sums)    # [N, K / 32] int16: each block's code sum
        self.register_buffer("norms", norms)  # [N] fp32: |W_n|_1, rounded up
        self.one_row = greedy_q4.Q4GreedyHead(head, trial) if greedy_q4.eligible(head) else None  # AVX2
        if self.one_row is None:
            codes, scales, self.wmax = greedy_q4.quantize_q4(head.qweight0, head.in_features)
            self.register_buffer("copy_codes", codes)    # [N / 16, K / 32 x 256] uint8 (greedy_q4t.h)
            self.register_buffer("copy_scales", scales)  # [N / 16, K / 32 x 16] fp16 bits

    @property
    def nbytes(self) -> int:
        few = self.one_row.nbytes if self.one_row is not None else \
            self.copy_codes.numel() + self.copy_scales.numel() * 2
        return self.sums.numel() * 2 + self.norms.numel() * 4 + few

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [M, K] -> [M] int64
        if self.one_row is not None and x.shape[0] < AVX2_MIN_ROWS[self.isa]:  # its own checks and counts
            return self.one_row(x)
        self.calls += 1
        ext = quant.kernel()
        if ext is None or not ext.has_greedy_q8() or not 1 <= x.shape[0] <= MAX_ROWS \
                or not bool(torch.isfinite(x).all()):
            return self._full(x)  # NaN / inf: the bound means nothing there
        w8 = self.head.qweight0
        if self.one_row is None and x.shape[0] <= FEW_ROWS:
            tokens, self.last_counts = ext.greedy_q4t_argmax(x.contiguous(), w8, self.copy_codes,
                                                             self.copy_scales, self.wmax)
        else:
            tokens, self.last_counts = ext.greedy_q8_argmax(x.contiguous(), w8, self.sums, self.norms)
        return tokens


def for_model(model: nn.Module, mcfg: object) -> Q8GreedyHead | None:
    """The int8 pass for an eligible Q8_0 LM head with plain logits (greedy_q4.plain_logits), else None."""
    head = getattr(model, "lm_head", None)
    return Q8GreedyHead(head, trial=True) if plain_logits(mcfg) and eligible(head) else None
