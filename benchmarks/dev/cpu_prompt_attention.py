"""Prompt attention on the CPU, one layer: the row-invariant prompt kernel against the torch
reference's SDPA (and the decode kernel) on whole prompts, Gemma-3-270M's heads by default.

    python benchmarks/dev/cpu_prompt_attention.py [--lens 128 512 1024 2048] [--hq 4 --hkv 1 --d 256]
        [--window 512] [--seqs 1] [--threads N]

Prints ms per call (median of --reps) per path and the prompt kernel's ratio to SDPA.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

sys.path.insert(0, ".")
from flatserve.attention import cpu_backend as cb  # noqa: E402
from flatserve.attention.base import LayerAttnParams  # noqa: E402
from flatserve.attention.torch_backend import attend_seqs  # noqa: E402
from tests.attention.cases import make_case  # noqa: E402


def _ms(f, reps: int) -> float:
    f()
    t = []
    for _ in range(reps):
        t0 = time.perf_counter()
        f()
        t.append(time.perf_counter() - t0)
    return statistics.median(t) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lens", type=int, nargs="+", default=[128, 512, 1024, 2048])
    ap.add_argument("--hq", type=int, default=4)
    ap.add_argument("--hkv", type=int, default=1)
    ap.add_argument("--d", type=int, default=256)
    ap.add_argument("--window", type=int, default=0, help="sliding window (0: none)")
    ap.add_argument("--seqs", type=int, default=1, help="prompts per call")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--decode-kernel", action="store_true", help="also time the decode kernel")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    p = LayerAttnParams(a.d ** -0.5, a.window or None)
    print(f"threads {torch.get_num_threads()}, heads {a.hq}/{a.hkv} x {a.d}, window {a.window or None}, "
          f"{a.seqs} prompt(s) per call, bf16")
    for L in a.lens:
        q, kc, vc, meta = make_case([L] * a.seqs, [L] * a.seqs, a.hq, a.hkv, a.d, 16,
                                    torch.bfloat16, seed=0, device="cpu")
        seqs = list(range(a.seqs))
        out = torch.empty_like(q)
        paths = {
            "prompt kernel": lambda: cb.paged_prompt(q, kc, vc, meta.block_table, meta.seq_lens,
                                                     meta.cu_seqlens_q, p),
            "sdpa": lambda: attend_seqs(q, kc, vc, meta, p, None, out, seqs)}
        if a.decode_kernel:
            paths["decode kernel"] = lambda: cb.paged_decode(q, kc, vc, meta.block_table, meta.seq_lens,
                                                             p, None, meta.cu_seqlens_q)
        t = {k: _ms(f, a.reps) for k, f in paths.items()}
        print(f"L {L:5d}: " + ", ".join(f"{k} {v:.2f} ms" for k, v in t.items())
              + f"; prompt kernel / sdpa {t['prompt kernel'] / t['sdpa']:.2f}")


if __name__ == "__main__":
    main()
