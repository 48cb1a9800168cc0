"""N-gram speculative decoding on repetitive prompts (code edits, summaries that quote).

    python benchmarks/spec_decode.py [--levels 1,8] [--max-tokens 128] [--k 3] [--out F.json]

The default model, greedy, the same prompts with and without `--speculative-method ngram`, each
configuration in its own engine, one after the other in one process (same machine state).
Reports output tokens/s, the speed-up, acceptance rate and mean acceptance length (tokens per
verify step, the bonus token included), and checks the outputs are identical.

Runtime (estimate, not timed): a few minutes on a 2-core CPU at the defaults (four engines: with and
without n-gram drafts at concurrency 1 and 8, 128 tokens each).
"""
from __future__ import annotations

import argparse
import json
import time

CODE = [
    '''def moving_average(values, window):
    result = []
    total = 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        if i >= window - 1:
            result.append(total / window)
    return result
''',
    '''class Stack:
    def __init__(self):
        self.items = []

    def push(self, item):
        self.items.append(item)

    def pop(self):
        if not self.items:
            raise IndexError("pop from empty stack")
        return self.items.pop()

    def peek(self):
        return self.items[-1] if self.items else None
''',
    '''def parse_config(lines):
    config = {}
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, _, value = line.partition("=")
        config[key.strip()] = value.strip()
    return config
''',
    '''def binary_search(items, target):
    lo, hi = 0, len(items) - 1
    while lo <= hi:
        mid = (lo + hi) // 2
        if items[mid] == target:
            return mid
        if items[mid] < target:
            lo = mid + 1
        else:
            hi = mid - 1
    return -1
''',
]
ARTICLES = [
    "The city council voted on Tuesday to extend the bicycle lane network by forty kilometres. "
    "\"This is the largest expansion since the network opened,\" said the transport director, "
    "adding that construction would begin in the spring. Residents who spoke at the meeting were "
    "divided: some welcomed safer routes to schools, while shop owners on the main street warned "
    "that removing parking spaces would cost them customers.",
    "Researchers at the university have found that bees can recognise human faces. In the "
    "experiment, bees were shown photographs and rewarded with sugar water for choosing the "
    "correct one. \"We were surprised by how quickly they learned,\" the lead author said. The "
    "team believes the bees treat faces as patterns of light and dark rather than as faces.",
    "The library will close for renovation from the first of June until the end of September. "
    "During this time, books can be returned at the town hall, and a mobile library will visit "
    "each district once a week. \"We know this is an inconvenience,\" the head librarian said, "
    "\"but the new building will have twice as much space for children.\"",
    "A storm brought heavy rain and strong winds to the coast overnight, cutting power to about "
    "twelve thousand homes. The weather service said gusts reached one hundred and ten kilometres "
    "per hour near the harbour. \"Crews have been working since midnight,\" a spokesperson for the "
    "power company said, \"and we expect most customers to be reconnected by this evening.\"",
]


def prompts() -> list[str]:
    code = [f"Here is a Python function.\n\n{c}\nThe same code with a docstring and type hints:\n\n"
            for c in CODE]
    quote = [f"Article:\n{a}\n\nSummary of the article, quoting its key sentences word for word:\n"
             for a in ARTICLES]
    return code + quote


def run(level: int, spec: bool, max_tokens: int, k: int, dtype: str) -> dict:
    from flatserve import LLM, SamplingParams

    kw = {"speculative_method": "ngram", "num_speculative_tokens": k} if spec else {}
    llm = LLM(dtype=dtype, max_num_seqs=level, kv_cache_memory=512 * 2**20, max_model_len=2048, **kw)
    ps = (prompts() * 2)[:max(level, 8)]  # 8 prompts; at concurrency 1 they run one by one
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    llm.generate(ps[:1], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)  # warm
    eng = llm.engine
    base = (eng.spec.num_groups, eng.spec.num_draft_tokens, eng.spec.num_accepted_tokens)
    t0 = time.perf_counter()
    outs = llm.generate(ps, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    groups, drafts, acc = (a - b for a, b in zip(
        (eng.spec.num_groups, eng.spec.num_draft_tokens, eng.spec.num_accepted_tokens), base))
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"level": level, "spec": spec, "wall": wall, "out_tokens": n_out, "tok_s": n_out / wall,
            "verify_steps": groups, "drafts": drafts, "accepted": acc,
            "acceptance_rate": acc / max(drafts, 1),
            "mean_acceptance_length": (acc + groups) / max(groups, 1),
            "outputs": [o.outputs[0].token_ids for o in outs]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--levels", default="1,8")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--k", type=int, default=3)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", default="docs/benchmarks/spec_decode.json")
    a = ap.parse_args()
    rows = []
    for level in (int(x) for x in a.levels.split(",")):
        off, on = (run(level, spec, a.max_tokens, a.k, a.dtype) for spec in (False, True))
        # bf16: verifying k + 1 rows at once rounds differently from 1 row, so a near-tie can
        # flip; count the outputs that match to the last token.
        same = sum(x == y for x, y in zip(off["outputs"], on["outputs"]))
        on["identical_outputs"] = same
        for r in (off, on):
            rows.append(r)
        print(f"concurrency {level}: {off['tok_s']:.1f} -> {on['tok_s']:.1f} tok/s "
              f"({on['tok_s'] / off['tok_s']:.2f}x), acceptance {on['acceptance_rate']:.2f}, "
              f"mean acceptance length {on['mean_acceptance_length']:.2f}, identical outputs: {same}/{len(off['outputs'] or [])}",
              flush=True)
    for r in rows:
        r["outputs"] = None  # token lists: too long for the report
    with open(a.out, "w") as f:
        json.dump({"k": a.k, "max_tokens": a.max_tokens, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
