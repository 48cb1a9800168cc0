"""Prompt rows of a quantized linear on this level's two paths, alternated in one process (min of
--reps calls each): the dense one (C++ dequantization of the weight, then torch's fp32 GEMM in
quant.ROW_TILE-row calls: QuantLinear.reference) against the tiles on the int16 codes
(quantize_act, then gemm's path 2: csrc/quant_tiles_ymm.h below AVX-512, csrc/quant_vnni.h or
the AMX tiles above). The shapes are the default GGUF's linears (Gemma 3 270M: q|k|v 1,024 x 640
q5_0, o 640 x 1,024 q4_k, gate|up 4,096 x 640 q5_0, down 640 x 2,048 q4_k / q6_k) and the
other formats' blocks.

    FLATSERVE_CPU_ISA=avx2 .venv/bin/python benchmarks/dev/cpu_prompt_tiles.py [--rows 256,2048]

quant.PROMPT_INT16_LEVELS came from this script.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

sys.path.insert(0, ".")
from flatserve.model import quant  # noqa: E402
from flatserve.model.qformats import FORMATS  # noqa: E402
from tests.model.test_qformats import random_blocks  # noqa: E402

SHAPES = [("q5_0", 1024, 640), ("q4_k", 640, 1024), ("q5_0", 4096, 640), ("q4_k", 640, 2048),
          ("q6_k", 640, 2048), ("q5_k", 640, 2048), ("q8_0", 640, 1024), ("q4_0", 1024, 640)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="256,2048")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    ext = quant.kernel()
    assert ext is not None, "the quantized linears' kernel did not build here"
    print(f"level {ext.isa()}, {torch.get_num_threads()} threads; ms a call, bf16 activations")
    for name, n, k in SHAPES:
        lin = quant.QuantLinear(k, {"": (n, FORMATS[name])})
        lin.load_quant("", random_blocks(FORMATS[name], n, k, 0), FORMATS[name])
        for m in map(int, args.rows.split(",")):
            x = torch.randn(m, k).bfloat16()
            runs = {"dense": lambda: lin.reference(x, ext), "tiles": lambda: lin._int16(ext, x, quant.TILES)}
            best = {r: 1e9 for r in runs}
            for _ in range(args.reps + 1):
                for r, f in runs.items():
                    t = time.perf_counter()
                    f()
                    best[r] = min(best[r], time.perf_counter() - t)
            d, t = best["dense"] * 1e3, best["tiles"] * 1e3
            print(f"{name} {n:5d} x {k:5d}, {m:5d} rows: dense {d:7.2f}  tiles {t:7.2f}  ({t / d:.2f}x)")


if __name__ == "__main__":
    main()
