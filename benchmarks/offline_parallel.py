"""Offline throughput with more than one device: the same workload (N prompts x input/output,
greedy, ignore_eos) through one layout per subprocess of one run, so the ratios compare like
with like on the same machine.

    layouts: base  = TP 1 from a checkout of --base-rev (today's engine, `git archive`d to a tmp dir)
             tp1   = TP 1 from this tree (must equal base: TP 1 takes no new code on the hot path)
             tp2   = tensor parallel over 2 GPUs (NCCL; the engine spawns rank 1)
             dp2   = 2 replicas, one per GPU, each stepped on its own thread (prompts split
                     evenly: the offline stand-in for the server's router)

    PYTHONPATH=. python3 benchmarks/offline_parallel.py --shape llama-3-8b --prompts 500 \\
        --input 512 --output 128 --layouts base,tp1,tp2,dp2 --base-rev main

Needs 2 GPUs for tp2/dp2. Every process the engine starts has NCCL_NVLS_ENABLE=0,
TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and NVSHMEM_DISABLE_NVLS=1 (flatserve/distributed).

Runtime (estimate): several minutes per layout at Llama-3-8B shapes (docs/performance-gpu.md: a
200 s device call did not hold the checkpoint, tp1 and tp2 at 200 prompts).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, ".")


def _own_gpu_helpers():
    """flatserve/bench/gpu.py of *this* tree: the base layout imports the engine from an older
    checkout (PYTHONPATH), whose helpers may predate what this script calls."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "_bench_gpu", Path(__file__).resolve().parents[1] / "flatserve/bench/gpu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


decode_step_ms = _own_gpu_helpers().decode_step_ms


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(length)] for _ in range(n)]


def _engine_kw(a: argparse.Namespace) -> dict:
    return dict(model=a.ckpt, dtype="bfloat16", max_num_seqs=a.max_num_seqs,
                max_num_batched_tokens=a.max_num_batched_tokens,
                max_model_len=a.input + a.output + 16, gpu_memory_utilization=0.85)


def _timed(run, vocab: int, a: argparse.Namespace) -> dict:
    """Warm up on other prompts (seed 1: no prefix-cache hits on the timed ones), then time."""
    from flatserve import SamplingParams

    run(_prompts(min(a.prompts, 64), a.input, vocab, 1), SamplingParams(max_tokens=3, ignore_eos=True))
    params = SamplingParams(max_tokens=a.output, temperature=0, ignore_eos=True)
    ps = _prompts(a.prompts, a.input, vocab, 0)
    t0 = time.perf_counter()
    n = run(ps, params)
    wall = time.perf_counter() - t0
    return {"wall": wall, "out_tokens": n, "tok_per_s": n / wall, "req_per_s": len(ps) / wall}


def run_layout(a: argparse.Namespace) -> dict:
    import torch

    from flatserve import LLM

    if a.layout in ("base", "tp1", "tp2"):
        kw = _engine_kw(a)
        if a.layout == "tp2":
            kw["tensor_parallel_size"] = 2
        llm = LLM(**kw)

        def run(ps, params):
            outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
            torch.cuda.synchronize()
            return sum(len(o.outputs[0].token_ids) for o in outs)

        vocab = llm.engine.state.model.vocab_size
        res = _timed(run, vocab, a)
        res["kv_blocks"] = llm.engine.state.budget.num_blocks
        res["greedy_20"] = _ragged_greedy(llm, vocab)
        res["decode_step_ms_b64"] = decode_step_ms(llm.engine, 64, vocab, a.input)
        getattr(llm, "shutdown", lambda: None)()
        return res
    # dp2: two engines, one per GPU, each built and stepped on its own thread.
    from flatserve.config import EngineConfig
    from flatserve.server.data_parallel import replica_config

    from flatserve.attention.metadata import per_thread_scopes

    per_thread_scopes()
    cfg = EngineConfig.from_kwargs(**_engine_kw(a), data_parallel_size=2)
    llms: list = [None, None]

    def build(i: int) -> None:
        llms[i] = LLM(config=replica_config(cfg, i))

    threads = [threading.Thread(target=build, args=(i,)) for i in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]

    def run(ps, params):
        counts = [0, 0]

        def one(i: int) -> None:
            torch.cuda.set_device(i)
            outs = llms[i].generate([{"prompt_token_ids": p} for p in ps[i::2]], params, use_tqdm=False)
            torch.cuda.synchronize()
            counts[i] = sum(len(o.outputs[0].token_ids) for o in outs)

        ts = [threading.Thread(target=one, args=(i,)) for i in range(2)]
        [t.start() for t in ts]
        [t.join() for t in ts]
        return sum(counts)

    return _timed(run, llms[0].engine.state.model.vocab_size, a)


def _ragged_greedy(llm, vocab: int) -> list[list[int]]:
    """Greedy tokens for 20 prompts of ragged lengths (8..600): TP=2 must give TP=1's."""
    import random

    from flatserve import SamplingParams

    rng = random.Random(7)
    ps = [[rng.randrange(4, vocab) for _ in range(rng.randint(8, 600))] for _ in range(20)]
    outs = llm.generate([{"prompt_token_ids": p} for p in ps],
                        SamplingParams(max_tokens=32, temperature=0, ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _checkout(rev: str) -> str:
    """`rev` of this repository as a plain tree in a tmp dir (the baseline imports from it).
    `rev` may also be a `git archive` tar file: a device machine gets the tree without .git."""
    d = tempfile.mkdtemp(prefix="flatserve-base-")
    if os.path.isfile(rev):
        arch = Path(rev).read_bytes()
    else:
        arch = subprocess.run(["git", "archive", rev], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", d], input=arch, check=True)
    return d


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shape", default="llama-3-8b")
    p.add_argument("--prompts", type=int, default=500)
    p.add_argument("--input", type=int, default=512)
    p.add_argument("--output", type=int, default=128)
    # Unset: the engine's defaults (sized by the device), what users get.
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--layouts", default="base,tp1,tp2,dp2")
    p.add_argument("--base-rev", default="main", help="a revision, or a `git archive` tar of one")
    p.add_argument("--ckpt-dir", default="/tmp/ckpt")
    p.add_argument("--out", default=None, help="write the results as JSON here")
    p.add_argument("--layout", default=None, help=argparse.SUPPRESS)  # one subprocess's layout
    p.add_argument("--ckpt", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.layout:
        print("RESULT " + json.dumps(run_layout(a)), flush=True)
        return
    from flatserve.bench.random_ckpt import build

    path = Path(a.ckpt_dir) / a.shape
    ckpt = str(path if (path / "config.json").exists() else build(a.shape, path))
    results = {}
    base_tree = _checkout(a.base_rev) if "base" in a.layouts.split(",") else None
    for layout in a.layouts.split(","):
        tree = base_tree if layout == "base" else str(Path.cwd())
        cmd = [sys.executable, str(Path.cwd() / "benchmarks/offline_parallel.py"), "--layout", layout,
               "--ckpt", ckpt, *sys.argv[1:]]
        env = {**os.environ, "PYTHONPATH": tree}
        out = subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True)
        line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")]
        results[layout] = json.loads(line[-1][7:]) if line else {"error": out.stderr[-3000:]}
        print(layout, json.dumps({k: v for k, v in results[layout].items() if k != "greedy_20"}), flush=True)
    ref = results.get("tp1", {}).get("greedy_20")
    for k, r in results.items():
        if ref is not None and "greedy_20" in r and k != "tp1":
            same = sum(x == y for x, y in zip(r["greedy_20"], ref))
            print(f"{k}: greedy tokens identical to tp1 on {same}/{len(ref)} ragged prompts")
        if "decode_step_ms_b64" in r and "decode_step_ms_b64" in results.get("tp1", {}):
            print(f"{k}: decode step b64 {r['decode_step_ms_b64']:.3f} ms = "
                  f"{r['decode_step_ms_b64'] / results['tp1']['decode_step_ms_b64']:.3f}x tp1")
    if "tok_per_s" in results.get("base", {}):
        for k, r in results.items():
            if "tok_per_s" in r:
                print(f"{k}: {r['tok_per_s']:.0f} tok/s = {r['tok_per_s'] / results['base']['tok_per_s']:.3f}x base")
    if a.out:
        Path(a.out).write_text(json.dumps({"args": vars(a), "results": results}, indent=1))


if __name__ == "__main__":
    main()
