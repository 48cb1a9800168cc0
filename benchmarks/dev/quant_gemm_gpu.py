"""The CUDA quantized linears (flatserve/model/quant_triton.py) against cuBLAS on bf16 weights, at
Llama-3-8B's linear shapes, per format and row count; the weight bytes each call reads over its
time (GB/s) beside the device's copy rate, the memory floor of a decode-sized call.

    PYTHONPATH=. python3 benchmarks/dev/quant_gemm_gpu.py [--formats q4_0,q4_k,q8_0] [--rows 1,16,256,4096]
    PYTHONPATH=. python3 benchmarks/dev/quant_gemm_gpu.py --sweep   # the GEMV's tiles, and each path by rows

Weights are random bytes with finite scales (timing does not depend on the values). Runtime
(estimate, not timed): a minute on an H100.
"""
from __future__ import annotations

import argparse
import sys

sys.path.insert(0, ".")

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


def random_blocks(n: int, k: int, fmt, device: str):
    """uint8 [n, row_bytes] of random codes whose fp16 scale fields hold 2^-8 (finite)."""
    import torch

    w = torch.randint(0, 256, (n, fmt.row_bytes(k)), dtype=torch.uint8, device=device)
    blocks = w.view(n, -1, fmt.type_size)
    one = torch.tensor([2.0 ** -8], dtype=torch.float16).view(torch.uint8).to(device)
    offs = {"q6_k": [208], "q4_k": [0, 2], "q5_k": [0, 2]}.get(fmt.name, [0])
    for o in offs:
        blocks[..., o:o + 2] = one
    return w


def main() -> None:
    import torch
    from triton.testing import do_bench

    from flatserve.bench.gpu import copy_bandwidth
    from flatserve.model import quant_triton
    from flatserve.model.qformats import FORMATS

    ap = argparse.ArgumentParser()
    ap.add_argument("--formats", default="q4_0,q4_k,q8_0")
    ap.add_argument("--rows", default="1,4,16,64,256,1024,4096")
    ap.add_argument("--sweep", action="store_true")
    a = ap.parse_args()
    if a.sweep:
        return sweep(a.formats.split(","))
    bw = copy_bandwidth()  # bytes moved per second (read + write), as offline_gpu.py's floor
    print(f"{torch.cuda.get_device_name()}  copy rate {bw / 1e9:.0f} GB/s")
    rows = [int(r) for r in a.rows.split(",")]
    for name, (n, k) in SHAPES.items():
        dense = torch.randn(n, k, dtype=torch.bfloat16, device="cuda") * 0.02
        for m in rows:
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            t_bf = do_bench(lambda: torch.matmul(x, dense.t(), out=out), warmup=10, rep=50) * 1e3
            line = f"{name:8s} {n:6d}x{k:<6d} M={m:5d}  bf16 {t_bf:8.1f} us ({dense.numel() * 2 / t_bf / 1e3:5.0f} GB/s)"
            for f in a.formats.split(","):
                fmt = FORMATS[f]
                w = random_blocks(n, k, fmt, "cuda")
                t = do_bench(lambda: quant_triton.qgemm(x, w, fmt, out), warmup=10, rep=50) * 1e3
                line += f" | {f} {t:8.1f} us ({w.numel() / t / 1e3:5.0f} GB/s, {t_bf / t:4.2f}x bf16)"
            print(line, flush=True)
    print(f"floor at one row: weight bytes / {bw / 1e9:.0f} GB/s")


def sweep(formats: list[str]) -> None:
    """One row: every (BLOCK_N, KB, splits, warps) of the GEMV, best three per shape and format.
    Then per row count, each path: the GEMV (<= 16), the 64-row tiles, dequantize + cuBLAS."""
    import itertools

    import torch
    from triton.testing import do_bench

    from flatserve.bench.gpu import copy_bandwidth
    from flatserve.model import quant_triton as qt
    from flatserve.model.qformats import FORMATS

    bw = copy_bandwidth()
    for f, (name, (n, k)) in itertools.product(formats, SHAPES.items()):
        fmt = FORMATS[f]
        w = random_blocks(n, k, fmt, "cuda")
        x = torch.randn(1, k, dtype=torch.bfloat16, device="cuda")
        out = torch.empty(1, n, dtype=torch.bfloat16, device="cuda")
        res = []
        for bn, kb, sp, wp in itertools.product((32, 64, 128), (1, 2, 4), (2, 4, 8, 16), (4,)):
            if (k // 32) % (kb * sp):
                continue
            t = do_bench(lambda: qt.gemv(x, w, fmt, out, (bn, kb, sp, wp)), warmup=5, rep=20) * 1e3
            res.append((t, bn, kb, sp, wp))
        res.sort()
        auto = do_bench(lambda: qt.gemv(x, w, fmt, out), warmup=5, rep=20) * 1e3
        tiles = qt._gemv_tiles(x.device, n, k // 32, qt.KERNEL_FORMATS[f] <= 1)
        print(f"{f} {name:8s} floor {w.numel() / bw * 1e6:6.1f} us  auto {tiles} "
              f"{auto:6.1f} us  best " + "  ".join(f"{t:6.1f} us {c}" for t, *c in res[:3]), flush=True)
    for f in formats[:1]:
        fmt = FORMATS[f]
        for (name, (n, k)), m in itertools.product(SHAPES.items(), (1, 2, 4, 8, 16, 32, 64, 128)):
            w = random_blocks(n, k, fmt, "cuda")
            dense = torch.randn(n, k, dtype=torch.bfloat16, device="cuda")
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            out = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            paths = {"bf16": lambda: torch.mm(x, dense.t(), out=out),
                     "dequant_mm": lambda: qt.dequant_mm(x, w, fmt, out)}
            if m <= qt.GEMV_ROWS:
                paths["gemv"] = lambda: qt.gemv(x, w, fmt, out)
            ts = {p: do_bench(fn, warmup=5, rep=20) * 1e3 for p, fn in paths.items()}
            print(f"{f} {name:8s} M={m:4d} " + "  ".join(f"{p} {t:7.1f}" for p, t in ts.items()), flush=True)


if __name__ == "__main__":
    main()
