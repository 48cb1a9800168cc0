"""Offline CPU throughput: flatserve vs transformers' padded batched `generate`, same prompts, same run.

    python benchmarks/offline_cpu.py [--levels 1,4,16] [--max-tokens 128] [--dtype auto] [--out F.json]

Each (engine, level) runs in its own subprocess, so peak RSS (the process's own high-water mark,
ru_maxrss) is that engine's alone. Also measured in the same run: this CPU's matmul rate (bf16
and fp32) and copy bandwidth, giving the issue's floor for the run, max(FLOPs / matmul rate,
decode-step bytes / bandwidth), where a step's bytes are the weights and the KV its queries see;
and a bound no one-token-per-step engine can beat (`floor_and_bound`: the prompts' FLOPs, then
max_tokens - 1 memory-bound steps).

Runtime (estimate, not timed): several minutes on a 2-core CPU at --levels 1,4,16 (six subprocesses
each loading the model; transformers' padded generate is the slow half).
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root, in children too
from benchmarks.common import make_prompts  # noqa: E402

# Engine variants: flatserve with one engine argument changed, for same-run A/Bs.
VARIANTS = {"flatserve": {}, "flatserve-int8": {"quantization": "int8"},
            "flatserve-torchgemm": {"cpu_gemm": "torch"}, "flatserve-onednn": {"cpu_gemm": "onednn"},
            "flatserve-unfused": {"fused_ops": "none"}, "flatserve-copyhead": {"copy_tied_lm_head": True},
            "flatserve-sdpa": {"attention_backend": "cpu-sdpa"},
            "flatserve-fullhead": {"greedy_int8_head": False},
            "flatserve-greedyhead": {"greedy_int8_head": True}, "flatserve-eager": {"enforce_eager": True},
            "flatserve-ngram": {"speculative_method": "ngram", "num_speculative_tokens": 3}}


def run_flatserve(prompts: list[str], max_tokens: int, dtype: str, **engine_kw) -> dict:
    from flatserve import LLM, SamplingParams

    llm = LLM(dtype=dtype, kv_cache_memory=512 * 2**20, max_model_len=4096, **engine_kw)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)  # warm
    before = llm.engine.stats()  # speculation counters of the timed run alone
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    return {"wall": wall, "out_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
            "prompt_tokens": sum(len(o.prompt_token_ids) for o in outs),
            "prompt_lens": [len(o.prompt_token_ids) for o in outs],
            "dtype": str(llm.engine.state.dtype), "cpu_gemm": llm.engine.state.cpu_gemm,
            "fused_ops": sorted(llm.engine.state.fused_ops),
            **{k: v - before[k] for k, v in llm.engine.stats().items() if k.startswith("spec_")}}


def run_transformers(prompts: list[str], max_tokens: int, dtype: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from flatserve.device import resolve_dtype
    from flatserve.model.loader import default_model_path, gguf_sidecar

    path = default_model_path()
    dt = resolve_dtype(dtype, torch.device("cpu"))
    tok = AutoTokenizer.from_pretrained(str(gguf_sidecar(path)))
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                 dtype=torch.float32).to(dt).eval()
    enc = tok(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        model.generate(**tok(prompts[:1], return_tensors="pt"), max_new_tokens=4, do_sample=False)
        t0 = time.perf_counter()
        out = model.generate(**enc, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                             do_sample=False, pad_token_id=tok.pad_token_id)
    wall = time.perf_counter() - t0
    return {"wall": wall, "out_tokens": int((out.shape[1] - enc.input_ids.shape[1]) * len(prompts)),
            "prompt_tokens": int(enc.attention_mask.sum()), "padded_to": int(enc.input_ids.shape[1]),
            "prompt_lens": enc.attention_mask.sum(1).tolist(),
            "dtype": str(dt)}


def _llc_bytes() -> int:
    """The largest CPU cache's size from Linux sysfs (0 where it cannot be read)."""
    import glob

    sizes = [0]
    for f in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        text = open(f).read().strip()
        mult = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
        sizes.append(int(text.rstrip("KMG")) * mult)
    return max(sizes)


def _best_time(fn: Callable[[], object], rounds: int = 5) -> float:
    """The shortest of `rounds` timings of fn(): a peak rate is the best this shared VM gives,
    as STREAM reports its best of N. One timing had read 843 GFLOP/s for the bf16 matmul
    (2,275-2,677 in the runs around it), which put the floor on compute and the ratio at 0.86."""
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def measure_floor(dtype: str) -> dict:
    import torch

    from flatserve.device import resolve_dtype

    res = {}
    for name, dt in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        a, b = torch.randn(2048, 2048, dtype=dt), torch.randn(2048, 2048, dtype=dt)
        for _ in range(3):
            a @ b
        res[f"matmul_{name}_flops"] = 2 * 2048**3 * 10 / _best_time(lambda: [a @ b for _ in range(10)])
    # Arrays of 256 MiB or twice the last-level cache, whichever is larger: the floor is about
    # memory, and this VM's host has a 480 MiB L3. A 256 MiB copy (512 MiB touched) read
    # 25.0 GB/s on one day and 38.5 GB/s on another, its read-only stream 55 GB/s:
    # partly cache hits (benchmarks/cpu_floor.py --sweep: 52 GB/s at 128 MB, 28-30 from 256 MB).
    res["stream_bytes"] = max(256 * 2**20, 2 * _llc_bytes())
    x = torch.randn(res["stream_bytes"] // 4)
    y = torch.empty_like(x)
    y.copy_(x)
    res["copy_bytes_per_s"] = 2 * x.numel() * 4 * 5 / _best_time(lambda: [y.copy_(x) for _ in range(5)])  # read + write
    # A read-only stream (what a decode step mostly is), for context; the floor keeps the copy
    # rate the issue names.
    x.sum()
    res["read_bytes_per_s"] = x.numel() * 4 * 5 / _best_time(lambda: [x.sum() for _ in range(5)])
    res["dtype"] = str(resolve_dtype(dtype, torch.device("cpu")))
    return res


def _child(args: argparse.Namespace) -> None:
    prompts = make_prompts(args.level)
    if args.engine == "transformers":
        res = run_transformers(prompts, args.max_tokens, args.dtype)
    else:
        res = run_flatserve(prompts, args.max_tokens, args.dtype, **VARIANTS[args.engine])
    # The process's own high-water mark (what `/usr/bin/time -v` reports). The 0.1 s sampler this
    # replaces added the RSS of children, which counted a forked start-up helper's shared pages
    # (2.9 GiB against 2.07 by time -v), and once read 0.22 GiB (most
    # likely a child that exited mid-read, which ended its sampling).
    res["peak_rss"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    print("RESULT " + json.dumps(res), flush=True)


def _spawn(engine: str, level: int, args: argparse.Namespace) -> dict:
    cmd = [sys.executable, __file__, "--child", "--engine", engine, "--level", str(level),
           "--max-tokens", str(args.max_tokens), "--dtype", args.dtype]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate()
    line = next(x for x in out.splitlines() if x.startswith("RESULT "))
    r = json.loads(line[7:])
    r.update(engine=engine, level=level, tok_per_s=r["out_tokens"] / r["wall"])
    return r


def gemma_270m_costs() -> dict:
    """Matmul parameters of Gemma 3 270M: the 18 layers' projections, and the 262k x 640 LM head
    (tied to the embedding, whose lookup costs no FLOPs). Attention's own FLOPs are left out
    (at these lengths about a tenth of a prompt token's projection FLOPs). Its KV: 1 head of 256
    per layer; 3 of the 18 layers global, 15 with a 512-token window."""
    hidden, inter, layers, vocab, hq, hkv, d = 640, 2048, 18, 262144, 4, 1, 256
    per_layer = hidden * (hq + 2 * hkv) * d + hq * d * hidden + 3 * hidden * inter
    return {"layer_params": layers * per_layer, "lm_head_params": vocab * hidden,
            "weight_params": layers * per_layer + vocab * hidden,
            "kv_elems_per_token_layer": 2 * hkv * d, "global_layers": 3, "window_layers": 15,
            "window": 512}


def run_flops(costs: dict, prompt_tokens: int, out_tokens: int) -> float:
    """Every token runs the layers; only sampled rows (one per output token) run the LM head
    (both engines skip the prompt's other rows: flatserve by design, transformers' generate
    by slicing the last position before its head)."""
    return 2 * ((prompt_tokens + out_tokens) * costs["layer_params"]
                + out_tokens * costs["lm_head_params"])


def step_bytes(costs: dict, prompt_lens: list[int], k: int, w_elt: int, kv_elt: int) -> float:
    """Bytes the step that samples output token k (1-based) must read: every weight once, and
    each sequence's cached K/V over the keys its query sees (context L + k - 1; a window layer
    at most its window)."""
    ctx = [L + k - 1 for L in prompt_lens]
    keys = (costs["global_layers"] * sum(ctx)
            + costs["window_layers"] * sum(min(c, costs["window"]) for c in ctx))
    return costs["weight_params"] * w_elt + keys * costs["kv_elems_per_token_layer"] * kv_elt


def floor_and_bound(costs: dict, r: dict, max_tokens: int, rate: float, bw: float, elt: int) -> dict:
    """The issue's floor, max(all FLOPs / matmul rate, all decode-step bytes / bandwidth), and a
    tighter bound for any engine that samples one token per sequence per step: the last request
    to finish its prompt still needs max_tokens - 1 steps after it, each reading the weights and
    the KV, and all prompt FLOPs come before them. Decode rows riding in prefill steps count as
    free in the bound (it is a lower bound, not a schedule)."""
    w_elt = 1 if r["engine"] == "flatserve-int8" else elt  # int8 weights: 1 byte each
    lens = r["prompt_lens"]
    mem = [step_bytes(costs, lens, k, w_elt, elt) / bw for k in range(1, max_tokens + 1)]
    t_compute = run_flops(costs, r["prompt_tokens"], r["out_tokens"]) / rate
    t_memory = sum(mem)
    t_prompt = 2 * (r["prompt_tokens"] * costs["layer_params"] + len(lens) * costs["lm_head_params"]) / rate
    t_bound = t_prompt + sum(mem[1:])
    return {"t_compute": t_compute, "t_memory": t_memory, "t_bound": t_bound,
            "floor_tok_per_s": r["out_tokens"] / max(t_compute, t_memory),
            "bound_tok_per_s": r["out_tokens"] / t_bound}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--levels", default="1,4,16")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--engines", default="flatserve,transformers",
                    help="comma list of transformers and " + ", ".join(VARIANTS))
    ap.add_argument("--out", default="bench_out/offline_cpu.json")
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--engine")
    ap.add_argument("--level", type=int)
    args = ap.parse_args()
    if args.child:
        return _child(args)
    floor = measure_floor(args.dtype)
    costs = gemma_270m_costs()
    rows = [_spawn(e, int(lv), args) for lv in args.levels.split(",") for e in args.engines.split(",")]
    rate = floor["matmul_bf16_flops"] if "bfloat16" in floor["dtype"] else floor["matmul_fp32_flops"]
    elt = 2 if "bfloat16" in floor["dtype"] else 4
    print(f"matmul {floor['dtype']}: {rate / 1e9:.0f} GFLOP/s; copy bandwidth "
          f"{floor['copy_bytes_per_s'] / 1e9:.1f} GB/s (read-only stream "
          f"{floor['read_bytes_per_s'] / 1e9:.1f} GB/s, not used in the floor)")
    print("| engine | requests | output tok/s | wall s | peak RSS GiB | floor tok/s | vs floor "
          "| bound tok/s | vs bound |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        r.update(floor_and_bound(costs, r, args.max_tokens, rate, floor["copy_bytes_per_s"], elt))
        print(f"| {r['engine']} | {r['level']} | {r['tok_per_s']:.1f} | {r['wall']:.1f} | "
              f"{r['peak_rss'] / 2**30:.2f} | {r['floor_tok_per_s']:.1f} | "
              f"{r['tok_per_s'] / r['floor_tok_per_s']:.2f} | {r['bound_tok_per_s']:.1f} | "
              f"{r['tok_per_s'] / r['bound_tok_per_s']:.2f} |")
    import os

    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"floor": floor, "costs": costs, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
