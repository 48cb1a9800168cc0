"""One activation row (or --rows) through the quantized GEMM, the default model's layer shapes and
formats: warm (one weight matrix, called again and again) against cold (18 distinct matrices in
turn, as a decode step walks its layers), so the rate per weight byte shows what is compute and
what is memory. The path is the ISA level's own (rows16 at the amx level, the AVX2 vector path
below; at the avx512 level by quant.ROWS16_FORMATS).

    .venv/bin/python benchmarks/dev/cpu_quant_row1.py [--level amx] [--layers 18] [--reps 20]
    .venv/bin/python benchmarks/dev/cpu_quant_row1.py --rows 16 --pass-rows 4,8   # the avx512 A/B
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

# (name, format, N out, K in): Gemma 3 270M's Q4_K_M file (gate and up run as one 4096-row call)
SHAPES = [("gate_up", "q5_0", 4096, 640), ("q", "q5_0", 1024, 640), ("k", "q5_0", 256, 640),
          ("v", "q8_0", 256, 640), ("o", "q4_k", 640, 1024), ("down", "q6_k", 640, 2048),
          ("down'", "q4_k", 640, 2048), ("head", "q8_0", 262144, 640)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--level", default=None, help="FLATSERVE_CPU_ISA for the kernel build")
    ap.add_argument("--layers", type=int, default=18)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--only", default=None, help="comma-separated shape names")
    ap.add_argument("--rows", type=int, default=1, help="activation rows a call")
    ap.add_argument("--pass-rows", default=None, help="A/B: 4,8 alternates the kernel's "
                    "activation rows a pass (set_pass_rows) per round; the process ends after")
    args = ap.parse_args()
    if args.level:
        os.environ["FLATSERVE_CPU_ISA"] = args.level
    ext = quant.kernel()
    print(f"level {ext.isa()}, {torch.get_num_threads()} threads, {args.rows} row(s)")
    passes = [int(p) for p in args.pass_rows.split(",")] if args.pass_rows else [None]
    for name, fname, n, k in SHAPES:
        if args.only and name not in args.only.split(","):
            continue
        fmt = FORMATS[fname]
        layers = 1 if name == "head" else args.layers
        ws = [random_blocks(fmt, n, k, i).reshape(n, -1) for i in range(layers)]
        acts = ext.quantize_act(torch.randn(args.rows, k).bfloat16())
        y = torch.empty(args.rows, n, dtype=torch.bfloat16)
        out: dict[tuple[str, int | None], float] = {}
        for _ in range(args.reps):  # the A/B's settings alternate per round; best of the rounds
            for p in passes:
                if p is not None:
                    ext.set_pass_rows(p)
                for mode, seq in (("warm", [ws[0]] * layers), ("cold", ws)):
                    t = time.perf_counter()
                    for w in seq:
                        ext.gemm(*acts, w, fmt.ggml_type, y, 0)
                    out[mode, p] = min(out.get((mode, p), 1e9), (time.perf_counter() - t) / len(seq))
        nbytes = ws[0].numel()
        blocks = n * k / 32 * args.rows
        for p in passes:
            warm, cold = out["warm", p], out["cold", p]
            print(f"{name:8s} {fname} {n:6d} x {k:4d}{'' if p is None else f', {p} rows a pass'}: warm "
                  f"{warm * 1e6:8.1f} us ({nbytes / warm / 1e9:5.1f} GB/s, "
                  f"{warm * 1e9 / blocks * torch.get_num_threads():4.1f} ns/row-block/thread)  cold "
                  f"{cold * 1e6:8.1f} us ({nbytes / cold / 1e9:5.1f} GB/s)")


if __name__ == "__main__":
    main()
