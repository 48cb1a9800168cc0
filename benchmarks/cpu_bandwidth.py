"""Read bandwidth by working-set size on this machine: `x.sum()` over fp32 arrays of 32 MB to
1.5 GB, best of 3 rounds of 4 passes each. Where the rate falls shows how much of the L3 one
process keeps between passes; a decode step reads ~536 MB of bf16 weights plus its KV.

    .venv/bin/python benchmarks/cpu_bandwidth.py
"""
from __future__ import annotations

import time

import torch


def read_rate(mb: int) -> float:
    """GB/s of repeated full reads of an `mb`-MB array."""
    x = torch.randn(mb * 2**20 // 4)
    x.sum()
    best = 0.0
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(4):
            x.sum()
        best = max(best, x.numel() * 4 * 4 / (time.perf_counter() - t) / 1e9)
    return best


def main() -> None:
    torch.manual_seed(0)
    print(f"{torch.get_num_threads()} threads")
    for mb in (32, 64, 128, 256, 384, 512, 768, 1024, 1536):
        print(f"{mb:5d} MB: read {read_rate(mb):.1f} GB/s", flush=True)


if __name__ == "__main__":
    main()
