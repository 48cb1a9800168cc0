"""Prompt-sized quantized linears on the CPU against torch's bf16 matmul on the same shapes.

    .venv/bin/python benchmarks/dev/cpu_prompt_linears.py [--rows 2048]

Prompt rows take QuantLinear.reference with the C++ kernel: dequantize the blocks to bf16, then
the dense GEMM in fixed 128-row calls (_dense_rows: row-invariant bits). Printed per format and
the default model's gate_up / down shapes: that path's GMAC/s, its dequantize and _dense_rows
parts, and one torch.matmul of the whole call (the bf16 rate this CPU gives those shapes).
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

sys.path.insert(0, ".")


def bench(f, n: int = 5) -> float:
    f()
    t = time.perf_counter()
    for _ in range(n):
        f()
    return (time.perf_counter() - t) / n * 1e3  # ms


def main() -> None:
    from flatserve.model import quant
    from flatserve.model.qformats import FORMATS, quantize

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=2048)
    a = ap.parse_args()
    ext = quant.kernel()
    assert ext is not None, "the quantized-linear C++ kernel did not build"
    M = a.rows
    for name in ("q5_0", "q8_0", "q4_k", "q6_k"):
        fmt = FORMATS[name]
        for n, k in ((4096, 640), (640, 2048)):
            if k % fmt.block:
                continue
            lin = quant.QuantLinear(k, {"": (n, fmt)}, False)
            lin.load_quant("", quantize(torch.randn(n, k) * 0.02, fmt), fmt)
            x = torch.randn(M, k).bfloat16()
            w = torch.empty(n, k, dtype=torch.bfloat16)
            ref = bench(lambda: lin.reference(x, ext))
            deq = bench(lambda: ext.dequant(lin.blocks(0), fmt.ggml_type, w))
            tiles = bench(lambda: quant._dense_rows(x, w, None))
            one = bench(lambda: torch.matmul(x, w.t()))
            g = M * n * k / 1e6  # MMAC; / ms = GMAC/s
            print(f"{name} {n}x{k} M={M}: prompt path {ref:.1f} ms ({g / ref:.0f} GMAC/s) = dequant "
                  f"{deq:.2f} + 128-row GEMMs {tiles:.1f}; one bf16 matmul {one:.1f} ms ({g / one:.0f} GMAC/s)")


if __name__ == "__main__":
    main()
