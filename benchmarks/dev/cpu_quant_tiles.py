"""The quantized GEMM's paths at the amx level, AMX-INT8 tiles (csrc/quant_amx.h) and rows16
(csrc/quant_rows.h, the tiles' bits in AVX-512 lanes), against the avx2 level's vector path
(the AVX2 int16 code), one format and shape, at 1-32 activation rows, alternated in one process
(min of 7 calls each; this kind of VM drifts +-30% between runs).

    .venv/bin/python benchmarks/dev/cpu_quant_tiles.py [--fmt q8_0] [--k 640] [--n 262144]

Needs an AMX CPU. quant_gemm_cpu.cpp's tile_rows came from this script.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, ".")
from flatserve.model import quant  # noqa: E402
from flatserve.model.qformats import FORMATS  # noqa: E402
from tests.model.test_qformats import random_blocks  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--fmt", default="q8_0", choices=sorted(FORMATS))
    ap.add_argument("--k", type=int, default=640)
    ap.add_argument("--n", type=int, default=262144)
    ap.add_argument("--rows", default="1,2,4,8,16,32")
    args = ap.parse_args()
    fmt = FORMATS[args.fmt]
    w = random_blocks(fmt, args.n, args.k, 0).reshape(args.n, -1)
    exts = {}
    for level in ("avx2", "amx"):
        os.environ["FLATSERVE_CPU_ISA"] = level
        exts[level] = quant.kernel()
        assert exts[level] is not None and (level != "amx" or exts[level].isa() == "amx"), "needs an AMX CPU"
    runs = {"vector": (exts["avx2"], 0), "rows16": (exts["amx"], 1), "tiles": (exts["amx"], 2)}
    print(f"{args.fmt} {args.n} x {args.k}, {torch.get_num_threads()} threads")
    for m in map(int, args.rows.split(",")):
        x = torch.randn(m, args.k).bfloat16()
        best = {}
        for _ in range(7):
            for name, (ext, path) in runs.items():
                acts = ext.quantize_act(x)
                y = torch.empty(m, args.n, dtype=torch.bfloat16)
                t = time.perf_counter()
                ext.gemm(*acts, w, fmt.ggml_type, y, 0, path=path)
                best[name] = min(best.get(name, 1e9), time.perf_counter() - t)
        v = best["vector"]
        print(f"{m:3d} rows: vector {v * 1e3:7.2f} ms  rows16 {best['rows16'] * 1e3:7.2f} ms"
              f" ({best['rows16'] / v:.2f}x)  tiles {best['tiles'] * 1e3:7.2f} ms ({best['tiles'] / v:.2f}x)")


if __name__ == "__main__":
    main()
