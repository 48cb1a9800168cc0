"""Where a CPU decode step goes: torch profiler over 5 engine steps at N concurrent requests.

    .venv/bin/python benchmarks/dev/cpu_profile_step.py 1 [--quantization int8 | --dequantize]
    .venv/bin/python benchmarks/dev/cpu_profile_step.py 16 [--by-kernel [--prefill]] [--prompt-len N] [--attention-backend B]
        [--ngram K] [--cpu-gemm amx|onednn|torch]
    .venv/bin/python benchmarks/dev/cpu_profile_step.py 16 --generate [--eager]
    .venv/bin/python benchmarks/dev/cpu_profile_step.py 16 --spread 150

Default model, bf16; prompts of 10..1,500 random tokens (seeded), decoding after their prefill.
The torch profiler sees aten ops only, not our C++ extensions; --by-kernel instead times 20
steps with wall clocks around the packed linears (LM head apart) and the attention backend.
`--ngram K` speculates with K n-gram drafts, so the steps timed are verify steps.
`--generate`: benchmarks/offline_cpu.py's run itself (its prompts at level N, 128 tokens, one
`LLM.generate` after its warm-up), every step timed by kernel, prompt steps and decode steps
apart (random-token prompts draw more greedy-head candidates than that text).
Decode steps run all layers in one C++ call (model/cpu_stack.py), timed whole; `--eager` runs
the Python layers instead, so that each kernel is timed (enforce_eager).
`--spread S`: S decode steps timed one by one, and in each the C++ stack and the greedy head:
mean, median, p90 and max of each (a few slow steps move the mean, which throughput pays).
"""
from __future__ import annotations

import argparse
import random
import sys
import time

sys.path.insert(0, ".")


def main() -> None:
    from torch.profiler import ProfilerActivity, profile

    from flatserve import LLM, SamplingParams

    ap = argparse.ArgumentParser()
    ap.add_argument("n", type=int)
    ap.add_argument("--quantization", default=None)
    ap.add_argument("--dequantize", action="store_true", help="the GGUF dequantized to bf16 (dense path)")
    ap.add_argument("--by-kernel", action="store_true")
    ap.add_argument("--prefill", action="store_true",
                    help="with --by-kernel: split the prompt steps instead of decode steps")
    ap.add_argument("--prompt-len", type=int, default=0,
                    help="prompts of this many tokens (0: 10..1,500, seeded)")
    ap.add_argument("--attention-backend", default=None, help="cpu | cpu-sdpa | torch")
    ap.add_argument("--ngram", type=int, default=0, help="n-gram drafts per step (0: none)")
    ap.add_argument("--cpu-gemm", default="auto", help="amx | onednn | torch")
    ap.add_argument("--no-greedy-head", action="store_true", help="greedy rows read the LM head itself")
    ap.add_argument("--eager", action="store_true",
                    help="enforce_eager: decode steps run the Python layers (each kernel timed)")
    ap.add_argument("--spread", type=int, default=0, help="S decode steps timed one by one")
    ap.add_argument("--generate", action="store_true",
                    help="by kernel over offline_cpu.py's own run, prompt and decode steps apart")
    a = ap.parse_args()
    if a.generate:
        return _split_generate(a.n, _time_kernels(), a.eager)
    spent = _time_kernels() if a.by_kernel else None
    spec = dict(speculative_method="ngram", num_speculative_tokens=a.ngram) if a.ngram else {}
    llm = LLM(dtype="bfloat16", max_num_seqs=a.n, max_model_len=4096, kv_cache_memory=512 * 2**20,
              quantization=a.quantization, attention_backend=a.attention_backend,
              cpu_gemm=a.cpu_gemm, enforce_eager=a.eager, dequantize=a.dequantize, **spec,
              **({"greedy_int8_head": False} if a.no_greedy_head else {}))
    eng = llm.engine
    rng = random.Random(0)
    for _ in range(a.n):
        eng.add_request([rng.randrange(10, 5000) for _ in range(a.prompt_len or rng.randint(10, 1500))],
                        SamplingParams(max_tokens=200 + a.spread, ignore_eos=True, temperature=0))
    if a.spread:
        return _spread(eng, a.spread)
    if spent is not None and a.prefill:
        return _split_prefill(eng, spent)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.requests.values()):
        eng.step()
    for _ in range(3):
        eng.step()
    t = time.perf_counter()
    for _ in range(10):
        eng.step()
    print(f"{(time.perf_counter() - t) / 10 * 1e3:.1f} ms per decode step at {a.n} requests")
    if spent is not None:
        import resource

        spent.clear()
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t = time.perf_counter()
        for _ in range(20):
            eng.step()
        step = (time.perf_counter() - t) / 20 * 1e3
        faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
        print(f"by kernel, 20 steps: {step:.1f} ms a step, {faults / 20:.0f} minor page faults a step")
        for k, v in sorted(spent.items(), key=lambda kv: -kv[1]):
            print(f"  {k:28s} {v / 20 * 1e3:6.2f} ms")
        print(f"  {'everything else':28s} {step - _outer(spent) / 20 * 1e3:6.2f} ms")
        return
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            eng.step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=40))


def _spread(eng, n: int) -> None:
    """n decode steps after the prompts and 5 more, each timed, with the stack and the head."""
    import statistics

    from flatserve.model.cpu_stack import CpuDecoderStack
    from flatserve.model.greedy_head import Int8GreedyHead
    from flatserve.model.greedy_q8 import Q8GreedyHead

    parts: dict[str, list[float]] = {"C++ stack": [], "greedy head": []}

    def timed(cls: type, attr: str, sink: list[float]) -> None:
        inner = getattr(cls, attr)

        def fn(self, *args, **kw):
            t = time.perf_counter()
            out = inner(self, *args, **kw)
            sink.append(time.perf_counter() - t)
            return out

        setattr(cls, attr, fn)

    timed(CpuDecoderStack, "__call__", parts["C++ stack"])
    timed(Q8GreedyHead, "forward", parts["greedy head"])
    timed(Int8GreedyHead, "forward", parts["greedy head"])
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.requests.values()):
        eng.step()
    for _ in range(5):
        eng.step()
    steps = []
    for v in parts.values():
        v.clear()
    for _ in range(n):
        t = time.perf_counter()
        eng.step()
        steps.append(time.perf_counter() - t)
    print(f"{n} decode steps, ms: mean / median / p90 / max")
    for name, v in {"step": steps, **parts}.items():
        if v:
            v = sorted(x * 1e3 for x in v)
            print(f"  {name:12s} {statistics.mean(v):6.2f} / {v[len(v) // 2]:6.2f} / {v[int(0.9 * len(v))]:6.2f}"
                  f" / {v[-1]:6.2f}")


def _split_prefill(eng, spent: dict[str, float]) -> None:
    """Times every step until the last prompt is in, by kernel, and counts its tokens."""
    import resource

    spent.clear()  # start-up's profile and warm-up steps ran through the same wrappers
    tokens, t, r0 = 0, time.perf_counter(), resource.getrusage(resource.RUSAGE_SELF)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.requests.values()):
        before = sum(r.num_computed_tokens for r in eng.scheduler.requests.values())
        eng.step()
        tokens += sum(r.num_computed_tokens for r in eng.scheduler.requests.values()) - before
    wall, r1 = time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF)
    print(f"prompt steps: {tokens} tokens in {wall:.2f} s ({tokens / wall:.0f} tok/s); CPU user "
          f"{r1.ru_utime - r0.ru_utime:.2f} s, system {r1.ru_stime - r0.ru_stime:.2f} s, "
          f"{r1.ru_minflt - r0.ru_minflt} minor page faults")
    for k, v in sorted(spent.items(), key=lambda kv: -kv[1]):
        print(f"  {k:28s} {v:6.3f} s")
    print(f"  {'everything else':28s} {wall - _outer(spent):6.3f} s")


def _split_generate(n: int, spent: dict[str, float], eager: bool) -> None:
    """offline_cpu.py's flatserve run at n requests, each step's kernel times filed under
    "prompt" (a request still had prompt tokens when the step began) or "decode"."""
    from benchmarks.common import make_prompts
    from flatserve import LLM, SamplingParams

    llm = LLM(kv_cache_memory=512 * 2**20, max_model_len=4096, enforce_eager=eager)
    eng = llm.engine
    llm.generate(make_prompts(n)[:1], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    step = eng.step
    steps = {"prompt": [0, 0.0], "decode": [0, 0.0]}
    by: dict[str, dict[str, float]] = {"prompt": {}, "decode": {}}

    def timed(*args, **kw):
        kind = "prompt" if any(r.num_computed_tokens < r.num_prompt_tokens
                               for r in eng.scheduler.requests.values()) else "decode"
        before = dict(spent)
        t = time.perf_counter()
        out = step(*args, **kw)
        steps[kind][0] += 1
        steps[kind][1] += time.perf_counter() - t
        for k, v in spent.items():
            by[kind][k] = by[kind].get(k, 0.0) + v - before.get(k, 0.0)
        return out

    eng.step = timed
    spent.clear()
    llm.generate(make_prompts(n), SamplingParams(max_tokens=128, temperature=0, ignore_eos=True),
                 use_tqdm=False)
    for kind, (count, total) in steps.items():
        print(f"{kind} steps: {count}, {total / count * 1e3:.1f} ms each, {total:.2f} s")
        for k, v in sorted(by[kind].items(), key=lambda kv: -kv[1]):
            print(f"  {k:34s} {v / count * 1e3:7.2f} ms")
        print(f"  {'everything else':34s} {(total - _outer(by[kind])) / count * 1e3:7.2f} ms")


def _outer(spent: dict[str, float]) -> float:
    """Seconds in the wrapped calls, less those nested in another ("  of which" labels)."""
    return sum(v for k, v in spent.items() if not k.startswith("  of which"))


def _time_kernels() -> dict[str, float]:
    """Wraps the linears' and the attention backend's forward with wall clocks; -> seconds by
    label, filled as steps run."""
    import collections

    from flatserve.attention.cpu_backend import CpuAttentionBackend
    from flatserve.model.amx import AMXLinear
    from flatserve.model.onednn import OneDNNLinear

    spent: dict[str, float] = collections.defaultdict(float)

    def wrap(cls: type, label, attr: str = "forward") -> None:
        inner = getattr(cls, attr)

        def forward(self, *args, **kw):
            t = time.perf_counter()
            out = inner(self, *args, **kw)
            spent[label(self)] += time.perf_counter() - t
            return out

        setattr(cls, attr, forward)

    in_greedy = [False]  # the greedy head's fall-backs call the bf16 head inside it

    def linear(m) -> str:
        if m.out_features <= 100_000:
            gated = " + act (gated)" if getattr(m, "act", 0) else ""  # gate_up, 2N columns
            return f"linear {m.out_features} x {m.in_features}{gated}"
        return "  of which bf16 head (greedy fall-back)" if in_greedy[0] else "LM head"

    wrap(AMXLinear, linear)
    wrap(OneDNNLinear, linear)
    from flatserve.model.avx2 import AVX2Linear
    from flatserve.model.quant import QuantLinear

    wrap(AVX2Linear, linear)
    wrap(QuantLinear, lambda m: f"quant {linear(m)}")
    wrap(CpuAttentionBackend, lambda m: "attention (KV write + kernel)")
    from flatserve.model.greedy_head import Int8GreedyHead

    wrap(Int8GreedyHead, lambda m: "LM head, greedy (7-bit copy)")
    from flatserve.model.greedy_q8 import Q8GreedyHead

    wrap(Q8GreedyHead, lambda m: "LM head, greedy (Q8_0 codes)")
    # Decode steps run every layer in one C++ call (model/cpu_stack.py), which the wrappers
    # above do not see inside: it is timed whole (--eager splits it by kernel instead).
    from flatserve.model.cpu_stack import CpuDecoderStack

    wrap(CpuDecoderStack, lambda m: "decoder layers (C++ stack)", "__call__")
    inner_greedy = Int8GreedyHead.forward  # the timed wrapper, flagged while it runs

    def greedy_forward(self, x):
        in_greedy[0] = True
        try:
            return inner_greedy(self, x)
        finally:
            in_greedy[0] = False

    Int8GreedyHead.forward = greedy_forward
    # The fused element-wise ops and the KV write, looked up at call time (enable() and the
    # backend bind these module attributes after this runs).
    from flatserve.attention import cpu_backend
    from flatserve.ops import cpu_ops

    def wrap_fn(mod, name: str, label: str) -> None:
        inner = getattr(mod, name)

        def fn(*args, **kw):
            t = time.perf_counter()
            out = inner(*args, **kw)
            spent[label] += time.perf_counter() - t
            return out

        setattr(mod, name, fn)

    wrap_fn(cpu_ops, "rms_norm", "fused rms_norm")
    wrap_fn(cpu_ops, "rms_norm_pair", "fused rms_norm (pairs)")
    wrap_fn(cpu_ops, "act_and_mul", "fused act_and_mul")
    wrap_fn(cpu_ops, "qk_norm_rope", "fused qk_norm_rope")
    wrap_fn(cpu_backend, "_write_kv", "  of which KV write")
    return spent


if __name__ == "__main__":
    main()
