"""Offline GPU throughput on random-weight real-size checkpoints, with transformers' continuous
batching (`generate_batch`, paged|sdpa) as the peer, each in its own subprocess of one run.

    PYTHONPATH=. python3 benchmarks/offline_gpu.py --shape qwen3-0.6b --prompts 500 --input 512 --output 128
    PYTHONPATH=. python3 benchmarks/offline_gpu.py --shape qwen3-30b-a3b --load-format dummy  # MoE (also gpt-oss-20b)

Runtime (estimate, not timed): a few minutes on one H100/H200 for the default 500 x 512/128 with
both engines (transformers' generate_batch takes most of it; flatserve alone well under one);
--timeout caps each engine's subprocess (300 s).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, ".")

from flatserve.bench.gpu import copy_bandwidth, decode_step_ms, moe_active_bytes, prompts  # noqa: E402


def run_flatserve(a: argparse.Namespace) -> dict:
    import torch

    from flatserve import LLM, SamplingParams

    llm = LLM(model=a.ckpt, dtype="bfloat16", max_num_seqs=a.max_num_seqs,
              max_num_batched_tokens=a.max_num_batched_tokens, max_model_len=a.input + a.output + 16,
              enforce_eager=a.enforce_eager, fused_ops=a.fused_ops,
              async_scheduling=a.async_scheduling, load_format=a.load_format,
              quantization=a.quantization)
    vocab = llm.engine.state.model.vocab_size
    ps = prompts(a.prompts, a.input, vocab)
    params = SamplingParams(max_tokens=a.output, temperature=0, ignore_eos=True)
    # Warm-up on the workload's shapes (every prefill size, a few decode steps) so Triton's
    # value-specialised compiles are not timed, but on *other* prompts (seed 1): warming up on
    # the timed prompts themselves left their prefixes in the prefix cache and skipped most of
    # the timed prefill (figures from 2437ccb to this fix were inflated that way).
    warm = prompts(a.prompts, a.input, vocab, seed=1)
    llm.generate([{"prompt_token_ids": p} for p in warm], SamplingParams(max_tokens=3, ignore_eos=True),
                 use_tqdm=False)
    torch.cuda.synchronize()
    kv = llm.engine.kv
    hits0 = kv.hit_tokens
    t0 = time.perf_counter()
    outs = llm.generate([{"prompt_token_ids": p} for p in ps], params, use_tqdm=False)
    wall = time.perf_counter() - t0
    hits = kv.hit_tokens - hits0  # random prompts share no prefix: must stay 0
    n = sum(len(o.outputs[0].token_ids) for o in outs)
    # Per request (RequestOutput.metrics, host clock): TPOT = (finish - first token) / (n - 1).
    tpot = [(o.metrics.finished_time - o.metrics.first_token_time) / (len(o.outputs[0].token_ids) - 1)
            for o in outs if len(o.outputs[0].token_ids) > 1]
    ttft = [o.metrics.time_to_first_token for o in outs]
    lat = {"mean_tpot_ms": sum(tpot) / len(tpot) * 1e3, "mean_ttft_ms": sum(ttft) / len(ttft) * 1e3}
    step = decode_step_times(llm, vocab, a)
    return {"wall": wall, "out_tokens": n, "tok_per_s": n / wall, "req_per_s": len(ps) / wall,
            "fused_ops": sorted(llm.engine.state.fused_ops), "async": llm.engine.async_mode,
            "kv_blocks": llm.engine.state.budget.num_blocks, "prefix_hit_tokens": hits,
            "max_num_seqs": llm.engine.cfg.max_num_seqs, "quantization": a.quantization,
            "max_num_batched_tokens": llm.engine.cfg.max_num_batched_tokens, **lat, **step}


def decode_step_times(llm, vocab: int, a: argparse.Namespace) -> dict:
    """Decode-step time at each of --step-batches (context = input length), host included: median
    interval of 30 back-to-back steps, and their mean. Stepped as `LLM.generate` steps
    (`emit_unfinished=False`: no text built for unfinished requests); `..._stream_...` is the
    same batch stepped as the server steps (every request's text and output object each step)."""
    st = llm.engine.state
    bw = copy_bandwidth()
    res = {"copy_GBps": bw / 1e9, "weights_GB": st.weights_bytes / 1e9}
    for bs in (int(b) for b in a.step_batches.split(",")):
        if bs <= llm.engine.cfg.max_num_seqs:
            # Memory floor of one step: every weight and every cached K/V byte read once. The
            # timed steps run at contexts input + 4 .. input + 34: their mean is input + 19.
            kv = bs * (a.input + 19) * st.model.kv_bytes_per_token * 2  # bf16
            # weights_bytes: as loaded (a --quantization's blocks, scales included)
            res[f"floor_ms_b{bs}"] = (st.weights_bytes + kv) / bw * 1e3
            if st.model.moe is not None:  # only the experts a step selects are read
                res[f"floor_active_ms_b{bs}"] = (moe_active_bytes(st, bs) + kv) / bw * 1e3
            for emit, tag in ((False, ""), (True, "stream_")):
                med, mean = decode_step_ms(llm.engine, bs, vocab, a.input, emit, with_mean=True)
                res[f"decode_step_{tag}ms_b{bs}"] = med
                res[f"decode_step_{tag}mean_ms_b{bs}"] = mean
    return res


def run_hf(a: argparse.Namespace) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    if a.load_format == "dummy":  # config only: random weights drawn on the GPU
        from transformers import AutoConfig

        torch.manual_seed(0)
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(a.ckpt), dtype=torch.bfloat16,
                                                     attn_implementation=a.hf_attn).eval()
    else:
        model = AutoModelForCausalLM.from_pretrained(a.ckpt, dtype=torch.bfloat16,
                                                     attn_implementation=a.hf_attn).cuda().eval()
    ps = prompts(a.prompts, a.input, model.config.vocab_size)
    cfg = GenerationConfig(max_new_tokens=a.output, min_new_tokens=a.output, do_sample=False,
                           eos_token_id=-1, pad_token_id=0)
    model.generate_batch(inputs=prompts(8, a.input, model.config.vocab_size, seed=1),
                         generation_config=cfg)  # warm-up, on prompts other than the timed ones
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = model.generate_batch(inputs=ps, generation_config=cfg)
    wall = time.perf_counter() - t0
    n = sum(len(o.generated_tokens) for o in outs.values())
    return {"wall": wall, "out_tokens": n, "tok_per_s": n / wall, "req_per_s": len(ps) / wall}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="qwen3-0.6b")
    ap.add_argument("--ckpt", default=None)
    ap.add_argument("--prompts", type=int, default=500)
    ap.add_argument("--input", type=int, default=512)
    ap.add_argument("--output", type=int, default=128)
    # Unset: the engine's own defaults (sized by the device), which is what users get.
    ap.add_argument("--max-num-seqs", type=int, default=None)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--quantization", default=None, help="flatserve only: q4_0 | q8_0 at load")
    ap.add_argument("--step-batches", default="64,256", help="decode-step timings at these batches")
    ap.add_argument("--fused-ops", default="auto", help="auto | none | comma list (flatserve/ops)")
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None)
    ap.add_argument("--engines", default="flatserve,transformers")
    ap.add_argument("--hf-attn", default=None, help="transformers' attn_implementation (default "
                    "paged|sdpa; paged|eager for gpt-oss, whose sinks SDPA does not take)")
    ap.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                    help="dummy: random weights drawn by each engine from the config alone (no "
                         "checkpoint written: the MoE shapes are 42-61 GB in bf16)")
    ap.add_argument("--child", default=None)
    ap.add_argument("--timeout", type=int, default=300)
    ap.add_argument("--out", default="bench_out/offline_gpu.json")
    a = ap.parse_args()
    if a.child:
        fn = run_flatserve if a.child == "flatserve" else run_hf
        print("RESULT " + json.dumps(fn(a)), flush=True)
        return
    if a.hf_attn is None:
        a.hf_attn = "paged|eager" if a.shape.startswith("gpt-oss") else "paged|sdpa"
    if a.ckpt is None:
        from flatserve.bench.random_ckpt import build

        dummy = a.load_format == "dummy"
        a.ckpt = str(build(a.shape, Path("/tmp/ckpt") / (a.shape + "-config" * dummy), weights=not dummy))
    rows = []
    for eng in a.engines.split(","):
        cmd = [sys.executable, __file__, "--child", eng, "--ckpt", a.ckpt] + [
            f"--{k}={v}" for k, v in (("prompts", a.prompts), ("input", a.input), ("output", a.output),
                                      ("max-num-seqs", a.max_num_seqs),
                                      ("max-num-batched-tokens", a.max_num_batched_tokens),
                                      ("fused-ops", a.fused_ops), ("hf-attn", a.hf_attn),
                                      ("load-format", a.load_format), ("quantization", a.quantization),
                                      ("step-batches", a.step_batches))
            if v is not None] + (["--enforce-eager"] * a.enforce_eager) + (
            [] if a.async_scheduling is None else
            ["--async-scheduling" if a.async_scheduling else "--no-async-scheduling"])
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
            line = [x for x in r.stdout.splitlines() if x.startswith("RESULT ")]
            row = json.loads(line[0][7:]) if line else {"error": r.stderr[-1500:]}
            if line and not row.get("out_tokens"):  # e.g. generate_batch returning nothing
                row["error"] = "no output tokens: " + r.stderr[-1500:]
        except subprocess.TimeoutExpired:
            row = {"error": f"did not finish within {a.timeout} s"}
        row["engine"] = eng
        rows.append(row)
        print(eng, json.dumps(row)[:1500], flush=True)
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"shape": a.shape, "args": vars(a), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
