"""The AMX GEMM kernel at a git revision against the working tree's, built side by side and timed
alternately in one process (this box drifts +-10-25% between runs; min of 9 rounds).

    .venv/bin/python benchmarks/dev/cpu_gemm_ab.py [--rev HEAD]

Gemma 3 270M's shapes (bf16, the packed layout both kernels share), at decode, verify (64 rows:
16 requests x 4 with ngram speculation) and prefill row counts. Prints ms per call for each.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

sys.path.insert(0, ".")
from benchmarks.common import ab_modules  # noqa: E402
from flatserve import device as dev  # noqa: E402
from flatserve.model.amx import AMXLinear  # noqa: E402

SRC = "flatserve/ops/csrc/amx_gemm_cpu.cpp"
CASES = [(262144, 640, 16), (262144, 640, 40), (262144, 640, 55), (262144, 640, 64), (4096, 640, 64), (4096, 640, 2048),
         (640, 2048, 2048), (1536, 640, 2048), (640, 1024, 2048)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rev", default="HEAD")
    a = ap.parse_args()
    if not dev.cpu_has_amx_bf16():
        sys.exit("needs a CPU with AMX bf16")
    dev.keep_freed_heap(torch.device("cpu"))  # as the engine runs: outputs not faulted in per call
    mods = ab_modules(SRC, a.rev, "flatserve_gemm_ab", "flatserve_amx_gemm")
    for m in mods.values():
        assert m.available(), "AMX tile state not granted"
    torch.manual_seed(0)
    empty = torch.empty(0, dtype=torch.bfloat16)
    for n, k, rows in CASES:
        packed = AMXLinear(torch.randn(n, k, dtype=torch.bfloat16), None).packed
        x = torch.randn(rows, k, dtype=torch.bfloat16)
        outs = [m.linear(x, packed, empty) for m in mods.values()]
        assert torch.equal(outs[0], outs[1]), "the two kernels disagree"
        reps = max(1, int(2e9 / (2 * n * k * rows) + 1)) if rows > 64 else 5
        best = {name: 1e9 for name in mods}
        for _ in range(9):
            for name, m in mods.items():
                t = time.perf_counter()
                for _ in range(reps):
                    m.linear(x, packed, empty)
                best[name] = min(best[name], (time.perf_counter() - t) / reps * 1e3)
        print(f"{n:6d} x {k:4d}, {rows:4d} rows: " + ", ".join(f"{name} {ms:.3f} ms" for name, ms in best.items())
              + f" ({best[a.rev] / best['working tree']:.2f}x)", flush=True)


if __name__ == "__main__":
    main()
