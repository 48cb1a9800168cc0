"""The padding cliff: prompts of very different lengths, sequential then concurrent.

A flat varlen engine runs the three together in about the time of the longest (their decodes
share steps); a padded-cache engine pads all of them to the longest and gains little or loses.
"""
from __future__ import annotations

import asyncio
import random
import time
from typing import Any

import httpx

from flatserve.bench.datasets import Item, exact_text, one_token_words
from flatserve.bench.serve import RssSampler, _body, one_request


def cliff_items(tok: Any, lengths: list[int], max_tokens: int, seed: int = 0) -> list[Item]:
    rng, words = random.Random(seed), one_token_words(tok)
    return [Item(t := exact_text(tok, rng, words, n), len(tok(t).input_ids), max_tokens) for n in lengths]


async def _run(items: list[Item], concurrent: bool, url: str, model: str, headers: dict,
               ignore_eos: bool, extra: dict) -> float:
    limits = httpx.Limits(max_keepalive_connections=0)  # see serve.py: no reused connections
    async with httpx.AsyncClient(timeout=httpx.Timeout(1200.0), limits=limits) as client:
        t0 = time.perf_counter()
        bodies = [_body(it, model, "v1/completions", ignore_eos, extra) for it in items]
        if concurrent:
            recs = await asyncio.gather(*(one_request(client, url, b, headers) for b in bodies))
        else:
            recs = [await one_request(client, url, b, headers) for b in bodies]
        bad = [r.error for r in recs if not r.ok]
        if bad:
            raise RuntimeError(f"cliff request failed: {bad[0]}")
        return time.perf_counter() - t0


def cliff(tok: Any, base_url: str, model: str, lengths: list[int], max_tokens: int,
          api_key: str | None = None, server_pid: int | None = None, ignore_eos: bool = True,
          extra: dict | None = None) -> dict[str, Any]:
    url = base_url.rstrip("/") + "/v1/completions"
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    res: dict[str, Any] = {"max_tokens": max_tokens}
    for seed, mode in enumerate(("sequential", "concurrent")):
        # Fresh text per mode (same lengths): a prefix cache must not serve the second mode.
        items = cliff_items(tok, lengths, max_tokens, seed)
        res["lengths"] = [it.prompt_tokens for it in items]
        with RssSampler(server_pid) as rss:
            res[f"{mode}_wall_s"] = asyncio.run(_run(items, mode == "concurrent", url, model, headers,
                                                     ignore_eos, extra or {}))
        res[f"{mode}_peak_rss"] = rss.peak
    res["speedup"] = res["sequential_wall_s"] / res["concurrent_wall_s"]
    return res
