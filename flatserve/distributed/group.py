"""Rendezvous and the collectives a tensor-parallel group needs.

Every rank holds its own `TPGroup` (no process-wide singleton: two data-parallel replicas can
live in one process). It wraps torch.distributed's C++ process groups directly:
- `ctrl`: gloo over TCP, for the one pickled step message rank 0 broadcasts per step and for
  start-up agreements (the KV block count). Its timeout is effectively infinite because an idle
  server sends nothing for hours; a dead peer still surfaces at once (its sockets close).
- `data`: the tensor collectives of the forward (all-reduce after o/down, all-gather of the LM
  head's vocab shards): NCCL on CUDA, the same gloo group on the CPU.
"""
from __future__ import annotations

import datetime
import logging
import pickle
import socket
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

# First broadcast of a step message: fits a decode step of ~300 requests in one collective;
# longer messages (prompt chunks) follow in a second one.
_HEAD = 16384
_FOREVER = datetime.timedelta(days=365)
log = logging.getLogger("flatserve")


@dataclass(frozen=True, slots=True)
class Topology:
    """torchrun's vocabulary: `world_size` ranks over `nnodes` hosts, `world_size // nnodes` each;
    rank = node_rank * local_size + local_rank. The master (rank 0) hosts the TCPStore."""

    world_size: int
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str = "127.0.0.1"
    master_port: int = 0  # 0: rank 0 picks a free port (one host only)
    timeout_s: float = 300.0  # rendezvous: every rank must join within this

    @classmethod
    def of(cls, cfg: Any, port: int | None = None) -> Topology:
        """The topology an EngineConfig asks for, checked; `port` overrides its master_port."""
        t = cls(cfg.tensor_parallel_size, cfg.nnodes, cfg.node_rank, cfg.master_addr,
                cfg.master_port if port is None else port, cfg.dist_timeout_s)
        t.validate()
        return t

    @property
    def local_size(self) -> int:
        return self.world_size // self.nnodes

    @property
    def local_ranks(self) -> range:
        return range(self.node_rank * self.local_size, (self.node_rank + 1) * self.local_size)

    def node_of(self, rank: int) -> int:
        return rank // self.local_size

    def validate(self) -> None:
        if self.world_size < 1 or self.nnodes < 1 or self.world_size % self.nnodes:
            raise ValueError(f"tensor_parallel_size ({self.world_size}) must be a positive multiple "
                             f"of nnodes ({self.nnodes})")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"node_rank must be in [0, {self.nnodes}), got {self.node_rank}")
        if self.nnodes > 1 and not self.master_port:
            raise ValueError("more than one node needs --master-addr and --master-port")


def open_store(rank: int, topo: Topology) -> dist.TCPStore:
    """Rank 0 hosts the store (port 0: a free one; read it from `.port`); others connect."""
    timeout = datetime.timedelta(seconds=topo.timeout_s)
    try:
        return dist.TCPStore(topo.master_addr, topo.master_port, topo.world_size, rank == 0,
                             timeout=timeout, wait_for_workers=False)
    except (RuntimeError, OSError) as e:
        where = f"{topo.master_addr}:{topo.master_port}"
        if rank == 0:
            raise ValueError(f"rank 0 cannot listen on {where} for the rendezvous: {e}") from None
        raise TimeoutError(f"rank {rank} cannot reach the rendezvous master at {where} within "
                           f"{topo.timeout_s:.0f} s (is node 0 running?): {e}") from None


def _wait_all(store: dist.TCPStore, rank: int, topo: Topology,
              failed: Callable[[], str | None] | None = None) -> None:
    """Every rank announces itself; wait for all, naming the missing ones on timeout. `failed`
    (rank 0: its workers' watchdog) ends the wait at once where a local rank already exited:
    a rank that died at start-up cost the full --dist-timeout (300 s) before."""
    store.set(f"joined/{rank}", f"{socket.gethostname()}:{rank}")
    keys = [f"joined/{r}" for r in range(topo.world_size)]
    deadline = time.monotonic() + topo.timeout_s
    while not store.check(keys):
        why = failed() if failed is not None else None
        if why:
            raise RuntimeError(why)
        if time.monotonic() > deadline:
            missing = [r for r in range(topo.world_size) if not store.check([f"joined/{r}"])]
            nodes = sorted({topo.node_of(r) for r in missing})
            raise TimeoutError(
                f"rendezvous at {topo.master_addr}:{topo.master_port} timed out after "
                f"{topo.timeout_s:.0f} s: rank(s) {missing} of {topo.world_size} never joined "
                f"(node(s) {nodes} of {topo.nnodes}; start them with the same --master-addr/"
                f"--master-port and their --node-rank)")
        time.sleep(0.05)


class TPGroup:
    """One rank's view of its tensor-parallel group."""

    def __init__(self, rank: int, topo: Topology, store: dist.TCPStore, device: torch.device,
                 failed: Callable[[], str | None] | None = None) -> None:
        self.rank, self.size, self.topo, self.device = rank, topo.world_size, topo, device
        self._store = store  # rank 0's store must outlive the groups
        _wait_all(store, rank, topo, failed)
        self.ctrl = dist.ProcessGroupGloo(dist.PrefixStore("ctrl", store), rank, self.size, _FOREVER)
        if device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts.is_high_priority_stream = False
            self.data = dist.ProcessGroupNCCL(dist.PrefixStore("data", store), rank, self.size, opts)
        else:
            self.data = self.ctrl

    # ------------------------------------------------------------------ forward collectives
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place; -> x."""
        self.data.allreduce([x]).wait()
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] per rank -> [..., size * n], rank order along the last dim."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.data.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=-1)

    # ------------------------------------------------------------------ control
    def broadcast_obj(self, obj: object = None) -> object:
        """Rank 0's `obj` on every rank (pickled over gloo: one collective when short)."""
        head = torch.zeros(_HEAD, dtype=torch.uint8)
        if self.rank == 0:
            buf = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
            n = len(buf)
            head[:8] = torch.tensor([n], dtype=torch.int64).view(torch.uint8)
            k = min(n, _HEAD - 8)
            head[8:8 + k] = torch.frombuffer(bytearray(buf[:k]), dtype=torch.uint8)
        self.ctrl.broadcast(head, 0).wait()
        n = int(head[:8].view(torch.int64)[0])
        if n <= _HEAD - 8:
            return pickle.loads(head[8:8 + n].numpy().tobytes()) if self.rank else obj
        rest = torch.empty(n - (_HEAD - 8), dtype=torch.uint8)
        if self.rank == 0:
            rest.copy_(torch.frombuffer(bytearray(buf[_HEAD - 8:]), dtype=torch.uint8))
        self.ctrl.broadcast(rest, 0).wait()
        if self.rank == 0:
            return obj
        return pickle.loads(head[8:].numpy().tobytes() + rest.numpy().tobytes())

    def min_int(self, v: int) -> int:
        t = torch.tensor([v], dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.ctrl.allreduce([t], opts).wait()
        return int(t[0])

    def close_data(self, timeout_s: float = 30.0) -> None:
        """Close NCCL's communicator (no-op on the CPU, where `data` is `ctrl`). NCCL's teardown is
        collective within a node (NVIDIA/nccl#863): a rank that closes it after its peers exited
        waits forever, as rank 0 did on 2 x H100 (2026-11-28). So every rank closes it at once,
        on rank 0's last broadcast, and a thread bounds the wait: a peer that never comes costs
        `timeout_s` and leaves the communicator open, not a hung exit."""
        if self.data is self.ctrl:
            return
        pg, self.data = self.data, self.ctrl
        t = threading.Thread(target=_close, args=(pg,), name="flatserve-nccl-close", daemon=True)
        t.start()
        t.join(timeout_s)
        if t.is_alive():
            log.warning("flatserve: NCCL communicator of rank %d not closed after %.0f s (a peer "
                        "did not close its own); left open", self.rank, timeout_s)

    def shutdown(self) -> None:
        """Close both groups: NCCL's with the peers (close_data), then gloo's (local)."""
        self.close_data()
        _close(self.ctrl)


def _close(pg: Any) -> None:
    try:
        pg.shutdown()
    except (RuntimeError, AttributeError):
        pass  # a peer already gone: nothing left to close cleanly
