"""Does torch's CPU matmul give a row the same bits whatever the call's row count? And what do
fixed-size row calls cost? (flatserve/model/quant.py, _dense_rows.)

    .venv/bin/python benchmarks/dev/cpu_gemm_row_tiles.py [--tile 128]
    MKL_ENABLE_INSTRUCTIONS=AVX2 .venv/bin/python benchmarks/dev/cpu_gemm_row_tiles.py

Prints, per shape, the row counts M whose rows differ from the same rows of a 300-row call (bf16
and fp32), whether fixed-size calls give the same bits at every row offset, and the time of one
2,048-row fp32 call against the same rows in fixed-size calls.
"""
from __future__ import annotations

import argparse
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tile", type=int, default=128)
    t = ap.parse_args().tile
    torch.manual_seed(0)
    for k, n in [(640, 2048), (2048, 640), (640, 512)]:
        x, w = torch.randn(300, k), torch.randn(n, k)
        for dt in (torch.bfloat16, torch.float32):
            xs, ws = x.to(dt), w.to(dt)
            full = xs @ ws.t()
            bad = [m for m in range(1, 300, 7) if not torch.equal(xs[:m] @ ws.t(), full[:m])]
            print(f"K={k} N={n} {dt}: rows differ at M = {bad[:12]}")
        xt = torch.randn(3 * t, k)
        ref = xt[:t] @ w.t()
        moved = sum(not torch.equal((xt[o:o + t] @ w.t())[:t - o], ref[o:]) for o in range(1, t, 5))
        print(f"K={k} N={n}: {t}-row calls, offsets whose shared rows differ: {moved}")
    x, w = torch.randn(2048, 640), torch.randn(2048, 640)
    for name, f in [("one call", lambda: x @ w.t()),
                    (f"{t}-row calls", lambda: torch.cat([x[i:i + t] @ w.t() for i in range(0, 2048, t)]))]:
        f()
        s = time.perf_counter()
        for _ in range(5):
            f()
        print(f"2,048 x 640 @ 640 x 2,048 fp32, {name}: {(time.perf_counter() - s) / 5 * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
