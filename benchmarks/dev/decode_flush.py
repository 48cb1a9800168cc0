"""How much of a decode case's time is triton's L2 flush rather than the kernel: the same calls
timed three ways in one process.

- `do_bench`: triton.testing.do_bench, which zeroes a 256 MB buffer before every call (the
  harness of benchmarks/attention_kernels.py). The memset leaves the L2 full of dirty lines that
  the timed kernel must write back to HBM before its own reads can use the space.
- `events`: CUDA events around each call, back to back, no memset. Inputs rotate over 4 sets of
  at least 268 MB each, far past the 50-60 MB L2, so every call still reads its KV from HBM.
- `events+flush`: the same with the 256 MB memset before each call, outside the events (what
  do_bench does), as a check that the two harnesses agree.
- `events+spin`: a GPU spin (no memory traffic) before each call instead: the host queues the
  call during the spin, so host launch time cannot fall between the events either
  (benchmarks/common.py's gpu_ms, the timer of benchmarks/attention_kernels.py since 2026-11-19).

    PYTHONPATH=. python3 benchmarks/dev/decode_flush.py [--cases "decode 64 x 2048,..."] [--reps 300]
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch
import triton

sys.path.insert(0, ".")  # the repo root, as the other scripts here
from benchmarks.common import BS, CASES, D, DT, gpu_ms, rotated_run  # noqa: E402
from flatserve.attention.base import LayerAttnParams  # noqa: E402
from tests.attention.cases import make_case  # noqa: E402


def events(fn, reps: int, flush: torch.Tensor | None) -> float:
    """Median us of fn over reps calls, each between its own pair of CUDA events."""
    for _ in range(20):
        fn()
    pairs = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
             for _ in range(reps)]
    for a, b in pairs:
        if flush is not None:
            flush.zero_()
        a.record()
        fn()
        b.record()
    torch.cuda.synchronize()
    return statistics.median(a.elapsed_time(b) for a, b in pairs) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="decode 64 x 2048,decode 256 x 1024,decode 8 x 8192")
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args()
    p = LayerAttnParams(D ** -0.5)
    flush = torch.empty(256 * 2**20 // 4, dtype=torch.int32, device="cuda")
    print(torch.cuda.get_device_name(0))
    for case in a.cases.split(","):
        name, q_lens, seq_lens, hq, hkv = next(c for c in CASES if c[0] == case)
        sets = [make_case(q_lens, seq_lens, hq, hkv, D, BS, DT) for _ in range(4)]
        run = rotated_run(sets, p)

        kv = sum(seq_lens) * hkv * D * 2 * 2
        got: dict[str, list[float]] = {"do_bench": [], "events": [], "events+flush": [], "events+spin": []}
        for _ in range(a.rounds):  # interleaved rounds: drift falls on every harness alike
            got["do_bench"].append(triton.testing.do_bench(run, warmup=50, rep=300,
                                                           return_mode="median") * 1e3)
            got["events"].append(events(run, a.reps, None))
            got["events+flush"].append(events(run, a.reps, flush))
            got["events+spin"].append(gpu_ms(run, "events", reps=a.reps) * 1e3)
        print(f"{name}: " + "; ".join(
            f"{k} {statistics.median(v):.1f} us ({kv / statistics.median(v) / 1e6:.2f} TB/s) "
            f"{[round(x, 1) for x in v]}" for k, v in got.items()), flush=True)


if __name__ == "__main__":
    main()
