"""Decode tile configs interleaved in one process on the GPU (BLOCK_M,TILE,warps,stages[,maxnreg[,direct]]), so
drift between calls falls on every config alike; median over rounds of do_bench medians over
the 4 L2-rotated input sets of benchmarks/attention_kernels.py.

    PYTHONPATH=. python3 benchmarks/dev/decode_cfg_ab.py [--cfgs "16,64,4,2 16,64,2,2"] [--rounds 5]
        [--cases "decode 64 x 2048,decode 256 x 1024,decode 8 x 8192"]
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
import triton

sys.path.insert(0, ".")  # the repo root, as the other scripts here
from benchmarks.common import BS, CASES, D, DT, rotated_run  # noqa: E402
from flatserve.attention.base import LayerAttnParams  # noqa: E402
from flatserve.attention.kernels import unified_attention as ua  # noqa: E402
from tests.attention.cases import make_case  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cfgs", default="16,64,4,2 16,64,2,2 16,64,2,3")
    ap.add_argument("--cases", default="decode 64 x 2048,decode 256 x 1024,decode 8 x 8192")
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    cfgs = [tuple(int(x) for x in c.split(",")) for c in a.cfgs.split()]
    p = LayerAttnParams(D ** -0.5)
    report = []
    for case in a.cases.split(","):
        name, q_lens, seq_lens, hq, hkv = next(c for c in CASES if c[0] == case)
        sets = [make_case(q_lens, seq_lens, hq, hkv, D, BS, DT) for _ in range(4)]
        run = rotated_run(sets, p)

        times: dict[tuple, list[float]] = {c: [] for c in cfgs}
        ref = None
        for _ in range(a.rounds):
            for c in cfgs:
                ua.DECODE_CFG, ua.DECODE_MAXNREG = c[:4], (c[4] if len(c) > 4 else 0)
                if len(c) > 5:  # only with a decode_direct patch applied (git history of docs/benchmarks/)
                    ua.DECODE_DIRECT = c[5] == 1
                q, kc, vc, meta = sets[0]
                out = ua.unified_attention(q, kc, vc, meta, p).float()
                ref = out if ref is None else ref
                assert (out - ref).abs().max().item() < 2e-2, f"config {c} disagrees"
                times[c].append(triton.testing.do_bench(run, warmup=50, rep=300, return_mode="median") * 1e3)
        kv = sum(seq_lens) * hkv * D * 2 * 2
        for c, t in times.items():
            med = statistics.median(t)
            report.append({"case": name, "cfg": c, "us": med, "all_us": [round(x, 1) for x in t],
                           "kv_TBps": kv / med / 1e6})
            print(f"{name:24s} {c}  {med:7.1f} us  {kv / med / 1e6:.2f} TB/s  {[round(x, 1) for x in t]}",
                  flush=True)
    try:  # registers and shared memory of each compiled decode kernel (triton's cache layout)
        for dev_cache in ua._attn_kernel.device_caches.values():
            for kern in dev_cache[0].values():
                print("compiled: warps", kern.metadata.num_warps, "stages", kern.metadata.num_stages,
                      "regs", kern.n_regs, "spills", kern.n_spills, "shared", kern.metadata.shared)
    except Exception as e:  # noqa: BLE001 - informative only
        print("no kernel info:", e)
    print(json.dumps({"gpu": torch.cuda.get_device_name(), "rows": report}))


if __name__ == "__main__":
    main()
