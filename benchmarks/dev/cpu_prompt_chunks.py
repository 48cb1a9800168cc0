"""Prompt throughput at each --max-num-batched-tokens: four prompts of 2,000 fresh random token ids
(fresh each round, so no prefix-cache hit) and one output token, the default model, best of 3
rounds; one process per step limit, alternated from the shell. engine/limits.py's CPU step limits
quote it.

    for T in 2048 512 2048 512; do .venv/bin/python benchmarks/dev/cpu_prompt_chunks.py $T; done
"""
from __future__ import annotations

import random
import sys
import time

sys.path.insert(0, ".")


def main() -> None:
    from flatserve import LLM, SamplingParams

    tokens = int(sys.argv[1])
    llm = LLM(max_model_len=4096, max_num_batched_tokens=tokens)
    rng = random.Random(0)

    def prompts(n: int = 4) -> list[dict]:
        return [{"prompt_token_ids": [rng.randrange(100, 200_000) for _ in range(2000)]} for _ in range(n)]

    sp = SamplingParams(max_tokens=1)
    llm.generate(prompts(1), sp, use_tqdm=False)  # warm-up
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        llm.generate(prompts(), sp, use_tqdm=False)
        best = min(best, time.perf_counter() - t)
    print(f"max_num_batched_tokens {tokens}: 8,000 prompt tokens in {best:.2f} s = {8000 / best:.0f} tok/s")


if __name__ == "__main__":
    main()
