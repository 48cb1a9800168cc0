"""The AMX GEMM on a plain [N, K] weight (`linear_plain`, how a tied LM head reads the embedding
table) against the packed kernel and F.linear on the same weight, per shape and row count, same
run, alternated (min of 5 rounds). Gemma 3 270M's shapes, bf16, anonymous memory.

    .venv/bin/python benchmarks/dev/cpu_plain_gemm.py
"""
from __future__ import annotations

import sys
import time

import torch

sys.path.insert(0, ".")
from flatserve import device as dev  # noqa: E402
from flatserve.model.amx import AMXLinear, _ext  # noqa: E402

CASES = [(262144, 640, (1, 16, 32, 64)), (4096, 640, (16, 64, 128, 256, 512)),
         (640, 2048, (16, 64, 128, 256)), (640, 1024, (16,)), (1536, 640, (16,))]


def main() -> None:
    if not dev.cpu_has_amx_bf16():
        sys.exit("needs a CPU with AMX bf16")
    dev.keep_freed_heap(torch.device("cpu"))  # as the engine runs
    ext = _ext()
    torch.manual_seed(0)
    empty = torch.empty(0, dtype=torch.bfloat16)
    for n, k, rows_list in CASES:
        w = torch.randn(n, k, dtype=torch.bfloat16)
        packed = AMXLinear(w, None).packed
        for rows in rows_list:
            x = torch.randn(rows, k, dtype=torch.bfloat16)
            fns = {"packed": lambda: ext.linear(x, packed, empty),
                   "plain": lambda: ext.linear_plain(x, w, empty),
                   "F.linear": lambda: torch.nn.functional.linear(x, w)}
            assert torch.equal(fns["packed"](), fns["plain"]()), "plain and packed kernels disagree"
            reps = 3 if n > 100_000 else 100
            best = dict.fromkeys(fns, 1e9)
            for _ in range(5):
                for name, f in fns.items():
                    t = time.perf_counter()
                    for _ in range(reps):
                        f()
                    best[name] = min(best[name], (time.perf_counter() - t) / reps * 1e3)
            print(f"{n:6d} x {k:4d}, {rows:3d} rows: "
                  + ", ".join(f"{a} {b:.3f} ms" for a, b in best.items())
                  + f" (plain {best['packed'] / best['plain']:.2f}x of packed)", flush=True)


if __name__ == "__main__":
    main()
