"""One layer of CPU decode attention, torch backend vs the C++ kernel (same inputs, same run).

    .venv/bin/python benchmarks/dev/cpu_decode_attention.py [--seqs 16] [--dtype bfloat16]
        [--lens 300,800]

Gemma-3-270M attention shape (4 q heads, 1 KV head, head 256, block 16), contexts 10..1,500 + 64
(seeded), shuffled block tables; full attention and a 512-token window. Prints ms per call.
`--lens`: one sequence per listed context length instead (full attention, the C++ kernel only).
"""
from __future__ import annotations

import argparse
import random
import sys

import torch

sys.path.insert(0, ".")
from benchmarks.common import ms_per_call  # noqa: E402
from flatserve.attention.base import LayerAttnParams  # noqa: E402
from flatserve.attention.cpu_backend import paged_decode  # noqa: E402
from flatserve.attention.torch_backend import paged_attention_ref  # noqa: E402
from tests.attention.cases import make_case  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--lens", default=None, help="comma list: one sequence of each length, alone")
    a = ap.parse_args()
    if a.lens:
        for n in (int(v) for v in a.lens.split(",")):
            q, kc, vc, meta = make_case([1], [n], 4, 1, 256, 16, getattr(torch, a.dtype), seed=0, device="cpu")
            p = LayerAttnParams(256 ** -0.5, None)
            t = ms_per_call(lambda: paged_decode(q, kc, vc, meta.block_table, meta.seq_lens, p), n=200, warm=20)
            print(f"one sequence, {n} keys: C++ kernel {t * 1000:.0f} us per layer")
        return
    random.seed(0)
    lens = [random.randint(10, 1500) + 64 for _ in range(a.seqs)]
    q, kc, vc, meta = make_case([1] * a.seqs, lens, 4, 1, 256, 16, getattr(torch, a.dtype), seed=0,
                                device="cpu")
    for win in (None, 512):
        p = LayerAttnParams(256 ** -0.5, win)
        ref = ms_per_call(lambda: paged_attention_ref(q, kc, vc, meta, p), n=20, warm=3)
        new = ms_per_call(lambda: paged_decode(q, kc, vc, meta.block_table, meta.seq_lens, p), n=20, warm=3)
        print(f"window {win}: torch backend {ref:.2f} ms, C++ kernel {new:.2f} ms ({ref / new:.1f}x)")


if __name__ == "__main__":
    main()
