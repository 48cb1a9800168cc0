"""Decode-size GEMMs on the GPU: the model's projections at 64 and 256 rows, cuBLAS vs cuBLASLt.

    PYTHONPATH=. python3 benchmarks/dev/skinny_gemm.py [--shape qwen3-0.6b] [--out F.json]

Why: at 64 rows a decode step's five GEMMs per layer read ~30 MB of weights (7 us at 4 TB/s) and
took 0.76 ms per forward against a 0.28 ms floor (a kernel profile of benchmarks/dev/step_breakdown.py --profile).
Each row: median us (triton.testing.do_bench, L2 flushed between runs), achieved weight GB/s.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, ".")

SHAPES = {  # name -> [(projection, in K, out N)]
    "qwen3-0.6b": [("qkv", 1024, 4096), ("o", 2048, 1024), ("gate_up", 1024, 6144),
                   ("down", 3072, 1024), ("lm_head", 1024, 151936)],
    "llama-3-8b": [("qkv", 4096, 6144), ("o", 4096, 4096), ("gate_up", 4096, 28672),
                   ("down", 14336, 4096), ("lm_head", 4096, 128256)],
}


def main() -> None:
    import torch
    from triton.testing import do_bench

    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-0.6b", choices=sorted(SHAPES))
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    rows = []
    for name, K, N in SHAPES[a.shape]:
        w = torch.randn(N, K, dtype=torch.bfloat16, device="cuda") * 0.02
        for M in (64, 256):
            x = torch.randn(M, K, dtype=torch.bfloat16, device="cuda")
            row = {"proj": name, "M": M, "K": K, "N": N}
            for lib in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(lib)
                us = do_bench(lambda: torch.nn.functional.linear(x, w), return_mode="median") * 1e3
                row[f"{lib}_us"] = us
                row[f"{lib}_GBps"] = (N * K + M * K + M * N) * 2 / us / 1e3
            rows.append(row)
            print(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in row.items()}),
                  flush=True)
    torch.backends.cuda.preferred_blas_library("cublas")
    if a.out:
        Path(a.out).write_text(json.dumps({"gpu": torch.cuda.get_device_name(), "shape": a.shape,
                                           "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
