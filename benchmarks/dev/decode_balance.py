"""Is decode 64 x 2,048 short of bandwidth because 512 equal programs cannot be spread evenly over
the SMs? If so, the time tracks the largest per-SM load, not the total: 62, 64 and 66 sequences
(496 / 512 / 528 programs at 4 per SM on 132 SMs) would take about the same time. Also the same
batch split into 2 and 4 KV segments (with the merge pass).

    PYTHONPATH=. python3 benchmarks/dev/decode_balance.py [--seqs 56,60,62,64,66,68,72] [--rounds 5]
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch
import triton

sys.path.insert(0, ".")  # the repo root, as the other scripts here
from benchmarks.common import BS, D, DT, rotated_run  # noqa: E402
from flatserve.attention.base import LayerAttnParams  # noqa: E402
from tests.attention.cases import make_case  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seqs", default="56,60,62,64,66,68,72")
    ap.add_argument("--ctx", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    p = LayerAttnParams(D ** -0.5)
    runs = [(int(n), 0) for n in a.seqs.split(",")] + [(64, 2), (64, 4)]
    sets = {n: [make_case([1] * n, [a.ctx] * n, 32, 8, D, BS, DT) for _ in range(4)] for n, _ in runs}
    times: dict[tuple[int, int], list[float]] = {r: [] for r in runs}
    for _ in range(a.rounds):  # interleaved: drift falls on every variant alike
        for n, seg in runs:
            run = rotated_run(sets[n], p, segments=seg or None)
            times[(n, seg)].append(triton.testing.do_bench(run, warmup=50, rep=300, return_mode="median") * 1e3)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    print(f"{torch.cuda.get_device_name(0)}, {sms} SMs, ctx {a.ctx}")
    for (n, seg), t in times.items():
        med = statistics.median(t)
        kv = n * a.ctx * 8 * D * 2 * 2
        print(f"seqs {n:3d} programs {n * 8 * max(seg, 1):5d} segments {seg or 'auto'}: {med:7.1f} us  "
              f"{kv / med / 1e6:.2f} TB/s  per-seq {med / n:.3f} us  {[round(x, 1) for x in t]}")


if __name__ == "__main__":
    main()
