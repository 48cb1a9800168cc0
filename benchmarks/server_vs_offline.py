"""Streaming through `flatserve serve` vs the offline engine, same prompts, same run.

    .venv/bin/python benchmarks/server_vs_offline.py [--n 16] [--input 256] [--output 64]

Offline: LLM.generate on all prompts at once. Server: a fresh `flatserve serve` with the same
engine flags, driven by the bench harness at concurrency n over streaming /v1/completions.

Runtime (estimate, not timed): one to two minutes on a 2-core CPU at the defaults (two engine
starts, 16 x 256/64 each).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import httpx

sys.path.insert(0, ".")

FLAGS = ["--kv-cache-memory", "1GiB", "--max-model-len", "2048"]


def offline(prompts: list[str], out: int) -> float:
    code = (
        "import json,sys,time\nfrom flatserve import LLM, SamplingParams\n"
        "ps=json.loads(sys.stdin.read())\n"
        "llm=LLM(kv_cache_memory=2**30, max_model_len=2048)\n"
        "llm.generate(ps[:1], SamplingParams(max_tokens=4), use_tqdm=False)\n"
        f"t=time.perf_counter(); o=llm.generate(ps, SamplingParams(max_tokens={out}, temperature=0, ignore_eos=True), use_tqdm=False)\n"
        "w=time.perf_counter()-t; print('RESULT', sum(len(x.outputs[0].token_ids) for x in o)/w)\n")
    r = subprocess.run([sys.executable, "-c", code], input=json.dumps(prompts), capture_output=True, text=True)
    return float(next(x for x in r.stdout.splitlines() if x.startswith("RESULT")).split()[1])


def served(prompts: list[str], tok_counts: list[int], out: int, n: int) -> dict:
    from flatserve.bench.datasets import Item
    from flatserve.bench.serve import bench, wait_healthy

    proc = subprocess.Popen([sys.executable, "-m", "flatserve.cli", "serve", "--port", "8177", *FLAGS],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = "http://127.0.0.1:8177"
    try:
        wait_healthy(url, proc)
        model = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        items = [Item(p, c, out) for p, c in zip(prompts, tok_counts)]
        bench(items[:1], [1], url, model, ignore_eos=True, progress=False)  # warm-up
        res = bench(items, [n], url, model, server_pid=proc.pid, ignore_eos=True, progress=False)
        return res["levels"][0]
    finally:
        proc.terminate()
        proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=16)
    ap.add_argument("--input", type=int, default=256)
    ap.add_argument("--output", type=int, default=64)
    a = ap.parse_args()
    from flatserve.bench.datasets import random_split
    from flatserve.cli import _bench_tokenizer

    tok = _bench_tokenizer(None)
    items = random_split(tok, a.n, a.input, a.output)
    prompts = [it.prompt for it in items]
    off = offline(prompts, a.output)
    srv = served(prompts, [it.prompt_tokens for it in items], a.output, a.n)
    print(f"offline {off:.1f} tok/s; server (streaming, c={a.n}) {srv['output_throughput']:.1f} tok/s "
          f"= {srv['output_throughput'] / off:.0%}; success {srv['success']}/{srv['requests']}; "
          f"TTFT p50 {srv['ttft_p50'] * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
