"""Where a CPU decode step goes: torch profiler over 5 engine steps at N concurrent requests.

    .venv/bin/python benchmarks/cpu_profile_step.py 1 [--quantization int8]
    .venv/bin/python benchmarks/cpu_profile_step.py 16

Default model, bf16; prompts of 10..1,500 random tokens (seeded), decoding after their prefill.
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
    a = ap.parse_args()
    llm = LLM(dtype="bfloat16", max_num_seqs=a.n, max_model_len=4096, kv_cache_memory=512 * 2**20,
              quantization=a.quantization)
    eng = llm.engine
    rng = random.Random(0)
    for _ in range(a.n):
        eng.add_request([rng.randrange(10, 5000) for _ in range(rng.randint(10, 1500))],
                        SamplingParams(max_tokens=200, ignore_eos=True, temperature=0))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.requests.values()):
        eng.step()
    for _ in range(3):
        eng.step()
    t = time.perf_counter()
    for _ in range(10):
        eng.step()
    print(f"{(time.perf_counter() - t) / 10 * 1e3:.1f} ms per decode step at {a.n} requests")
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(5):
            eng.step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=40))


if __name__ == "__main__":
    main()
