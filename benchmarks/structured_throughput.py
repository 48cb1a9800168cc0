"""Decode throughput with every request grammar-constrained vs unconstrained, same engine, same run.

Both arms sample at temperature 1.0 and run exactly --max-tokens tokens per request (the
unconstrained arm ignores eos; the schema of the constrained arm is an array that cannot close
before the cut), so the only difference is the grammar work: host bitmask fills per row and the
masked sampling op. The arms alternate (A B A B ...) and the best round of each is compared, as
this box is shared and noisy. Prints one line per round and the ratio constrained/unconstrained.

    python benchmarks/structured_throughput.py --streams 16 --max-tokens 64 --rounds 2 \
        [--device cpu] [--attention-backend torch] [--fused-ops none] [--cpu-gemm torch]

Runtime (estimate, not timed): a few minutes on a 2-core CPU at the defaults (one engine, the
grammar compiled once, 2 rounds x 2 arms x 16 x 64 tokens).
"""
from __future__ import annotations

import argparse
import time

from flatserve import LLM, SamplingParams
from flatserve.engine.sampling_params import StructuredOutputs

# An array of records that must hold at least 500 items: the output never completes inside
# max_tokens, so every request runs to the same length as the unconstrained arm.
SCHEMA = {"type": "array", "minItems": 500, "items": {
    "type": "object", "additionalProperties": False, "required": ["id", "name", "ok"],
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 10000},
                   "name": {"type": "string", "maxLength": 10}, "ok": {"type": "boolean"}}}}


def run(llm: LLM, prompts: list[str], params: SamplingParams) -> tuple[float, int]:
    t = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    dt = time.perf_counter() - t
    return dt, sum(len(o.outputs[0].token_ids) for o in outs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--attention-backend", default=None)
    ap.add_argument("--fused-ops", default="auto")
    ap.add_argument("--cpu-gemm", default="auto")
    ap.add_argument("--model", default=None)
    a = ap.parse_args()
    llm = LLM(a.model, device=a.device, attention_backend=a.attention_backend, fused_ops=a.fused_ops,
              cpu_gemm=a.cpu_gemm, max_model_len=1024, kv_cache_memory=512 << 20,
              max_num_seqs=max(16, a.streams))
    prompts = [f"Record list number {i}, as JSON:" for i in range(a.streams)]
    free = SamplingParams(max_tokens=a.max_tokens, temperature=1.0, ignore_eos=True, seed=0)
    spec = StructuredOutputs(json=SCHEMA)
    fixed = SamplingParams(max_tokens=a.max_tokens, temperature=1.0, seed=0, structured_outputs=spec)
    llm.engine.grammars.submit(spec).result()  # compile outside the timing (it is cached)
    run(llm, prompts[:2], SamplingParams(max_tokens=4))  # warm-up
    best: dict[str, float] = {}
    for r in range(a.rounds):
        for name, p in (("unconstrained", free), ("constrained", fixed)):
            dt, n = run(llm, prompts, p)
            best[name] = max(best.get(name, 0.0), n / dt)
            print(f"round {r} {name:>13}: {n} tokens in {dt:.2f} s = {n / dt:.1f} tok/s", flush=True)
    ratio = best["constrained"] / best["unconstrained"]
    print(f"best: constrained {best['constrained']:.1f} tok/s, unconstrained "
          f"{best['unconstrained']:.1f} tok/s, ratio {ratio:.3f} ({a.streams} streams)")


if __name__ == "__main__":
    main()
