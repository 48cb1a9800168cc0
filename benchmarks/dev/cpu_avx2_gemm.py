"""The AVX2 bf16-weight linears (flatserve/model/avx2.py) against torch's fp32 and bf16 F.linear
on Gemma 3 270M's shapes, at decode (1, 16 rows) and prompt (512 rows) sizes: median ms, and the
weight-read rate (GB/s of bf16 weight bytes) or GFLOP/s. Cold weights: each call reads a weight
the previous calls pushed out of cache (a rotation of copies larger than the L3), as a decode
step's layers do.

    .venv/bin/python benchmarks/dev/cpu_avx2_gemm.py [--rows 1,16,512]
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from flatserve.model import avx2

SHAPES = {"qkv": (1536, 640), "o": (640, 1024), "gate_up": (4096, 640), "down": (640, 2048),
          "lm_head": (262144, 640)}


def timed(fns: list, reps: int) -> float:
    ts = []
    for i in range(reps):
        f = fns[i % len(fns)]
        t = time.perf_counter()
        f()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,16,512")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    a = ap.parse_args()
    torch.manual_seed(0)
    print(f"{torch.get_num_threads()} threads; ms (median), weight GB/s or GFLOP/s")
    for name in a.shapes.split(","):
        n, k = SHAPES[name]
        copies = max(1, int(64e6 // (n * k * 2)))  # >= 64 MB of weights in rotation: cold reads
        ws = [torch.randn(n, k).bfloat16() for _ in range(copies)]
        lins = [avx2.AVX2Linear(w, None, plain=name == "lm_head") for w in ws]
        w32 = [w.float() for w in ws[: max(1, copies // 2)]]
        for r in (int(x) for x in a.rows.split(",")):
            if name == "lm_head" and r > 16:
                continue
            x = torch.randn(r, k).bfloat16()
            x32 = x.float()
            reps = 9 if r > 16 or name == "lm_head" else 41
            t_ours = timed([lambda lin=lin: lin(x) for lin in lins], reps)
            t_32 = timed([lambda w=w: F.linear(x32, w) for w in w32], reps)
            t_16 = timed([lambda w=w: F.linear(x, w) for w in ws], min(reps, 9))
            flops = 2 * r * n * k
            rate = lambda t: (f"{n * k * 2 / t / 1e6:.1f} GB/s" if r <= 16  # noqa: E731
                              else f"{flops / t / 1e6:.0f} GFLOP/s")
            print(f"{name:8s} {n:6d}x{k:4d} rows {r:3d}: avx2 {t_ours:7.2f} ms ({rate(t_ours)}), "
                  f"torch fp32 {t_32:7.2f} ms, torch bf16 {t_16:7.2f} ms: {t_32 / t_ours:.2f}x fp32",
                  flush=True)


if __name__ == "__main__":
    main()
