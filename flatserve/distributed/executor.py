"""Rank 0's side of tensor parallelism: it runs in the engine's process (scheduler, KV manager
and sampler stay there, once), spawns this host's other ranks, and watches them.

Faults: a worker that exits while the engine runs is seen at once (its process sentinel); the
executor names it, stops the other workers and calls `on_fatal` (the server stops itself).
Rank 0's own collective then fails as the dead peer's sockets close, so the step raises instead
of hanging. Workers exit when rank 0's process goes away, even by SIGKILL (a pipe reaches EOF).
"""
from __future__ import annotations

import dataclasses
import logging
import multiprocessing.connection
import threading
from typing import Any, Callable

import torch

from flatserve import device as dev
from flatserve.config import EngineConfig
from flatserve.distributed import disable_multicast
from flatserve.distributed.group import Topology, TPGroup, open_store
from flatserve.distributed.worker import encode_step, pin_cpu_threads, worker_main

log = logging.getLogger("flatserve")


def rank_device(cfg: EngineConfig, rank: int, topo: Topology) -> torch.device:
    """CUDA: one device per local rank, counted from the configured one; CPU: the CPU."""
    base = dev.select_device(cfg.device)
    if base.type == "cpu":
        return base
    if base.type != "cuda":
        raise ValueError(f"tensor parallelism runs on CUDA (NCCL) or the CPU (gloo), not {base.type}")
    return torch.device("cuda", (base.index or 0) + rank - topo.node_rank * topo.local_size)


class Workers:
    """This host's spawned ranks, their parent pipes and the watchdog."""

    def __init__(self, cfg: EngineConfig, topo: Topology, ranks: list[int]) -> None:
        disable_multicast()
        ctx = torch.multiprocessing.get_context("spawn")
        self.procs: list[tuple[int, Any, Any]] = []
        self.closing = False
        self.failed: str | None = None
        self.on_fatal: Callable[[str], None] | None = None
        for r in ranks:
            parent, child = ctx.Pipe()
            p = ctx.Process(target=worker_main, name=f"flatserve-rank{r}", daemon=True,
                            args=(cfg, r, topo.master_port, str(rank_device(cfg, r, topo)), child))
            p.start()
            child.close()
            self.procs.append((r, p, parent))
        self._watch = threading.Thread(target=self._watchdog, name="flatserve-tp-watch", daemon=True)
        self._watch.start()

    def _watchdog(self) -> None:
        by_sentinel = {p.sentinel: (r, p) for r, p, _ in self.procs}
        if not by_sentinel:
            return
        ready = multiprocessing.connection.wait(list(by_sentinel))
        if self.closing:
            return
        r, p = by_sentinel[ready[0]]
        p.join(1.0)
        self.failed = (f"tensor-parallel rank {r} (pid {p.pid}) exited with code {p.exitcode}; "
                       f"stopping every rank")
        log.error("flatserve: error: %s", self.failed)
        self.stop(timeout=0.0)
        if self.on_fatal is not None:
            self.on_fatal(self.failed)

    def wait(self) -> int:
        """Headless node: block until every local rank exits; -> the first nonzero exit code."""
        for _, p, _ in self.procs:
            p.join()
        return next((p.exitcode for _, p, _ in self.procs if p.exitcode), 0)

    def stop(self, timeout: float = 10.0) -> None:
        """Wait up to `timeout` for clean exits, then SIGTERM, then SIGKILL: no orphans."""
        self.closing = True
        for _, p, _ in self.procs:
            p.join(timeout)
        for _, p, _ in self.procs:
            if p.is_alive():
                p.terminate()
        for _, p, conn in self.procs:
            p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join(1.0)
            conn.close()


class TPExecutor:
    """Starts the group (rank 0 here, the others spawned) and the engine's rank-0 start-up."""

    def __init__(self, cfg: EngineConfig) -> None:
        from flatserve.engine.startup import start_up

        topo = Topology.of(cfg)
        if cfg.node_rank != 0:
            raise ValueError("the engine runs on node 0; other nodes run `flatserve serve` with "
                             "their --node-rank, which starts only their ranks")
        store = open_store(0, topo)
        topo = dataclasses.replace(topo, master_port=store.port)  # port 0: the one picked
        device = rank_device(cfg, 0, topo)
        self._threads = None
        if device.type == "cuda":
            torch.cuda.set_device(device)
        else:
            self._threads = pin_cpu_threads(0, topo.local_size, pin=False)
        self.workers = Workers(cfg, topo, list(topo.local_ranks)[1:])
        try:
            self.group = TPGroup(0, topo, store, device, failed=lambda: self.workers.failed)
            self.state, self.tokenizer, runner, _ = start_up(cfg, self.group)
        except BaseException:
            self.workers.stop(timeout=0.0)
            raise
        self.runner = TPRunner(runner, self)
        self._stopped = False

    def fatal(self, msg: str) -> None:
        if self.workers.failed is None:
            self.workers.failed = msg
            log.error("flatserve: error: %s", msg)
            self.workers.stop(timeout=0.0)
            if self.workers.on_fatal is not None:
                self.workers.on_fatal(msg)

    def shutdown(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self.workers.closing = True
        told = False
        if self.workers.failed is None:
            try:
                self.group.broadcast_obj(None)  # every rank leaves its loop and closes NCCL
                told = True
            except RuntimeError:
                pass  # a rank is already gone: stop() below ends the rest
        if told:
            self.group.close_data()  # with the other ranks: NCCL's teardown is collective
        self.workers.stop()
        if told and self.workers.failed is None:  # a dead peer's group has nothing to close cleanly
            self.group.shutdown()
        if self._threads is not None:
            torch.set_num_threads(self._threads)


class TPRunner:
    """Rank 0's runner: broadcasts each step, then runs rank 0's shard of it (and the sampler)
    through the ordinary ModelRunner. Only built when tensor_parallel_size > 1."""

    def __init__(self, inner: Any, executor: TPExecutor) -> None:
        self.inner, self.executor = inner, executor
        self.collect = inner.collect

    def launch(self, out: Any, sampler: Any, prev: Any = None, before_masks: Any = None) -> Any:
        if self.executor.workers.failed is not None:
            raise RuntimeError(self.executor.workers.failed)
        try:
            self.executor.group.broadcast_obj(encode_step(out))
            return self.inner.launch(out, sampler, prev, before_masks)
        except RuntimeError as e:  # a collective failed: some rank is gone
            self.executor.fatal(f"tensor-parallel step failed ({e}); stopping every rank")
            raise RuntimeError(self.executor.workers.failed) from e

    def execute(self, out: Any, sampler: Any) -> Any:
        return self.collect(self.launch(out, sampler))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)  # num_forward_tokens, graphs, model, ...


def run_node(cfg: EngineConfig) -> int:
    """A node other than 0 (`--node-rank k`): start this host's ranks and wait for them."""
    import signal

    topo = Topology.of(cfg)
    workers = Workers(cfg, topo, list(topo.local_ranks))
    workers.closing = True  # exits are reported through wait(), not the watchdog
    signal.signal(signal.SIGTERM, lambda *a: workers.stop(timeout=0.0))
    try:
        code = workers.wait()
    except KeyboardInterrupt:
        code = 130
    workers.stop(timeout=0.0)
    return code
