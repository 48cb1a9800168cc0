"""The floor of a CPU decode step on this machine: the bytes a step must read (bf16 weights, the
LM head included, plus the KV cache at a given context) over the measured read bandwidth, and
its multiply-adds over the measured fp32 FMA rate (torch's fp32 matmul, prompt-sized). A decode
step of R rows costs at least max(bytes / bandwidth, 2 R params / flops); a bench run's
tokens/s can be set against it.

    .venv/bin/python benchmarks/cpu_floor.py [--rows 1,16] [--context 320]
    .venv/bin/python benchmarks/cpu_floor.py --sweep

--sweep: instead, the read bandwidth by working-set size (fp32 arrays of 32 MB to 1.5 GB, best
of 3 rounds of 4 passes each). Where the rate falls shows how much of the L3 one process keeps
between passes; a decode step of the default model reads ~536 MB of bf16 weights plus its KV.

Runtime (estimate, not timed): well under a minute on 2 cores, the sweep too.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root
from benchmarks.common import isa  # noqa: E402
from flatserve.model.config import ModelConfig  # noqa: E402
from flatserve.model.loader import load_hf_config, resolve_model  # noqa: E402


def read_gbs(mb: int = 512) -> float:
    """GB/s of repeated full reads (x.sum()) of an `mb`-MB fp32 array (the default is well past
    the L3): best of 3 rounds of 4 passes."""
    x = torch.randn(mb * 2**20 // 4)
    x.sum()
    best = 0.0
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(4):
            x.sum()
        best = max(best, x.numel() * 16 / (time.perf_counter() - t) / 1e9)
    return best


def fp32_gflops(m: int = 512, k: int = 640, n: int = 2048) -> float:
    a, b = torch.randn(m, k), torch.randn(k, n)
    a @ b
    best = 0.0
    for _ in range(5):
        t = time.perf_counter()
        a @ b
        best = max(best, 2 * m * k * n / (time.perf_counter() - t) / 1e9)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--rows", default="1,16")
    ap.add_argument("--context", type=int, default=320, help="tokens each row's KV holds")
    ap.add_argument("--sweep", action="store_true", help="read bandwidth by working-set size, then exit")
    a = ap.parse_args()
    if a.sweep:
        print(f"{torch.get_num_threads()} threads")
        for mb in (32, 64, 128, 256, 384, 512, 768, 1024, 1536):
            print(f"{mb:5d} MB: read {read_gbs(mb):.1f} GB/s", flush=True)
        return
    m = ModelConfig.from_hf(load_hf_config(resolve_model(a.model)))
    h, q, kv, i = m.hidden_size, m.num_heads * m.head_dim, m.num_kv_heads * m.head_dim, m.intermediate_size
    layer = h * (q + 2 * kv) + q * h + 3 * h * i
    params = m.num_layers * layer + m.vocab_size * h  # the LM head read once a step (tied or not)
    bw, fl = read_gbs(), fp32_gflops()
    print(f"CPU ISA: {isa()}, {torch.get_num_threads()} threads; read {bw:.1f} GB/s, fp32 matmul "
          f"{fl:.0f} GFLOP/s; {params / 1e6:.1f} M params a step ({2 * params / 1e6:.0f} MB bf16)")
    for r in (int(x) for x in a.rows.split(",")):
        nbytes = 2 * params + r * a.context * m.kv_bytes_per_token * 2  # bf16 KV
        t_mem, t_fl = nbytes / bw / 1e6, 2 * r * params / fl / 1e6
        floor = max(t_mem, t_fl)
        print(f"rows {r:3d}: {nbytes / 1e6:.0f} MB -> {t_mem:.1f} ms; {2 * r * params / 1e9:.2f} GFLOP "
              f"-> {t_fl:.1f} ms; floor {floor:.1f} ms a step = {1000 * r / floor:.0f} tok/s")


if __name__ == "__main__":
    main()
