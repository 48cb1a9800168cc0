"""NCCL all-reduce on this machine's GPUs: time per call and bus bandwidth, at the sizes a
tensor-parallel decode step sends (one [rows, hidden] bf16 tensor after o_proj and after down_proj,
each layer) and at 1 GiB (the link's peak). Bus bandwidth = bytes x 2 (n - 1) / n / time (NCCL's
convention).

    PYTHONPATH=. python3 benchmarks/allreduce.py --gpus 2 --hidden 4096 --rows 64,256

Runtime (estimate, not timed): under a minute on 2 GPUs (process start and NCCL set-up dominate).
"""
from __future__ import annotations

import argparse
import json
import os
import time


def _rank(rank: int, a: argparse.Namespace, q) -> None:
    import torch
    import torch.distributed as dist

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{a.port}", rank=rank, world_size=a.gpus)
    rows = [int(r) for r in a.rows.split(",")]
    sizes = [(f"{r} x {a.hidden} bf16", r * a.hidden * 2) for r in rows] + [("1 GiB", 1 << 30)]
    out = {}
    for name, nbytes in sizes:
        x = torch.ones(nbytes // 2, dtype=torch.bfloat16, device="cuda")
        iters = 200 if nbytes < (64 << 20) else 20
        for _ in range(5):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        dist.barrier()
        t = time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        torch.cuda.synchronize()
        dt = (time.perf_counter() - t) / iters
        out[name] = {"bytes": nbytes, "us": dt * 1e6,
                     "bus_GBps": nbytes * 2 * (a.gpus - 1) / a.gpus / dt / 1e9}
    if rank == 0:
        q.put(out)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpus", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--rows", default="64,256")
    ap.add_argument("--port", type=int, default=29533)
    a = ap.parse_args()
    for k, v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"),
                 ("NVSHMEM_DISABLE_NVLS", "1")):
        os.environ[k] = v  # NVLink multicast stays off on shared hosts
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, a, q)) for r in range(a.gpus)]
    [p.start() for p in procs]
    res = q.get(timeout=300)
    [p.join() for p in procs]
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
