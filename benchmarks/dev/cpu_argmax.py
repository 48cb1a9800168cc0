"""Greedy argmax on the CPU: torch on fp32 logits (with and without the bf16 -> fp32 copy), torch
on bf16 logits, and the fused C++ op (`kernels.row_argmax`, flatserve/kernels.py); same logits, same run.

    .venv/bin/python benchmarks/dev/cpu_argmax.py

Gemma 3's 262,144-token vocabulary, 16 rows and 1 row, bf16; ms per call (30 calls).
"""
from __future__ import annotations

import sys

import torch

sys.path.insert(0, ".")
from benchmarks.common import ms_per_call  # noqa: E402
from flatserve import kernels  # noqa: E402


def main() -> None:
    for rows in (16, 1):
        x = torch.randn(rows, 262144).bfloat16()
        xf = x.float()
        t = {"bf16 -> fp32 copy + max": ms_per_call(lambda: x.float().max(dim=-1).indices, n=30),
             "fp32 max": ms_per_call(lambda: xf.max(dim=-1).indices, n=30),
             "bf16 max": ms_per_call(lambda: x.max(dim=-1).indices, n=30),
             "C++ row_argmax": ms_per_call(lambda: kernels.row_argmax(x), n=30)}
        assert torch.equal(kernels.row_argmax(x), xf.max(dim=-1).indices)
        print(f"{rows} x 262144: " + ", ".join(f"{k} {v:.3f} ms" for k, v in t.items()), flush=True)


if __name__ == "__main__":
    main()
