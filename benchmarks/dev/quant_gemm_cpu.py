"""The quantized linears' C++ kernel (flatserve/ops/csrc/quant_gemm_cpu.cpp) against torch's dense
fp32 F.linear on the same weights dequantized, on the default model's shapes and formats, at
decode sizes (1 and 16 rows) and one prompt chunk; the two alternated per round, median reported.

  PYTHONPATH=. python benchmarks/dev/quant_gemm_cpu.py [--rounds 5]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from flatserve.model import quant
from flatserve.model.qformats import FORMATS, dequantize, quantize

# (name, N, K, format): the default Gemma 3 270M Q4_K_M file's linears.
SHAPES = [("lm_head", 262144, 640, "q8_0"), ("gate_up", 4096, 640, "q5_0"),
          ("qkv (q|k)", 1280, 640, "q5_0"), ("o_proj", 640, 1024, "q4_k"), ("down", 640, 2048, "q6_k")]


def _time(fn, reps: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--rows", default="1,16,256")
    a = ap.parse_args()
    assert quant.kernel() is not None, "the C++ kernel did not build"
    print(f"kernel isa: {quant.kernel().isa()}, threads: {torch.get_num_threads()}")
    print("| linear | format | rows | quant ms | dense fp32 ms | speed-up | quant weight GB/s |")
    print("|---|---|---|---|---|---|---|")
    for name, n, k, f in SHAPES:
        fmt = FORMATS[f]
        g = torch.Generator().manual_seed(0)
        raw = quantize(torch.randn(n, k, generator=g) * 0.05, fmt)
        lin = quant.QuantLinear(k, {"": (n, fmt)})
        lin.load_quant("", raw, fmt)
        w = dequantize(raw, fmt, k)
        for m in (int(r) for r in a.rows.split(",")):
            x = torch.randn(m, k)
            reps = max(1, int(2e8 // (n * k * max(1, m // 16))))
            tq, td = [], []
            for _ in range(a.rounds):
                tq.append(_time(lambda: lin(x), reps))
                td.append(_time(lambda: F.linear(x, w), reps))
            q, d = statistics.median(tq), statistics.median(td)
            print(f"| {name} {n}x{k} | {f} | {m} | {q * 1e3:.2f} | {d * 1e3:.2f} | {d / q:.2f}x | "
                  f"{raw.numel() / q / 1e9:.1f} |", flush=True)


if __name__ == "__main__":
    main()
