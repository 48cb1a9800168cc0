"""The CPU decode kernel at a git revision against the working tree's, built side by side and
timed alternately in one process (this box drifts +-10% between runs; min of 15 x 10 calls).

    .venv/bin/python benchmarks/dev/cpu_decode_ab.py [--rev bb680e4] [--rows 4]

One Gemma-3-270M layer's shape (4 q heads, 1 KV head, head 256, block 16), 16 sequences with
contexts 10..1,500 + 64 (seeded), bf16; full attention and the 512 window. Prints ms per call.
--rows N: each sequence has a run of N query rows (a draft-verify step); a kernel without runs
(before 2026-11-22) gets them as N one-row decodes each, as the backend then passed them.
--layers N: N layers' own caches (~13 MB each), called in turn and timed per call as in an
engine step, so that the KV comes from DRAM (this VM's L3 kept one layer's cache: 13 MB read
back at ~50 GB/s, against ~27 GB/s from DRAM; benchmarks/cpu_floor.py --sweep).
--cold: as in an engine's decode step, each layer's call follows a read of 11 MB of other memory
(a layer's weights) and each pass over the layers one of 171 MB (the greedy LM head), so that
the KV arrives from DRAM, with the memory traffic around it, as a decode step sees it. Timed:
the attention calls alone; median and min over the rounds.
"""
from __future__ import annotations

import argparse
import random
import sys
import time

import torch

sys.path.insert(0, ".")
from benchmarks.common import ab_modules  # noqa: E402
from tests.attention.cases import make_case  # noqa: E402

SRC = "flatserve/attention/csrc/paged_decode_cpu.cpp"


def gemma_case(a: argparse.Namespace) -> tuple:
    """16 sequences, contexts 10..1,500 + 64 (seeded), a.rows query rows each, Gemma's shape;
    block tables sorted with --sequential; a.layers caches. -> (q, meta, caches)."""
    random.seed(0)
    lens = [random.randint(10, 1500) + 64 for _ in range(16)]
    q, kc, vc, meta = make_case([a.rows] * 16, lens, 4, 1, 256, 16, torch.bfloat16, seed=0, device="cpu")
    if a.sequential:  # timing only: the values read need not be the case's
        used = meta.block_table > 0
        meta.block_table[used] = torch.sort(meta.block_table[used]).values
    return q, meta, [(kc, vc)] + [(kc.clone(), vc.clone()) for _ in range(max(1, a.layers) - 1)]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rev", default="bb680e4")
    ap.add_argument("--rows", type=int, default=1)
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--sequential", action="store_true",
                    help="each sequence's blocks in ascending pool order, as the engine hands out "
                         "a prompt's blocks (the default scatters them: the hardware prefetcher "
                         "then cannot help)")
    ap.add_argument("--cold", action="store_true", help="other memory read between calls (above)")
    a = ap.parse_args()
    if a.cold:
        return cold(a)
    mods = ab_modules(SRC, a.rev, "flatserve_decode_ab", "flatserve_paged_decode_cpu")
    n = a.rows
    q, meta, caches = gemma_case(a)
    kc, vc = caches[0]
    # The same rows as one-row decodes: row j of a run sees lens - n + j + 1 keys.
    seq_of = torch.arange(16).repeat_interleave(n)
    row_table = meta.block_table[seq_of].contiguous()
    row_lens = (meta.seq_lens[seq_of] - n + torch.arange(n).repeat(16) + 1).to(torch.int32)
    def has_runs(m) -> bool:  # the signature, found once (pybind's TypeError prints every argument)
        try:
            m.paged_decode(q[:1], kc, vc, meta.block_table[:1], meta.seq_lens[:1],
                           torch.tensor([0, 1], dtype=torch.int32), 1.0, 0, 0.0, torch.empty(0))
            return True
        except TypeError:
            return False

    runs = {name: has_runs(m) for name, m in mods.items()}
    for win in (0, 512):
        best = {k: 1e9 for k in mods}
        for _ in range(15):
            for name, m in mods.items():
                def f(kc: torch.Tensor, vc: torch.Tensor) -> None:
                    if runs[name]:  # (..., seq_lens, cu_seqlens_q, scale, ...)
                        m.paged_decode(q, kc, vc, meta.block_table, meta.seq_lens, meta.cu_seqlens_q,
                                       256 ** -0.5, win, 0.0, torch.empty(0))
                    else:  # one row per sequence only
                        m.paged_decode(q, kc, vc, row_table, row_lens, 256 ** -0.5, win, 0.0, torch.empty(0))
                f(*caches[0])
                reps = max(10, a.layers)
                t = time.perf_counter()
                for i in range(reps):
                    f(*caches[i % a.layers])
                best[name] = min(best[name], (time.perf_counter() - t) / reps * 1e3)
        print(f"rows {n}, window {win or None}, {a.layers} layer(s): "
              + ", ".join(f"{k} {v:.3f} ms" for k, v in best.items()), flush=True)

def cold(a: argparse.Namespace) -> None:
    """The --cold timing: per round, each kernel runs the layers in turn, each call after an 11 MB
    read, then a 171 MB read; the kernels alternate which goes first."""
    import statistics

    mods = ab_modules(SRC, a.rev, "flatserve_decode_ab", "flatserve_paged_decode_cpu")
    q, meta, caches = gemma_case(a)
    layers = len(caches)
    weights = [torch.ones(11 * 2**20 // 4) for _ in range(layers)]
    head = torch.ones(171 * 2**20 // 4)
    cu = meta.cu_seqlens_q if a.rows > 1 else torch.empty(0, dtype=torch.int32)
    names = list(mods)
    for win in (0, 512):
        times: dict[str, list[float]] = {k: [] for k in mods}
        for r in range(15):
            for name in names if r % 2 == 0 else names[::-1]:
                total = 0.0
                for (k_, v_), w in zip(caches, weights):
                    w.sum()
                    t = time.perf_counter()
                    mods[name].paged_decode(q, k_, v_, meta.block_table, meta.seq_lens, cu,
                                            256 ** -0.5, win, 0.0, torch.empty(0))
                    total += time.perf_counter() - t
                head.sum()
                times[name].append(total)
        print(f"rows {a.rows}, window {win or None}, {layers} layer(s), cold: " + ", ".join(
            f"{k} median {statistics.median(v) * 1e3:.3f} ms (min {min(v) * 1e3:.3f})"
            for k, v in times.items()) + " per pass", flush=True)


if __name__ == "__main__":
    main()
