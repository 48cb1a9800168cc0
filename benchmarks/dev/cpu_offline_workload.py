"""The served comparison's 16-stream workload offline: benchmarks/vs_llamacpp_cpu.py's level 16
(16 random 256-token prompts, 64 tokens each, EOS ignored, prefix caching off) through one
LLM.generate, repeated in one process, out tok/s each time. Tells the engine's own rate from
what serving adds on the same machine.

    .venv/bin/python benchmarks/dev/cpu_offline_workload.py [--reps 3]
"""
from __future__ import annotations

import argparse
import random
import sys
import time

sys.path.insert(0, ".")


def main() -> None:
    from flatserve import LLM, SamplingParams
    from flatserve.model.loader import default_model_path

    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    a = ap.parse_args()
    llm = LLM(model=str(default_model_path()), max_model_len=2048, max_num_seqs=a.prompts,
              enable_prefix_caching=False)
    sp = SamplingParams(max_tokens=a.max_tokens, temperature=0, ignore_eos=True)
    for rep in range(a.reps):
        prompts = [{"prompt_token_ids": [random.randrange(100, 20000) for _ in range(a.input_len)]}
                   for _ in range(a.prompts)]
        t = time.perf_counter()
        out = llm.generate(prompts, sp, use_tqdm=False)
        dt = time.perf_counter() - t
        n = sum(len(o.outputs[0].token_ids) for o in out)
        print(f"rep {rep}: {n / dt:.1f} out tok/s, {dt:.2f} s", flush=True)


if __name__ == "__main__":
    main()
