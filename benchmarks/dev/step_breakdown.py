"""Where one decode step's time goes on the GPU: each phase of `Engine.step` timed on its own.

    PYTHONPATH=. python3 benchmarks/dev/step_breakdown.py --shape qwen3-0.6b --batch 64,256 --ctx 512
    # MoE split (attention `_attn_kernel`, MoE `_route_kernel`/`_moe_gemm_kernel`, dense cuBLAS):
    PYTHONPATH=. python3 benchmarks/dev/step_breakdown.py --shape qwen3-30b-a3b --batch 64 --profile \
        --no-async-scheduling
    # one-stream decode, 4-bit weights (the planar GEMV) against bf16:
    PYTHONPATH=. python3 benchmarks/dev/step_breakdown.py --shape llama-3-8b --load-format dummy \
        --batch 1 --profile --no-async-scheduling [--quantization q4_0]

Phases (CUDA-synchronised between them, so the sum is an upper bound of one step's wall time):
schedule (scheduler), build (numpy packing + H2D copies), forward (graph replay or eager
forward, logits), sample (sampler set-up on the host + GPU sampling + the one D2H copy),
update (scheduler update, detokenizer, outputs): always the synchronous order, whatever the
engine's mode. `engine_step` is one untouched `Engine.step` synchronised around it;
`engine_step_back_to_back` is 30 steps in a row / 30 (async scheduling overlaps there). `gpu_ms` is the forward's CUDA-event time
alone (GPU busy time of the step's model work); `floor_ms` is weights + KV bytes over the
measured copy bandwidth.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, ".")

from flatserve.bench.gpu import copy_bandwidth  # noqa: E402


def measure(llm, batch: int, ctx: int, steps: int, profile: bool = False) -> dict:
    import torch

    from flatserve.bench.gpu import prompts
    from flatserve import SamplingParams
    from flatserve.runner import build_flat_batch
    from flatserve.engine.sampler import expand

    eng, runner = llm.engine, llm.engine.runner
    vocab = eng.state.model.vocab_size
    for p in prompts(batch, ctx, vocab, seed=batch):
        eng.add_request(p, SamplingParams(max_tokens=4 * steps + 20, ignore_eos=True, temperature=0))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.requests.values()):
        eng.step()
    for _ in range(3):
        eng.step()
    phases: dict[str, list[float]] = {k: [] for k in ("schedule", "build", "forward", "sample",
                                                      "update", "total", "gpu")}
    ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    # The phase split replays the synchronous order by hand: sync engines only.
    for _ in range(0 if eng.async_mode else steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = eng.scheduler.schedule()
        t1 = time.perf_counter()
        fb = build_flat_batch(out, runner.block_size, runner.device)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        ev0.record()
        logits = runner.forward_logits(fb)
        ev1.record()
        torch.cuda.synchronize()
        t3 = time.perf_counter()
        rows = expand(fb.groups)
        st = eng.sampler.prepare(rows, runner.device)
        tokens, _, _ = eng.sampler.sample(logits, rows, st)
        toks = [[t] for t in tokens.tolist()]
        t4 = time.perf_counter()
        reqs = [r for r, _ in fb.groups]
        eng.scheduler.update(out, {r.request_id: t for r, t in zip(reqs, toks)})
        for req, tk in zip(reqs, toks):
            eng._absorb(eng.children[req.request_id][1], tk[0], None)
        t5 = time.perf_counter()
        for k, v in zip(("schedule", "build", "forward", "sample", "update", "total"),
                        (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t5 - t0)):
            phases[k].append(v * 1e3)
        phases["gpu"].append(ev0.elapsed_time(ev1))
    # Untouched engine steps at the same batch: each alone (synchronised around it), and
    # back to back (what a run sees; with async scheduling the host overlaps the GPU here).
    walls = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        eng.step(emit_unfinished=False)
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - t) * 1e3)
    torch.cuda.synchronize()
    stamps = [time.perf_counter()]
    for _ in range(steps):
        eng.step(emit_unfinished=False)
        stamps.append(time.perf_counter())
    torch.cuda.synchronize()
    back_to_back = (time.perf_counter() - stamps[0]) * 1e3 / steps
    gaps = sorted(b - a for a, b in zip(stamps, stamps[1:]))
    if profile and not eng.async_mode:  # the profile replays the synchronous order too
        print(f"-- GPU kernels of 5 decode forwards at batch {batch}:")
        print(kernel_profile(runner, eng, build_flat_batch))
    for rid in list(eng.parents):
        eng.abort(rid)
    med = {k: sorted(v)[len(v) // 2] for k, v in phases.items() if v}
    med["engine_step"] = sorted(walls)[len(walls) // 2]
    med["engine_step_back_to_back"] = back_to_back  # mean
    med["engine_step_back_to_back_median"] = gaps[len(gaps) // 2] * 1e3
    return med


def prefill_step(llm, tokens: int, ctx: int, profile: bool) -> dict:
    """One prompt step of `tokens` tokens (prompts of `ctx` each, all scheduled at once): the
    forward's CUDA-event time (median of 3 runs of the same packed batch) and, with `profile`,
    its kernels. The offline workloads' prompt phase is such steps back to back."""
    import torch

    from flatserve import SamplingParams
    from flatserve.bench.gpu import prompts
    from flatserve.runner import build_flat_batch

    eng, runner = llm.engine, llm.engine.runner
    for p in prompts(max(1, tokens // ctx), ctx, eng.state.model.vocab_size, seed=3):
        eng.add_request(p, SamplingParams(max_tokens=1, ignore_eos=True, temperature=0))
    out = eng.scheduler.schedule()
    fb = build_flat_batch(out, runner.block_size, runner.device)
    n = sum(s.num_tokens for s in out.scheduled)
    times = []
    for _ in range(4):  # the first compiles Triton's shapes for this size
        ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ev0.record()
        runner.forward_logits(fb)
        ev1.record()
        torch.cuda.synchronize()
        times.append(ev0.elapsed_time(ev1))
    ms = sorted(times[1:])[1]
    if profile:
        print(f"-- GPU kernels of one prompt step of {n} tokens:")
        print(_kernel_table(lambda: runner.forward_logits(fb), 1, 14))
    for rid in list(eng.parents):
        eng.abort(rid)
    return {"prefill_tokens": n, "prefill_ms": ms, "prefill_tok_per_s": n / ms * 1e3}


def kernel_profile(runner, eng, build_flat_batch) -> str:
    """torch.profiler table of the kernels inside 5 forwards (graph replays keep their kernels)."""
    out = eng.scheduler.schedule()
    fb = build_flat_batch(out, runner.block_size, runner.device)
    table = _kernel_table(lambda: runner.forward_logits(fb), 5, 40)
    eng.scheduler.update(out, {s.request.request_id: [0] for s in out.scheduled})
    return table


def _kernel_table(forward, times: int, rows: int) -> str:
    """torch.profiler's table of the CUDA kernels inside `times` calls of `forward`."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(times):
            forward()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=rows, max_name_column_width=60)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--ckpt", default=None)
    ap.add_argument("--batch", default="64,256")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--fused-ops", default="auto")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument("--profile", action="store_true", help="print the GPU kernel table per batch")
    ap.add_argument("--prefill", type=int, default=0, help="also time one prompt step of this "
                    "many tokens (prompts of --ctx tokens), profiled with --profile")
    ap.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                    help="dummy: random weights from the config alone (no checkpoint written)")
    ap.add_argument("--quantization", default=None, help="q4_0 | q8_0 at load (the CUDA planar path)")
    ap.add_argument("--out", default="bench_out/step_breakdown.json")
    a = ap.parse_args()
    import torch

    from flatserve import LLM

    if a.ckpt is None:
        from flatserve.bench.random_ckpt import build

        dummy = a.load_format == "dummy"
        a.ckpt = str(build(a.shape, Path("/tmp/ckpt") / (a.shape + "-config" * dummy), weights=not dummy))
    batches = [int(b) for b in a.batch.split(",")]
    llm = LLM(model=a.ckpt, dtype="bfloat16", max_num_seqs=max(batches), max_num_batched_tokens=32768,
              max_model_len=a.ctx + a.steps * 3 + 64, enforce_eager=a.enforce_eager, fused_ops=a.fused_ops,
              async_scheduling=a.async_scheduling, load_format=a.load_format,
              quantization=a.quantization)
    m = llm.engine.state.model
    weights = llm.engine.state.weights_bytes  # as loaded (a --quantization's blocks and scales)
    kv_per_tok = 2 * m.num_layers * m.num_kv_heads * m.head_dim * 2
    bw = copy_bandwidth()
    rows = []
    for b in batches:
        r = measure(llm, b, a.ctx, a.steps, a.profile)
        kv = b * (a.ctx + a.steps) * kv_per_tok
        r.update(batch=b, floor_ms=(weights + kv) / bw * 1e3)  # bw counts read + write, as gpu.md
        if m.moe is not None:  # MoE: the experts a step selects, not all
            from flatserve.bench.gpu import moe_active_bytes

            r["floor_active_ms"] = (moe_active_bytes(llm.engine.state, b) + kv) / bw * 1e3
        rows.append(r)
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in r.items()}), flush=True)
    res = {"shape": a.shape, "gpu": torch.cuda.get_device_name(), "copy_GBps": bw / 1e9,
           "weights_GB": weights / 1e9, "args": vars(a), "rows": rows}
    if a.prefill:
        res["prefill"] = prefill_step(llm, a.prefill, a.ctx, a.profile)
        print(json.dumps(res["prefill"]), flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
