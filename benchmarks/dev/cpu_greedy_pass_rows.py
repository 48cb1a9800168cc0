"""The greedy head's int8 pass (csrc/greedy_q8.h) alone, ns a head row, on random Q8_0 heads of
262,144 / 32,768 / 8,192 rows x 640 and 16 rows of x: whether its cost per row changes when the
head sits in cache instead of streaming from DRAM (it did not, 2026-11-29: docs/performance-cpu.md,
"Also dropped", the avx2 greedy pass).

    FLATSERVE_CPU_ISA=avx2 .venv/bin/python benchmarks/dev/cpu_greedy_pass_rows.py
"""
from __future__ import annotations

import sys
import time

import torch

sys.path.insert(0, ".")
from flatserve.model import quant  # noqa: E402
from flatserve.model.qformats import FORMATS  # noqa: E402
from tests.model.test_qformats import random_blocks  # noqa: E402


def main() -> None:
    ext = quant.kernel()
    assert ext is not None and ext.has_greedy_q8(), "no greedy int8 pass in this build"
    k = 640
    full = random_blocks(FORMATS["q8_0"], 262144, k, 0)
    x = torch.randn(16, k, generator=torch.Generator().manual_seed(0)) * 3
    for n in (262144, 32768, 8192) * 2:
        w = full[:n].contiguous()
        sums, norms = ext.greedy_q8_prep(w, k)
        for _ in range(2):
            ext.greedy_q8_argmax(x, w, sums, norms)
        reps = max(3, 262144 * 5 // n)
        t = time.perf_counter()
        for _ in range(reps):
            _, cnt = ext.greedy_q8_argmax(x, w, sums, norms)
        dt = (time.perf_counter() - t) / reps
        print(f"{ext.isa()} rows {n}: {dt * 1e3:.3f} ms, {dt / n * 1e9:.2f} ns a head row, "
              f"{int(cnt.sum())} rows rescored")


if __name__ == "__main__":
    main()
