"""The AMX prefill attention kernel at a git revision against the working tree's, built side by
side and timed alternately in one process (this box drifts +-10-25% between runs; min of 9
rounds). Shapes of benchmarks/dev/cpu_prefill_attention.py's Gemma 3 270M cases, bf16.

    .venv/bin/python benchmarks/dev/cpu_prefill_ab.py [--rev HEAD]
"""
from __future__ import annotations

import argparse
import sys
import time

import torch

sys.path.insert(0, ".")
from benchmarks.common import ab_modules, paged  # noqa: E402
from flatserve import device as dev  # noqa: E402

SRC = "flatserve/attention/csrc/paged_prefill_amx.cpp"
CASES = [  # name, window, query rows, context before them (4 q heads, 1 KV head, head 256)
    ("local, prompt 1006", 512, 1006, 0), ("local, prompt 1500", 512, 1500, 0),
    ("local, prompt 482", 512, 482, 0), ("local, 512 after 988", 512, 512, 988),
    ("global, prompt 362", 0, 362, 0), ("global, prompt 1006", 0, 1006, 0),
    ("global, prompt 2048", 0, 2048, 0), ("global, 512 after 988", 0, 512, 988),
]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rev", default="HEAD")
    a = ap.parse_args()
    if not dev.cpu_has_amx_bf16():
        sys.exit("needs a CPU with AMX bf16")
    mods = ab_modules(SRC, a.rev, "flatserve_prefill_ab", "flatserve_paged_prefill")
    torch.manual_seed(0)
    for name, win, n, ctx in CASES:
        L = ctx + n
        k, v = torch.randn(L, 1, 256).bfloat16(), torch.randn(L, 1, 256).bfloat16()
        kc, vc, table = paged(k, v)
        q = torch.randn(n, 4, 256).bfloat16()
        lens, cu = torch.tensor([L], dtype=torch.int32), torch.tensor([0, n], dtype=torch.int32)
        outs = [m.paged_prefill(q, kc, vc, table, lens, cu, 256 ** -0.5, win) for m in mods.values()]
        err = (outs[0].float() - outs[1].float()).abs().max().item()
        best = {k_: 1e9 for k_ in mods}
        for _ in range(9):
            for key, m in mods.items():
                t = time.perf_counter()
                for _ in range(5):
                    m.paged_prefill(q, kc, vc, table, lens, cu, 256 ** -0.5, win)
                best[key] = min(best[key], (time.perf_counter() - t) / 5 * 1e3)
        print(f"{name:24s}: " + ", ".join(f"{k_} {ms:.3f} ms" for k_, ms in best.items())
              + f" ({best[a.rev] / best['working tree']:.2f}x; max diff {err:.1e})", flush=True)


if __name__ == "__main__":
    main()
