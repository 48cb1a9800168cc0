"""Programmatic dependent launch (PDL) for the CUDA decode kernels: the shared piece.

Why: a one-row decode step of Llama-3-8B at 4 bits is ~350 kernels, most of them a few
microseconds long (RMSNorm 3.1 us, the KV store 1.5 us, act-and-mul 1.7 us; H100, 2026-11-27,
docs/performance-gpu.md), and each GEMV after one of them starts streaming its weights only once
it launches. With PDL (sm_90) a kernel launched with `launch_pdl` may start before the one before
it has finished: its programs wait (`gdc_wait`) before touching anything an earlier kernel wrote,
then let the next kernel launch (`gdc_launch_dependents`). The CUDA C++ GEMV
(ops/csrc/q4_gemv_cuda.cu) issues its first step's weight loads before its wait.

The rule that keeps this safe: every PDL kernel waits, in every program, before its first write
and before reading any tensor an earlier kernel may write (so a kernel never finishes before the
one it follows, and the waits chain). Only tensors no PDL kernel writes are read before the wait:
weights, and the step's metadata (positions, slots, cu_seqlens, seq_lens), written by copies or
ordinary launches, which a PDL launch never overtakes (it starts once the ordinary kernel before
it has ended, and the embedding before the first PDL kernel of a step is one).
In CUDA C++, a tensor an earlier kernel writes is read with coherent loads, never ld.global.nc:
ptxas treats .nc data as fixed for the kernel's life and may move such loads above the wait
(it did in one build of q4_ks, 2026-11-29; tests/model/test_gemv_pdl_sass.py checks the SASS).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flatserve import device as dev

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without PDL: device.programmatic_launch says False, PDL stays 0
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def sync(PDL: tl.constexpr):
    """A PDL kernel's first statement: wait for the kernel before, then let the next launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


def launch(device: torch.device, rows: int) -> dict:
    """The constexpr and launch option of a PDL kernel on `device` for a step of `rows` tokens:
    {'PDL': bool[, 'launch_pdl': True]} (the option only where it is on: the Triton interpreter
    does not take it). One-token steps only: that is where the GEMV that gains from it runs (b1
    forward 2.96 -> 2.86-2.89 ms, H100), and a 16-row q4_0 step measured 0.04-0.2 ms slower with
    it (7.14 / 7.31 against 7.32 / 7.52 ms, a drifting machine; raw
    docs/benchmarks/raw/gpu_h100_q4_0_pdl/)."""
    on = rows == 1 and dev.programmatic_launch(device)
    return {"PDL": True, "launch_pdl": True} if on else {"PDL": False}
