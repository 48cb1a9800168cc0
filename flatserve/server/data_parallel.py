"""Data parallelism behind one server: N engine replicas, each on its own thread and device (or
its own set of tensor-parallel ranks), and a router that sends each request to the least loaded.

Load = (requests the replica holds, KV blocks in use / usable): queue length first, KV usage to
break ties, so a replica busy with long contexts gets the next short one last. Only the server
uses this; one replica (the default) is a plain AsyncEngine, with no router in between.
"""
from __future__ import annotations

import asyncio
import dataclasses
import threading
from typing import Any, Callable

from flatserve.config import EngineConfig
from flatserve.engine.engine import Engine
from flatserve.engine.sampling_params import SamplingParams
from flatserve.server.async_engine import AsyncEngine
from flatserve.server.metrics import Metrics


def replica_config(cfg: EngineConfig, i: int) -> EngineConfig:
    """Replica i: on CUDA the devices from i * tensor_parallel_size on; on the CPU the CPU."""
    if cfg.data_parallel_size == 1:
        return cfg
    dev = cfg.device
    if dev.startswith("cuda") or dev == "auto":
        import torch

        if torch.cuda.is_available():
            base = int(dev.split(":")[1]) if ":" in dev else 0
            dev = f"cuda:{base + i * cfg.tensor_parallel_size}"
    return dataclasses.replace(cfg, device=dev, data_parallel_size=1)


class _ReplicaMetrics:
    """One replica's view of the shared metrics: latencies observed as they come, the gauges
    and counters from the sum over replicas."""

    def __init__(self, shared: Metrics, router: DataParallelEngine, i: int) -> None:
        self.shared, self.router, self.i = shared, router, i

    def __getattr__(self, name: str) -> Any:  # histograms and counters: the shared ones
        return getattr(self.shared, name)

    def update(self, stats: dict[str, int]) -> None:
        self.router.stats[self.i] = stats
        with self.router.lock:
            total = {k: sum(s[k] for s in self.router.stats if s) for k in stats}
            self.shared.update(total)


class DataParallelEngine:
    """AsyncEngine's interface over N replicas."""

    def __init__(self, cfg: EngineConfig, metrics: Metrics) -> None:
        from flatserve.attention.metadata import per_thread_scopes

        per_thread_scopes()  # the replicas' engine threads run forwards at the same time
        n = cfg.data_parallel_size
        self.lock = threading.Lock()
        self.stats: list[dict[str, int] | None] = [None] * n
        self.replicas: list[AsyncEngine] = []
        self.owner: dict[str, int] = {}  # request id -> replica
        self.held = [0] * n  # requests submitted and not yet finished or aborted
        try:
            for i in range(n):
                rcfg = replica_config(cfg, i)
                self.replicas.append(AsyncEngine(lambda c=rcfg: Engine(c),  # type: ignore[misc]
                                                 _ReplicaMetrics(metrics, self, i),  # type: ignore[arg-type]
                                                 name=f"dp{i}-"))
        except BaseException:
            self.shutdown()
            raise
        self.engine = self.replicas[0].engine  # tokenizer, model state: the same in every replica

    @property
    def error(self) -> BaseException | None:
        return next((r.error for r in self.replicas if r.error is not None), None)

    @property
    def num_in_flight(self) -> int:
        return sum(r.num_in_flight for r in self.replicas)

    @property
    def on_fatal(self) -> Callable[[BaseException], None] | None:
        return self.replicas[0].on_fatal

    @on_fatal.setter
    def on_fatal(self, fn: Callable[[BaseException], None] | None) -> None:
        for r in self.replicas:  # any replica that stops on an error stops the server
            r.on_fatal = fn

    def close(self) -> None:
        for r in self.replicas:
            r.close()

    def start(self) -> None:
        for r in self.replicas:
            r.start()

    def pick(self) -> int:
        def load(i: int) -> tuple[int, float]:
            s = self.stats[i] or {}
            kv = s.get("kv_blocks_used", 0) / max(1, s.get("kv_blocks_total", 1))
            return self.held[i], kv

        return min(range(len(self.replicas)), key=load)

    async def submit(self, prompt_ids: list[int], params: SamplingParams) -> tuple[str, asyncio.Queue]:
        i = self.pick()
        self.held[i] += 1
        try:
            rid, q = await self.replicas[i].submit(prompt_ids, params)
        except BaseException:
            self.held[i] -= 1
            raise
        self.owner[rid] = i
        return rid, _Release(q, self, rid)  # type: ignore[return-value]

    def release(self, rid: str) -> None:
        i = self.owner.pop(rid, None)
        if i is not None:
            self.held[i] -= 1

    def abort(self, rid: str) -> None:
        i = self.owner.get(rid)
        if i is not None:
            self.replicas[i].abort(rid)
            self.release(rid)

    def abort_all(self) -> None:
        for r in self.replicas:
            r.abort_all()

    def shutdown(self) -> None:
        for r in self.replicas:
            r.shutdown()

    def engines(self) -> list[Engine]:
        return [r.engine for r in self.replicas]


class _Release:
    """The request's output queue; the router's count drops when the last output is read."""

    def __init__(self, q: asyncio.Queue, router: DataParallelEngine, rid: str) -> None:
        self.q, self.router, self.rid = q, router, rid

    async def get(self) -> Any:
        out = await self.q.get()
        if out is None or isinstance(out, BaseException) or getattr(out, "finished", False):
            self.router.release(self.rid)
        return out

    def __getattr__(self, name: str) -> Any:
        return getattr(self.q, name)
