"""`flatserve bench serve`: drive any OpenAI-compatible server over streaming completions.

Metrics as `vllm bench serve` computes them: a request succeeds with no error and a non-empty
completion; TTFT is the first streamed token; TPOT = (E2E - TTFT) / (output tokens - 1) per
request; ITL is pooled over all gaps between streamed chunks; throughput = tokens / wall.
"""
from __future__ import annotations

import asyncio
import json
import statistics
import threading
import time
from dataclasses import asdict, dataclass, field
from collections.abc import Callable
from typing import Any

import httpx

from flatserve.bench.datasets import Item


@dataclass(slots=True)
class Record:
    ok: bool = False
    error: str | None = None
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0  # from the server's usage when reported, else streamed chunks
    prompt_tokens: int = 0
    text_len: int = 0
    retries: int = 0  # connections the server dropped before answering (request re-sent)


def _body(item: Item, model: str, endpoint: str, ignore_eos: bool, extra: dict) -> dict:
    b: dict[str, Any] = {"model": model, "max_tokens": item.max_tokens, "stream": True,
                         "temperature": 0.0, "stream_options": {"include_usage": True}, **extra}
    if ignore_eos:
        b["ignore_eos"] = True
    if endpoint.endswith("chat/completions"):
        b["messages"] = [{"role": "user", "content": item.prompt}]
    else:
        b["prompt"] = item.prompt
    return b


async def one_request(client: httpx.AsyncClient, url: str, body: dict, headers: dict) -> Record:
    """Stream one completion. A connection the server closes before sending any response line
    (llama-server does this now and then on a fresh connection) is re-sent, at most twice, and
    counted in `retries`; the clock keeps running from the first attempt."""
    r = Record()
    t0 = time.perf_counter()
    for attempt in range(3):
        answered = await _stream(client, url, body, headers, r, t0)
        if answered or attempt == 2:
            break
        r.retries += 1
        r.error = None
    r.e2e = time.perf_counter() - t0
    r.ok = r.error is None and r.text_len > 0
    return r


async def _stream(client: httpx.AsyncClient, url: str, body: dict, headers: dict, r: Record,
                  t0: float) -> bool:
    """-> False only when the server hung up before its response headers (safe to re-send)."""
    last = t0
    chunks = 0
    answered = False
    try:
        async with client.stream("POST", url, json=body, headers=headers) as resp:
            answered = True
            if resp.status_code != 200:
                r.error = f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
                return True
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                msg = json.loads(line[6:])
                if "error" in msg:
                    r.error = str(msg["error"])[:200]
                    break
                if msg.get("usage"):
                    r.output_tokens = msg["usage"].get("completion_tokens", 0)
                    r.prompt_tokens = msg["usage"].get("prompt_tokens", 0)
                for ch in msg.get("choices") or []:
                    piece = ch.get("text") or (ch.get("delta") or {}).get("content") or ""
                    if piece:
                        now = time.perf_counter()
                        if r.ttft is None:
                            r.ttft = now - t0
                        else:
                            r.itl.append(now - last)
                        last = now
                        chunks += 1
                        r.text_len += len(piece)
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        r.error = f"{type(e).__name__}: {e}"[:200]
    r.output_tokens = r.output_tokens or chunks
    return answered


def _pct(xs: list[float], p: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


def summarize(records: list[Record], wall: float) -> dict[str, Any]:
    ok = [r for r in records if r.ok]
    ttft = [r.ttft for r in ok if r.ttft is not None]
    e2e = [r.e2e for r in ok if r.e2e is not None]
    tpot = [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok
            if r.output_tokens > 1 and r.ttft is not None and r.e2e is not None]
    itl = [x for r in ok for x in r.itl]
    out_tok = sum(r.output_tokens for r in ok)
    s: dict[str, Any] = {"requests": len(records), "success": len(ok), "failed": len(records) - len(ok),
                         "wall_s": wall, "output_tokens": out_tok,
                         "prompt_tokens": sum(r.prompt_tokens for r in ok),
                         "output_throughput": out_tok / wall if wall else 0.0,
                         "request_throughput": len(ok) / wall if wall else 0.0,
                         "connection_retries": sum(r.retries for r in records)}
    for name, xs in (("ttft", ttft), ("tpot", tpot), ("itl", itl), ("e2e", e2e)):
        s[f"{name}_mean"] = statistics.fmean(xs) if xs else None
        for p in (50, 90, 99):
            s[f"{name}_p{p}"] = _pct(xs, p)
    return s


def wait_healthy(url: str, proc: Any = None, timeout: float = 300.0) -> None:
    """Poll GET /health until 200; fail early if `proc` (a Popen) has exited."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if httpx.get(url.rstrip("/") + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before becoming healthy")
        time.sleep(0.5)
    raise TimeoutError(f"{url} not healthy after {timeout} s")


class RssSampler:
    """RSS of a process and its children, every `interval` seconds (200 ms by default). A child
    that exits between the listing and the read is skipped; sampling ends with the process."""

    def __init__(self, pid: int | None, interval: float = 0.2) -> None:
        self.pid, self.samples, self.interval = pid, [], interval  # type: ignore[var-annotated]
        self._stop = threading.Event()
        self._t0 = time.perf_counter()
        self._th = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import psutil

        try:
            proc = psutil.Process(self.pid)
        except psutil.Error:
            return
        while not self._stop.is_set():
            try:
                rss, children = proc.memory_info().rss, proc.children(recursive=True)
            except psutil.Error:
                return
            for c in children:  # a short-lived child (a compiler, a shell) may be gone by now
                try:
                    rss += c.memory_info().rss
                except psutil.Error:
                    pass
            self.samples.append((time.perf_counter() - self._t0, rss))
            time.sleep(self.interval)

    def __enter__(self) -> RssSampler:
        if self.pid:
            self._th.start()
        return self

    def __exit__(self, *a: object) -> None:
        self._stop.set()
        if self._th.is_alive():
            self._th.join()

    @property
    def peak(self) -> int | None:
        return max((s for _, s in self.samples), default=None)


async def run_level(items: list[Item], concurrency: int, base_url: str, model: str, endpoint: str,
                    api_key: str | None, ignore_eos: bool, extra: dict, progress: bool = True
                    ) -> tuple[list[Record], float]:
    """At most `concurrency` requests in flight; an agent conversation's turns run in order."""
    from tqdm import tqdm

    url = base_url.rstrip("/") + "/" + endpoint.lstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    sem = asyncio.Semaphore(concurrency)
    records: list[Record | None] = [None] * len(items)
    bar = tqdm(total=len(items), desc=f"c={concurrency}", disable=not progress, unit="req")
    t0 = time.perf_counter()
    out_tokens = errors = 0
    convs: dict[int, asyncio.Lock] = {}
    # No keep-alive: llama-server closes the connection after each streamed reply, and a reused
    # half-closed socket fails the next request before it is sent. One connection per request
    # for every engine keeps the comparison even.
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as client:

        async def go(i: int, it: Item) -> None:
            nonlocal out_tokens, errors
            lock = convs.setdefault(it.conversation, asyncio.Lock()) if it.conversation >= 0 else None
            if lock is not None:
                await lock.acquire()
            try:
                async with sem:
                    records[i] = rec = await one_request(client, url, _body(it, model, endpoint, ignore_eos, extra), headers)
            finally:
                if lock is not None:
                    lock.release()
            out_tokens += rec.output_tokens
            errors += not rec.ok
            bar.set_postfix(errors=errors, tok_s=f"{out_tokens / (time.perf_counter() - t0):.1f}")
            bar.update(1)

        await asyncio.gather(*(go(i, it) for i, it in enumerate(items)))
    bar.close()
    return [r for r in records if r is not None], time.perf_counter() - t0


def bench(items: list[Item] | Callable[[int], list[Item]], levels: list[int], base_url: str, model: str,
          endpoint: str = "v1/completions", api_key: str | None = None, server_pid: int | None = None,
          ignore_eos: bool = False, extra: dict | None = None, progress: bool = True) -> dict[str, Any]:
    """`items` may be a function of the level's index: fresh prompts per level, so a server's
    prefix cache cannot serve a later level from an earlier one."""
    result: dict[str, Any] = {"model": model, "base_url": base_url, "endpoint": endpoint, "levels": []}
    for k, c in enumerate(levels):
        level_items = items(k) if callable(items) else items
        with RssSampler(server_pid) as rss:
            recs, wall = asyncio.run(run_level(level_items, c, base_url, model, endpoint, api_key,
                                               ignore_eos, extra or {}, progress))
        s = summarize(recs, wall)
        s.update(concurrency=c, peak_rss=rss.peak, rss=rss.samples,
                 errors=[r.error for r in recs if r.error][:10], records=[asdict(r) for r in recs])
        result["levels"].append(s)
    return result


def markdown(result: dict[str, Any]) -> str:
    rows = ["| concurrency | success | out tok/s | req/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | "
            "ITL p50 ms | E2E p50 s | wall s | peak RSS GiB | re-sent |", "|" + "---|" * 12]

    def ms(x: float | None) -> str:
        return "-" if x is None else f"{x * 1e3:.0f}"

    for s in result["levels"]:
        rss = "-" if s["peak_rss"] is None else f"{s['peak_rss'] / 2**30:.2f}"
        e2e = "-" if s["e2e_p50"] is None else f"{s['e2e_p50']:.2f}"
        rows.append(f"| {s['concurrency']} | {s['success']}/{s['requests']} | {s['output_throughput']:.1f} | "
                    f"{s['request_throughput']:.2f} | {ms(s['ttft_p50'])} | {ms(s['ttft_p99'])} | "
                    f"{ms(s['tpot_p50'])} | {ms(s['itl_p50'])} | {e2e} | {s['wall_s']:.1f} | {rss} | "
                    f"{s.get('connection_retries', 0)} |")
    return "\n".join(rows)
