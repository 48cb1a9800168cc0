"""bf16 against fp32 weights for the CPU's torch linears (the path `--dtype auto` picks for): the
default model's (Gemma 3 270M) linear shapes at 1 and 16 rows, ms per call, both dtypes
interleaved in one run, and the ISA level this CPU runs.

    .venv/bin/python benchmarks/dev/cpu_dtype_ab.py [--threads N]

A decode step reads every weight once, so bf16 halves the bytes; whether that is faster depends
on torch's bf16 GEMM on this CPU (native on AMX / AVX512-BF16, converted elsewhere).
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, ".")
from benchmarks.common import ms_per_call  # noqa: E402
from flatserve import device as dev  # noqa: E402

# (in, out) of Gemma 3 270M's linears: qkv, o, gate_up, down, LM head.
SHAPES = [(640, 1536), (1024, 640), (640, 4096), (2048, 640), (640, 262144)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    print(f"ISA levels {dev.cpu_isa_levels()}, native bf16: {dev.cpu_has_fast_bf16()}, "
          f"threads {torch.get_num_threads()}, torch {torch.__version__}")
    for rows in (1, 16):
        total = {torch.float32: [], torch.bfloat16: []}
        for _ in range(a.rounds):  # interleaved: this box's noise hits both alike
            for dt in total:
                ms = 0.0
                for k, n in SHAPES:
                    w, x = torch.randn(n, k).to(dt), torch.randn(rows, k).to(dt)
                    ms += ms_per_call(lambda: F.linear(x, w), n=5 if n > 100_000 else 30)
                total[dt].append(ms)
        f, b = statistics.median(total[torch.float32]), statistics.median(total[torch.bfloat16])
        print(f"{rows:2d} rows, one pass over every linear shape: fp32 {f:.2f} ms, bf16 {b:.2f} ms, "
              f"bf16/fp32 time {b / f:.2f}x", flush=True)


if __name__ == "__main__":
    main()
