"""A tensor-parallel rank other than 0: its own process, its shard, its KV pool, no scheduler.

Start-up runs in lockstep with rank 0 (start_up's profile steps and CUDA-graph captures issue
the same collectives in the same order on every rank). Then, per step, rank 0 broadcasts the
step (`encode_step`) and every rank runs the same forward: the collectives inside line up
because every rank takes the same branch (`run_step`). Sampling happens on rank 0 only.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
from typing import Any

import torch

from flatserve.distributed import disable_multicast
from flatserve.engine.scheduler import ScheduledRequest, SchedulerOutput

log = logging.getLogger("flatserve")

# One scheduled request on the wire: (request id, start_pos, num_tokens, new token ids,
# block ids, samples). The ids are host-known (no async scheduling, no drafts under TP).
Wire = tuple[str, int, int, list[int], list[int], bool, int]


def encode_step(out: SchedulerOutput) -> list[Wire]:
    return [(s.request.request_id, s.start_pos, s.num_tokens, s.new_token_ids, s.block_ids,
             s.samples, s.request.num_prompt_tokens) for s in out.scheduled]


class _WireRequest:
    """What build_flat_batch reads of a request."""
    __slots__ = ("request_id", "num_prompt_tokens")
    num_pending = 0

    def __init__(self, rid: str, num_prompt_tokens: int) -> None:
        self.request_id, self.num_prompt_tokens = rid, num_prompt_tokens


class _WiredScheduled(ScheduledRequest):
    """A ScheduledRequest whose token ids and `samples` came over the wire, not from a Request."""
    __slots__ = ("wired_ids", "wired_samples")

    @property  # type: ignore[override]
    def new_token_ids(self) -> list[int]:
        return self.wired_ids

    @property  # type: ignore[override]
    def samples(self) -> bool:
        return self.wired_samples


def decode_step(wire: list[Wire]) -> SchedulerOutput:
    out = SchedulerOutput()
    for rid, start, n, ids, blocks, samples, prompt_len in wire:
        s = _WiredScheduled(_WireRequest(rid, prompt_len), start, n, blocks)  # type: ignore[arg-type]
        s.wired_ids, s.wired_samples = ids, samples
        out.scheduled.append(s)
    return out


def run_step(runner: Any, wire: list[Wire], block_size: int, device: torch.device) -> None:
    """The forward rank 0's `ModelRunner.launch` runs for this step, minus the sampler."""
    from flatserve.runner import build_flat_batch

    batch = build_flat_batch(decode_step(wire), block_size, device)
    if batch.groups:
        runner.forward_logits(batch)
    else:
        runner.forward_hidden(batch)


def pin_cpu_threads(local_rank: int, local_size: int, pin: bool) -> int:
    """CPU ranks split the host's cores into groups, one per rank (2 ranks on 2 cores: 1 each);
    `pin` also binds the process to its group. -> the previous torch thread count."""
    prev = torch.get_num_threads()
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    k = max(1, len(cores) // local_size) if cores else max(1, prev // local_size)
    mine = cores[local_rank * k:(local_rank + 1) * k] if cores else []
    if pin and mine:
        os.sched_setaffinity(0, mine)
    torch.set_num_threads(len(mine) or k)
    return prev


def _exit_with_parent(conn: Any) -> None:
    """The parent holds the pipe's other end: EOF means it is gone (even by SIGKILL)."""
    def watch() -> None:
        try:
            conn.recv()
        except (EOFError, OSError):
            pass
        os._exit(1)

    threading.Thread(target=watch, name="flatserve-parent-watch", daemon=True).start()


def worker_main(cfg: Any, rank: int, port: int, device: str, conn: Any) -> None:
    """Entry point of a spawned rank (torch.multiprocessing 'spawn')."""
    disable_multicast()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the parent, which stops us
    logging.basicConfig(level=logging.INFO, format=f"[rank {rank}] %(message)s")
    _exit_with_parent(conn)
    from flatserve.distributed.group import Topology, TPGroup, open_store
    from flatserve.engine.startup import start_up

    topo = Topology.of(cfg, port)
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    else:
        pin_cpu_threads(rank - topo.node_rank * topo.local_size, topo.local_size, pin=True)
    try:
        group = TPGroup(rank, topo, open_store(rank, topo), dev)
        _, _, runner, _ = start_up(cfg, group)
        while True:
            wire = group.broadcast_obj()
            if wire is None:  # rank 0 shuts down: close the groups with it (TPGroup.close_data)
                group.shutdown()
                break
            run_step(runner, wire, cfg.block_size, dev)  # type: ignore[arg-type]
    except BaseException as e:  # noqa: BLE001 - a rank reports why it stops, then exits
        log.error("flatserve: tensor-parallel rank %d stopped: %s: %s", rank, type(e).__name__, e)
        os._exit(1)
    os._exit(0)
