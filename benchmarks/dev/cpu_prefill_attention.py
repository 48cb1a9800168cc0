"""CPU prefill attention: the AMX prefill kernel (paged KV read in place) against the torch
backend's `attend_one` (per-sequence SDPA on that sequence's K/V already gathered, which the
backend also has to do first and this leaves untimed), same inputs, same run; ms per call, the
kernel's GFLOP/s over the visible (query, key) pairs, and each one's max error against float64.

    .venv/bin/python benchmarks/dev/cpu_prefill_attention.py

Shapes: Gemma 3 270M (4 q heads on 1 KV head, head 256; its local layers' 512 window and its
global layers) and Qwen3-0.6B (16 q heads on 8 KV heads, head 128); bf16; a whole prompt from
position 0 and a 512-token chunk continuing a context. Lengths 362 and 482 are among those where
torch's CPU flash kernel is several times slower per score than at 512.
"""
from __future__ import annotations

import sys

import torch

sys.path.insert(0, ".")
from benchmarks.common import ms_per_call, paged  # noqa: E402
from flatserve.attention import cpu_backend  # noqa: E402
from flatserve.attention.base import LayerAttnParams  # noqa: E402
from flatserve.attention.torch_backend import attend_one  # noqa: E402


def visible_pairs(n: int, ctx: int, win: int | None) -> int:
    return sum(min(ctx + i + 1, win or ctx + i + 1) for i in range(n))


def main() -> None:
    torch.manual_seed(0)
    cases = [  # name, Hq, Hkv, D, window, query rows, context before them
        ("gemma local, prompt 1006", 4, 1, 256, 512, 1006, 0),
        ("gemma local, prompt 1500", 4, 1, 256, 512, 1500, 0),
        ("gemma local, prompt 482", 4, 1, 256, 512, 482, 0),
        ("gemma local, 512 after 988", 4, 1, 256, 512, 512, 988),
        ("gemma global, prompt 362", 4, 1, 256, None, 362, 0),
        ("gemma global, prompt 1006", 4, 1, 256, None, 1006, 0),
        ("gemma global, prompt 2048", 4, 1, 256, None, 2048, 0),
        ("gemma global, 512 after 988", 4, 1, 256, None, 512, 988),
        ("qwen3-0.6b, prompt 1006", 16, 8, 128, None, 1006, 0),
        ("qwen3-0.6b, 512 after 988", 16, 8, 128, None, 512, 988),
    ]
    have_amx = cpu_backend.prefill_available()
    if not have_amx:
        print(f"AMX prefill kernel unavailable ({cpu_backend.prefill_kernel.error or 'no AMX bf16'}): "
              "SDPA column only")
    for name, hq, hkv, d, win, n, ctx in cases:
        p = LayerAttnParams(d ** -0.5, win)
        L = ctx + n
        q = torch.randn(n, hq, d, dtype=torch.bfloat16)
        k = torch.randn(L, hkv, d, dtype=torch.bfloat16)
        v = torch.randn_like(k)
        k_start = 0 if win is None else max(0, ctx - win + 1)
        ks, vs = k[k_start:], v[k_start:]  # what the backend gathers for SDPA
        ref = attend_one(q.double(), ks.double(), vs.double(), ctx, k_start, p)
        e_sdpa = (attend_one(q, ks, vs, ctx, k_start, p).double() - ref).abs().max().item()
        t_sdpa = ms_per_call(lambda: attend_one(q, ks, vs, ctx, k_start, p), n=5)
        line = f"{name:30s} SDPA {t_sdpa:6.2f} ms (err {e_sdpa:.1e})"
        if have_amx:
            kc, vc, table = paged(k, v)
            lens, cu = torch.tensor([L], dtype=torch.int32), torch.tensor([0, n], dtype=torch.int32)
            run = lambda: cpu_backend.paged_prefill(q, kc, vc, table, lens, cu, p)  # noqa: E731
            e_amx = (run().double() - ref).abs().max().item()
            t_amx = ms_per_call(run, n=5)
            gflops = 4 * hq * d * visible_pairs(n, ctx, win) / t_amx / 1e6
            line += (f", AMX {t_amx:6.2f} ms (err {e_amx:.1e}, {gflops:.0f} GFLOP/s), "
                     f"{t_sdpa / t_amx:.2f}x")
        print(line, flush=True)


if __name__ == "__main__":
    main()
