"""The quantized GEMM's tile-bit paths, the tiles (AMX-INT8 at the amx level, csrc/quant_amx.h;
their VNNI emulation at the avx512 level, csrc/quant_vnni.h) and rows16 (csrc/quant_rows.h),
against the vector path (the AVX2 int16 code: the avx2 level's under amx, the avx512 build's own
under avx512), one format and shape, at 1-32 activation rows, alternated in one process (min of
7 calls each; this kind of VM drifts +-30% between runs).

    .venv/bin/python benchmarks/dev/cpu_quant_tiles.py [--fmt q8_0] [--k 640] [--n 262144]

--level amx needs an AMX CPU. quant_gemm_cpu.cpp's tile_rows came from this script.
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
    ap.add_argument("--level", default="auto", choices=["auto", "amx", "avx512"])
    args = ap.parse_args()
    fmt = FORMATS[args.fmt]
    w = random_blocks(fmt, args.n, args.k, 0).reshape(args.n, -1)
    level = args.level
    if level == "auto":
        level = "amx" if "amx_tile" in open("/proc/cpuinfo").read() else "avx512"
    exts = {}
    for lv in ("avx2", level):
        os.environ["FLATSERVE_CPU_ISA"] = lv
        exts[lv] = quant.kernel()
        assert exts[lv] is not None and exts[lv].isa() == lv, f"this CPU does not run the {lv} level"
    vector = exts["avx2"]
    if level == "avx512":  # the avx512 build's own vector path: no format on rows16
        vector = exts[level]
        vector.set_rows16_formats(0)
    runs = {"vector": (vector, 0), "rows16": (exts[level], 1), "tiles": (exts[level], 2)}
    print(f"{args.fmt} {args.n} x {args.k}, level {level}, {torch.get_num_threads()} threads")
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
