"""Load with client disconnects against a live `flatserve serve`: N requests at C concurrent, a
share of whose clients go away mid-request (half mid-stream, half non-streaming clients that
give up), the rest checked for a correct, complete answer.

Reports: requests, disconnects, kept and correct, KV blocks still held afterwards (leaked),
the server's RSS before and after, and the wall time. "Correct" means: HTTP 200, well-formed,
finish_reason "length", exactly max_tokens completion tokens (ignore_eos), and the greedy text
equal to the same prompt's answer served alone before the load (so batching, preemption and
aborts around it changed nothing).

    python benchmarks/load_disconnects.py [--requests 1000] [--concurrency 64] \
        [--disconnect 0.1] [--max-tokens 8] [-- SERVER_ARGS...]

Runtime (estimate, not timed): a few minutes on a 2-core CPU at the defaults (one server start,
the references, then 1,000 requests of 8 tokens).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import socket
import subprocess
import sys
import time

import httpx

sys.path.insert(0, ".")

WORDS = ("the of and a to in is you that it he was for on are as with his they at be this from "
         "have or by one had not but what all were when we there can an your which their said").split()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=60).text
    return float(re.search(rf"^{name} ([0-9.e+-]+)$", text, re.M).group(1))


async def one(cl: httpx.AsyncClient, url: str, prompt: str, max_tokens: int, drop: str | None
              ) -> tuple[str, str | None]:
    """-> ("dropped" | "ok" | "bad:<why>", text)."""
    body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    if drop == "stream":
        async with cl.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as r:
            n = 0
            async for _ in r.aiter_lines():
                n += 1
                if n >= 2:
                    break  # leave mid-stream: the connection closes with the context
        return "dropped", None
    if drop == "full":
        try:
            await asyncio.wait_for(cl.post(url + "/v1/completions", json=body), timeout=0.05)
        except asyncio.TimeoutError:
            pass
        return "dropped", None
    r = await cl.post(url + "/v1/completions", json=body)
    if r.status_code != 200:
        return f"bad:status {r.status_code} {r.text[:100]}", None
    j = r.json()
    c = j["choices"][0]
    if c["finish_reason"] != "length" or j["usage"]["completion_tokens"] != max_tokens:
        return f"bad:{c['finish_reason']} {j['usage']['completion_tokens']}", c["text"]
    return "ok", c["text"]


async def load(url: str, items: list[tuple[str, str | None]], conc: int, max_tokens: int,
               ref: dict[str, str]) -> dict:
    sem = asyncio.Semaphore(conc)
    counts = {"requests": len(items), "disconnects": 0, "kept": 0, "correct": 0, "wrong": 0}
    bad: list[str] = []
    t0 = time.perf_counter()
    limits = httpx.Limits(max_connections=conc + 8, max_keepalive_connections=conc)
    async with httpx.AsyncClient(timeout=600, limits=limits) as cl:
        async def run(prompt: str, drop: str | None) -> None:
            async with sem:
                status, text = await one(cl, url, prompt, max_tokens, drop)
            done = counts["kept"] + counts["disconnects"] + 1
            if done % 100 == 0:
                print(f"{done} done, {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
            if status == "dropped":
                counts["disconnects"] += 1
                return
            counts["kept"] += 1
            if status == "ok" and text == ref[prompt]:
                counts["correct"] += 1
            else:
                counts["wrong"] += 1
                bad.append(status if status != "ok" else f"text differs: {text!r} vs {ref[prompt]!r}")
        await asyncio.gather(*(run(p, d) for p, d in items))
    counts["first_bad"] = bad[:5]
    return counts


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--concurrency", type=int, default=64)
    ap.add_argument("--disconnect", type=float, default=0.1)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=32, help="distinct prompts (references)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-cpp-build", action="store_true",
                    help="serve without building the C++ kernels (they fail to build on AVX2-only "
                         "CPUs, where the server falls back to the torch paths anyway)")
    ap.add_argument("server_args", nargs="*", help="after --: extra `flatserve serve` flags")
    a = ap.parse_args()
    import psutil

    from flatserve.bench.serve import wait_healthy

    port = _port()
    pre = ("import flatserve.kernels as k; k.CpuKernel.__call__ = lambda self: None; "
           if a.no_cpp_build else "")
    argv = ["serve", "--port", str(port), *a.server_args]
    log = open(f"/tmp/load_disconnects_{port}.log", "w")  # a pipe nobody reads would fill up
    proc = subprocess.Popen([sys.executable, "-c", f"{pre}import sys; from flatserve.cli import main; "
                             f"sys.exit(main({argv!r}))"], stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(url, proc, timeout=900)
        rng = random.Random(a.seed)
        prompts = [" ".join(rng.choice(WORDS) for _ in range(rng.randint(4, 60)))
                   for _ in range(a.prompts)]
        ref = {}
        for p in prompts:  # each prompt's answer served alone, before any load
            r = httpx.post(url + "/v1/completions", timeout=600, json={
                "prompt": p, "max_tokens": a.max_tokens, "temperature": 0, "ignore_eos": True})
            ref[p] = r.json()["choices"][0]["text"]
        rss0 = psutil.Process(proc.pid).memory_info().rss
        items = [(rng.choice(prompts), (rng.choice(("stream", "full")) if rng.random() < a.disconnect
                                         else None)) for _ in range(a.requests)]
        t0 = time.perf_counter()
        res = asyncio.run(load(url, items, a.concurrency, a.max_tokens, ref))
        res["wall_s"] = round(time.perf_counter() - t0, 1)
        deadline = time.time() + 10
        while _metric(url, "flatserve_kv_blocks_used") > 0 and time.time() < deadline:
            time.sleep(0.2)
        res["leaked_blocks"] = int(_metric(url, "flatserve_kv_blocks_used"))
        res["running_after"] = int(_metric(url, "flatserve_num_requests_running"))
        res["rss_before_mib"] = round(rss0 / 2**20)
        res["rss_after_mib"] = round(psutil.Process(proc.pid).memory_info().rss / 2**20)
        res["preemptions"] = int(_metric(url, "flatserve_num_preemptions_total"))
        res["health_after"] = httpx.get(url + "/health", timeout=30).status_code
        print(json.dumps(res, indent=1))
        return 0 if res["wrong"] == 0 and res["leaked_blocks"] == 0 else 1
    finally:
        proc.terminate()
        code = proc.wait(timeout=120)
        print(f"server exit code after SIGTERM: {code}")


if __name__ == "__main__":
    sys.exit(main())
