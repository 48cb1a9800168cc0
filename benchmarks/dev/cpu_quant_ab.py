"""The quantized GEMM (ops/csrc/quant_gemm_cpu.cpp with its csrc/ headers) at a git revision
against the working tree's, in one process, alternated call by call (this kind of VM drifts
+-30% between processes); one activation row by default, the default model's layer shapes and
formats (18 distinct matrices each, as a decode step walks its layers; the LM head once).
Prints each shape's min time per call and whether the two outputs' bits agree.

    .venv/bin/python benchmarks/dev/cpu_quant_ab.py --rev REV [--shapes gate_up,head] [--rows 1]
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

sys.path.insert(0, ".")
from benchmarks.common import ab_modules  # noqa: E402
from flatserve.model.qformats import FORMATS  # noqa: E402
from tests.model.test_qformats import random_blocks  # noqa: E402

SHAPES = {"gate_up": ("q5_0", 4096, 640), "q": ("q5_0", 1024, 640), "v": ("q8_0", 256, 640),
          "o": ("q4_k", 640, 1024), "down": ("q6_k", 640, 2048), "down'": ("q4_k", 640, 2048),
          "head": ("q8_0", 262144, 640)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rev", required=True, help="the base revision")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--rows", type=int, default=1)
    args = ap.parse_args()
    mods = ab_modules("flatserve/ops/csrc/quant_gemm_cpu.cpp", args.rev, "qgemm_ab", "flatserve_quant_gemm_cpu")
    base, new = mods[args.rev], mods["working tree"]
    print(f"level {new.isa()}, {torch.get_num_threads()} threads, {args.rows} row(s)")
    for name in args.shapes.split(","):
        fname, n, k = SHAPES[name]
        fmt = FORMATS[fname]
        count = 1 if name == "head" else 18
        ws = [random_blocks(fmt, n, k, i).reshape(n, -1) for i in range(count)]
        x = torch.randn(args.rows, k).bfloat16()
        best, outs = {"base": 1e9, "new": 1e9}, {}
        for _ in range(7 if name == "head" else 15):
            for tag, e in (("base", base), ("new", new)):
                acts = e.quantize_act(x)
                y = torch.empty(args.rows, n, dtype=torch.bfloat16)
                t = time.perf_counter()
                for w in ws:
                    e.gemm(*acts, w, fmt.ggml_type, y, 0)
                best[tag] = min(best[tag], (time.perf_counter() - t) / count)
                outs[tag] = y
        same = "same" if torch.equal(outs["base"], outs["new"]) else "differ"
        print(f"{name:8s} {fname} {n} x {k}: base {best['base'] * 1e6:8.1f} us  new {best['new'] * 1e6:8.1f} us"
              f"  new/base {best['new'] / best['base']:.3f}  bits {same}")


if __name__ == "__main__":
    main()
