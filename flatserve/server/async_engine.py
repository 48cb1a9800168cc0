"""The step loop on its own thread; one asyncio queue of outputs per request.

Only the engine thread touches the Engine. HTTP handlers submit commands through a queue and
read `RequestOutput` snapshots (cumulative) from their own stream.
"""
from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from flatserve.engine.engine import Engine
from flatserve.engine.outputs import RequestOutput, RequestOutputKind
from flatserve.engine.sampling_params import SamplingParams
from flatserve.server.metrics import Metrics

log = logging.getLogger("flatserve")


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    start: float = field(default_factory=time.perf_counter)
    last: float = 0.0
    tokens: int = 0
    delta: bool = False  # the request's outputs carry only what is new


class AsyncEngine:
    """Builds the Engine on the thread that will step it, and returns once it is built.

    Why the same thread: torch's CPU ops run on libgomp, which gives every thread that enters a
    parallel region its own worker team. A second team (engine built on the main thread, stepped
    on another) makes libgomp count more threads than cores and stop spin-waiting between
    parallel regions: CPU decode throughput halved (122 -> 50 tok/s, 16 requests, default model,
    this 2-core box). One thread owns every torch op of the process.
    """

    engine: Engine  # set on the engine thread before __init__ returns

    def __init__(self, build: Callable[[], Engine], metrics: Metrics, name: str = "") -> None:
        self.metrics, self.name = metrics, name  # name: request-id prefix (data-parallel replicas)
        self._cmds: queue.Queue = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._ids = itertools.count()
        self._stop = threading.Event()
        self._go = threading.Event()
        self._built = threading.Event()
        self._build_error: BaseException | None = None
        self.error: BaseException | None = None
        # Called on the engine thread once the engine has stopped on an error (the server then
        # exits non-zero so that a supervisor restarts it).
        self.on_fatal: Callable[[BaseException], None] | None = None
        self.closed = False
        self._thread = threading.Thread(target=self._main, args=(build,), name="flatserve-engine",
                                        daemon=True)
        self._thread.start()
        self._built.wait()
        if self._build_error is not None:
            raise self._build_error

    def start(self) -> None:
        self._go.set()

    def _main(self, build: Callable[[], Engine]) -> None:
        try:
            self.engine = build()
        except BaseException as e:  # start-up refusal (BudgetError, bad model): the caller raises it
            self._build_error = e
            return
        finally:
            self._built.set()
        self._go.wait()
        self._loop()

    # ---------------------------------------------------------------- handler side
    @property
    def num_in_flight(self) -> int:
        """Requests with a live stream (submitted, not yet finished or aborted)."""
        return len(self._streams)

    async def submit(self, prompt_ids: list[int], params: SamplingParams) -> tuple[str, asyncio.Queue]:
        if self.error is not None:
            raise EngineStopped(self.error)
        if self.closed:
            raise Unavailable("the server is shutting down and takes no new requests")
        rid = f"req-{self.name}{next(self._ids)}"
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        q: asyncio.Queue = asyncio.Queue()
        delta = params.output_kind is RequestOutputKind.DELTA
        self._cmds.put(("add", rid, prompt_ids, params, _Stream(loop, q, delta=delta), fut))
        while not fut.done():  # an engine that stops between the check above and now: no hang
            await asyncio.wait({fut}, timeout=0.5)
            if self.error is not None and not fut.done():
                raise EngineStopped(self.error)
        fut.result()  # raises the engine's ValueError, if any
        return rid, q

    def abort(self, rid: str) -> None:
        self._cmds.put(("abort", rid))

    def abort_all(self) -> None:
        self._cmds.put(("abort_all",))

    def close(self) -> None:
        """Shutdown: refuse later submits, end every running request with "abort"."""
        self.closed = True
        self._cmds.put(("abort_all",))

    def shutdown(self) -> None:
        self._stop.set()
        self._go.set()
        self._cmds.put(("noop",))
        self._thread.join(timeout=10)
        if hasattr(self, "engine"):
            self.engine.shutdown()  # tensor-parallel ranks, if any

    # ---------------------------------------------------------------- engine thread
    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._drain(block=not self.engine.has_unfinished())
                if self.engine.has_unfinished():
                    outs = self.engine.step()
                    for out in outs:
                        self._deliver(out)
                    self.metrics.update(self.engine.stats())
        except BaseException as e:  # state unknown (device fault, OOM, a bug): stop for good
            log.exception("engine stopped")
            self.error = e
            self._fail_everything(EngineStopped(e))
            if self.on_fatal is not None:
                self.on_fatal(e)

    def _fail_everything(self, e: BaseException) -> None:
        """Every live stream and every queued submission gets `e` now: none waits on a dead loop."""
        for rid in list(self._streams):
            self._fail(rid, e)
        while True:
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "add":
                stream, fut = cmd[4], cmd[5]
                stream.loop.call_soon_threadsafe(_set_exc, fut, e)

    def _drain(self, block: bool) -> None:
        try:
            cmd = self._cmds.get(timeout=0.5) if block else self._cmds.get_nowait()
        except queue.Empty:
            return
        while True:
            self._apply(cmd)
            try:
                cmd = self._cmds.get_nowait()
            except queue.Empty:
                return

    def _apply(self, cmd: tuple) -> None:
        kind = cmd[0]
        if kind == "add":
            _, rid, ids, params, stream, fut = cmd
            try:
                self.engine.add_request(ids, params, rid)
            except ValueError as e:
                stream.loop.call_soon_threadsafe(_set_exc, fut, e)
                return
            self._streams[rid] = stream
            stream.loop.call_soon_threadsafe(_set_result, fut, rid)
        elif kind == "abort":
            self._abort(cmd[1])
        elif kind == "abort_all":
            for rid in list(self._streams):
                self._abort(rid)
        self.metrics.update(self.engine.stats())

    def _abort(self, rid: str) -> None:
        stream = self._streams.pop(rid, None)
        if not self.engine.abort(rid):
            return  # already finished
        self.metrics.aborted.inc()
        if stream is not None:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, None)  # None: aborted

    def _deliver(self, out: RequestOutput) -> None:
        stream = self._streams.get(out.request_id)
        if stream is None:
            return
        now = time.perf_counter()
        n = sum(len(c.token_ids) for c in out.outputs)  # new tokens (DELTA) or all so far
        if stream.delta:
            n += stream.tokens
        if n > stream.tokens:
            if stream.tokens == 0:
                self.metrics.ttft.observe(now - stream.start)
            else:
                self.metrics.itl.observe(now - stream.last)
            stream.tokens, stream.last = n, now
        if out.finished:
            self.metrics.e2e.observe(now - stream.start)
            del self._streams[out.request_id]
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, out)

    def _fail(self, rid: str, e: BaseException) -> None:
        stream = self._streams.pop(rid)
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, e)


class Unavailable(RuntimeError):
    """No request can be taken now (shutting down, or the engine has stopped): HTTP 503."""


class EngineStopped(Unavailable):
    """The engine thread has stopped on an error; the server answers 503 until it exits."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(f"the engine has stopped after an internal error "
                         f"({type(cause).__name__}: {cause}); the server is shutting down")


def _set_result(fut: asyncio.Future, v: object) -> None:
    if not fut.done():
        fut.set_result(v)


def _set_exc(fut: asyncio.Future, e: BaseException) -> None:
    if not fut.done():
        fut.set_exception(e)
