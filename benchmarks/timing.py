"""Wall-clock ms per call for the CPU micro-benchmarks (warm-up calls first, not timed)."""
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
