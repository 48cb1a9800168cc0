"""The avx2 / avxvnni builds' two quantized-GEMM paths (csrc/quant_tiles_ymm.h), alternated in one
process (min of --reps calls each): rows8 (gemm path 1, weight rows in the lanes) against the
tiles in 256-bit lanes (path 2), the same bits, at a few row counts, on the default GGUF's shapes.
quant_gemm_cpu.cpp's ymm_rows (where AUTO calls switch from rows8 to the tiles) came from this.

    FLATSERVE_CPU_ISA=avxvnni .venv/bin/python benchmarks/dev/cpu_ymm_paths.py [--rows 1,2,4,6,8,12,16]
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

sys.path.insert(0, ".")
from flatserve import device as dev  # noqa: E402
from flatserve.model import quant  # noqa: E402
from flatserve.model.qformats import FORMATS  # noqa: E402
from tests.model.test_qformats import random_blocks  # noqa: E402

SHAPES = [("q5_0", 4096, 640), ("q4_k", 640, 2048), ("q8_0", 640, 1024), ("q8_0", 262144, 640)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,2,4,6,8,12,16")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    ext = quant.kernel()
    assert ext is not None and ext.isa() in dev.AVX2_LEVELS, "run at the avx2 or avxvnni level"
    print(f"level {ext.isa()}, {torch.get_num_threads()} threads; ms a call, rows8 / tiles, bf16")
    for name, n, k in SHAPES:
        fmt = FORMATS[name]
        w = random_blocks(fmt, n, k, 1).reshape(n, -1)
        line = f"{name} {n} x {k}:"
        for m in map(int, args.rows.split(",")):
            acts = ext.quantize_act(torch.randn(m, k).bfloat16())
            y = torch.empty(m, n, dtype=torch.bfloat16)
            best = {1: 1e9, 2: 1e9}
            for _ in range(args.reps):
                for path in best:
                    t = time.perf_counter()
                    ext.gemm(*acts, w, fmt.ggml_type, y, 0, path)
                    best[path] = min(best[path], time.perf_counter() - t)
            line += f"  {m}: {best[1] * 1e3:.2f} / {best[2] * 1e3:.2f}"
        print(line, flush=True)


if __name__ == "__main__":
    main()
