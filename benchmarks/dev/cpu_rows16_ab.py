"""Without AMX (the avx512 level): each format's quantized GEMM on rows16 (csrc/quant_rows.h)
against the AVX2 kernel, alternated in one process, to choose quant.ROWS16_FORMATS. Cold: 18
distinct weights in turn, as a decode step walks its layers; median of 4 alternated rounds.

    .venv/bin/python benchmarks/dev/cpu_rows16_ab.py [--rows 1,16]
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

# The default Gemma 3 270M Q4_K_M file's shapes, and q5_k (not in it) at down's shape.
SHAPES = [("q4_k", 640, 1024), ("q4_k", 640, 2048), ("q5_k", 640, 2048), ("q6_k", 640, 2048),
          ("q5_0", 4096, 640), ("q8_0", 256, 640)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,16")
    a = ap.parse_args()
    ext = quant.kernel()
    print(f"level {ext.isa()}, {torch.get_num_threads()} threads")
    for f, n, k in SHAPES:
        fmt = FORMATS[f]
        lins = [quant.QuantLinear(k, {"": (n, fmt)}) for _ in range(18)]
        for i, lin in enumerate(lins):
            lin.load_quant("", random_blocks(fmt, n, k, seed=i), fmt)
        for rows in (int(r) for r in a.rows.split(",")):
            x = torch.randn(rows, k).bfloat16()
            res: dict[str, list[float]] = {"avx2": [], "rows16": []}
            with torch.inference_mode():
                for _ in range(4):
                    for name, mask in (("avx2", 0), ("rows16", 1 << min(fmt.ggml_type, 62))):
                        ext.set_rows16_formats(mask)
                        for lin in lins:
                            lin._int16(ext, x)
                        t = time.perf_counter()
                        for _ in range(5):
                            for lin in lins:
                                lin._int16(ext, x)
                        res[name].append((time.perf_counter() - t) / (5 * len(lins)) * 1e6)
            med = {kk: sorted(v)[len(v) // 2] for kk, v in res.items()}
            print(f"{f} {n:5d} x {k:5d}, {rows:2d} rows: AVX2 {med['avx2']:8.1f} us, rows16 "
                  f"{med['rows16']:8.1f} us ({med['avx2'] / med['rows16']:.2f}x)", flush=True)
    quant._rows16_set.clear()
    quant.kernel()  # the default mask again


if __name__ == "__main__":
    main()
