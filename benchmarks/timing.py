"""Timing helpers: wall-clock ms per call for the CPU micro-benchmarks (warm-up calls first, not
timed), and median GPU ms by CUDA events (`gpu_ms`)."""
from __future__ import annotations

import time
from typing import Callable


def ms_per_call(fn: Callable[[], object], n: int = 10, warm: int = 1) -> float:
    for _ in range(warm):
        fn()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t) / n * 1e3


# ~0.5 ms of GPU spin (torch.cuda._sleep counts cycles): long enough for the host to queue the
# timed call behind it, so host launch overhead never shows up between the events.
SLEEP_CYCLES = 1_000_000


def gpu_ms(fn: Callable[[], object], timer: str = "events", warmup: int = 20, reps: int = 100) -> float:
    """Median ms of fn on the GPU.

    timer "do_bench": triton.testing.do_bench, which zeroes a 256 MB buffer before every call.
    That memset leaves the L2 full of dirty lines, and the timed kernel pays for writing them
    back: +8 us on a 130-260 us decode (benchmarks/decode_flush.py). timer "events": CUDA events
    around each call, with a GPU spin (no memory traffic) before it instead of the memset. Callers
    rotate their inputs over copies larger than L2, so data is still read from HBM each call."""
    import statistics

    import torch

    if timer == "do_bench":
        import triton

        return triton.testing.do_bench(fn, warmup=50, rep=300, return_mode="median")
    for _ in range(warmup):
        fn()
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
             for _ in range(reps)]
    for a, b in pairs:
        torch.cuda._sleep(SLEEP_CYCLES)
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in pairs)
