"""Where a CPU offline run's time goes: steps with prompt tokens vs decode-only steps.

    .venv/bin/python benchmarks/dev/cpu_step_split.py [--requests 16] [--max-tokens 128]
        [--cpu-gemm amx|onednn|torch] [--attention-backend cpu|cpu-sdpa|torch] [--ngram K]

The default model, the prompts of benchmarks/offline_cpu.py at that level, `LLM.generate` as the
benchmark runs it; each engine step is timed (wall clock, host and CPU forward together). With
`--ngram K` (the `flatserve-ngram` variant at K drafts) steps that verify drafts but carry no
prompt tokens are their own class.
"""
from __future__ import annotations

import argparse
import sys
import time

sys.path.insert(0, ".")


def main() -> None:
    from benchmarks.common import make_prompts
    from flatserve import LLM, SamplingParams

    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--cpu-gemm", default="auto")
    ap.add_argument("--attention-backend", default=None, help="cpu | cpu-sdpa | torch")
    ap.add_argument("--ngram", type=int, default=0, help="n-gram drafts per step (0: none)")
    a = ap.parse_args()
    spec = dict(speculative_method="ngram", num_speculative_tokens=a.ngram) if a.ngram else {}
    llm = LLM(kv_cache_memory=512 * 2**20, max_model_len=4096, cpu_gemm=a.cpu_gemm,
              attention_backend=a.attention_backend, **spec)
    eng = llm.engine
    prompts = make_prompts(a.requests)
    llm.generate(prompts[:1], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)  # warm
    log: list[list[float]] = []  # [tokens, sequences, seconds, draft tokens] per step
    schedule, step = eng.scheduler.schedule, eng.step

    def timed_schedule():
        out = schedule()
        drafts = sum(len(s.spec_token_ids) for s in out.scheduled)
        log.append([out.num_batched_tokens, len(out.scheduled), 0.0, drafts])
        return out

    def timed_step(*args, **kw):
        t = time.perf_counter()
        res = step(*args, **kw)
        if log:
            log[-1][2] = time.perf_counter() - t
        return res

    eng.scheduler.schedule, eng.step = timed_schedule, timed_step
    t0 = time.perf_counter()
    llm.generate(prompts, SamplingParams(max_tokens=a.max_tokens, temperature=0, ignore_eos=True),
                 use_tqdm=False)
    wall = time.perf_counter() - t0
    pre = [x for x in log if x[0] > x[1] + x[3]]
    dec = [x for x in log if x[0] == x[1]]
    ver = [x for x in log if x[3] and x[0] == x[1] + x[3]]
    pt = sum(x[0] for x in pre)
    ps = sum(x[2] for x in pre)
    ds = sum(x[2] for x in dec)
    print(f"wall {wall:.1f} s; {len(pre)} steps with prompt tokens: {pt:.0f} tokens in {ps:.1f} s "
          f"({pt / ps:.0f} tok/s); {len(dec)} decode-only steps: {ds:.1f} s, "
          f"{ds / max(1, len(dec)) * 1e3:.1f} ms each at {sum(x[1] for x in dec) / max(1, len(dec)):.1f} sequences")
    if ver:
        vs = sum(x[2] for x in ver)
        print(f"{len(ver)} verify steps (drafts, no prompt tokens): {vs:.1f} s, "
              f"{vs / len(ver) * 1e3:.1f} ms each at {sum(x[1] for x in ver) / len(ver):.1f} "
              f"sequences and {sum(x[0] for x in ver) / len(ver):.1f} tokens")


if __name__ == "__main__":
    main()
