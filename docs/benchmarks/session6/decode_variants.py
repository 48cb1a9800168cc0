"""Decode-kernel variants interleaved in one process, on the device (the #6 decode goal).

    git apply docs/benchmarks/session6/decode_variants.patch  # the two switches, reconstructed
    PYTHONPATH=. python3 docs/benchmarks/session6/decode_variants.py [--case "decode 64 x 2048"] [--rounds 5]
        [--variants ",bt_ahead,knat,bt_ahead+knat"]

Each round times every variant once (triton do_bench median over L2-rotated input sets, as
benchmarks/attention_kernels.py does), so drift between calls falls on all variants alike;
prints per-variant medians over rounds and the kernel's registers and shared memory.
"""
from __future__ import annotations

import argparse
import json
import statistics

import torch
import triton

from benchmarks.attention_kernels import BS, CASES, D, DT
from flatserve.attention.base import LayerAttnParams
from flatserve.attention.kernels import unified_attention as ua
from tests.attention.cases import make_case


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--case", default="decode 64 x 2048")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--variants", default=",bt_ahead,knat,bt_ahead+knat")
    a = ap.parse_args()
    name, q_lens, seq_lens, hq, hkv = next(c for c in CASES if c[0] == a.case)
    sets = [make_case(q_lens, seq_lens, hq, hkv, D, BS, DT) for _ in range(4)]
    p = LayerAttnParams(D ** -0.5)
    outs = [torch.empty_like(s[0]) for s in sets]
    variants = a.variants.split(",")
    i = [0]

    def run() -> None:
        k = i[0] = (i[0] + 1) % 4
        q, kc, vc, meta = sets[k]
        ua.unified_attention(q, kc, vc, meta, p, out=outs[k])

    ref = None
    times: dict[str, list[float]] = {v: [] for v in variants}
    for _ in range(a.rounds):
        for v in variants:
            ua.DECODE_VARIANT = frozenset(filter(None, v.split("+")))
            q, kc, vc, meta = sets[0]
            out = ua.unified_attention(q, kc, vc, meta, p).float()
            ref = out if ref is None else ref
            assert (out - ref).abs().max().item() < 2e-2, f"variant {v!r} disagrees"
            times[v].append(triton.testing.do_bench(run, warmup=50, rep=300, return_mode="median") * 1e3)
    kv_bytes = sum(seq_lens) * hkv * D * 2 * 2
    rows = {v or "base": {"us": statistics.median(t), "all_us": [round(x, 1) for x in t],
                          "kv_TBps": kv_bytes / statistics.median(t) / 1e6} for v, t in times.items()}
    try:  # registers / shared memory of the compiled variants (triton's cache layout)
        for dev_cache in ua._attn_kernel.device_caches.values():
            for kern in dev_cache[0].values():
                print("compiled: regs", kern.n_regs, "shared", kern.metadata.shared)
    except Exception as e:  # noqa: BLE001 - informative only
        print("no kernel info:", e)
    print(json.dumps({"case": name, "gpu": torch.cuda.get_device_name(), "variants": rows}, indent=1))


if __name__ == "__main__":
    main()
