"""Memory on this machine with the default model: the start-up line, KV capacity, and peak RSS
at 1, 16 and 64 concurrent requests, beside the tokens a padded [B, H, T_max, D] cache would hold.

    python benchmarks/memory_cpu.py

Runtime (estimate, not timed): a few minutes on a 2-core CPU (three engines, the 64-request run's
prompts of up to 1,500 tokens dominate). Writes bench_out/memory_cpu.json.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys

sys.path.insert(0, ".")

CHILD = r"""
import json, random, sys, logging
logging.basicConfig(level=logging.INFO, format="%(message)s")
from flatserve import LLM, SamplingParams
n = int(sys.argv[1])
llm = LLM(max_model_len=4096)
b = llm.engine.state.budget
rng = random.Random(n)
W = "the of and a to in is you that it he was for on are as with his they".split()
prompts = [" ".join(rng.choice(W) for _ in range(rng.randint(10, 1500))) for _ in range(n)]
print("READY", flush=True)
outs = llm.generate(prompts, SamplingParams(max_tokens=64, temperature=0, ignore_eos=True), use_tqdm=False)
lens = [len(o.prompt_token_ids) + 64 for o in outs]
print("RESULT " + json.dumps({"line": b.startup_line(), "capacity": b.token_capacity,
      "flat_tokens": sum(lens), "padded_tokens": len(lens) * max(lens),
      "budget": b.total - b.reserve, "preemptions": llm.engine.scheduler.num_preemptions}), flush=True)
"""


def run(n: int) -> dict:
    from flatserve.bench.serve import RssSampler

    p = subprocess.Popen([sys.executable, "-c", CHILD, str(n)], stdout=subprocess.PIPE, text=True)
    with RssSampler(p.pid, interval=0.05) as rss:
        out, _ = p.communicate()
    peak = rss.peak or 0
    r = json.loads(next(x for x in out.splitlines() if x.startswith("RESULT "))[7:])
    r.update(requests=n, peak_rss=peak)
    return r


def main() -> None:
    argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter).parse_args()
    rows = [run(n) for n in (1, 16, 64)]
    print(rows[0]["line"])
    print("| requests | peak RSS GiB | flat KV tokens | padded KV tokens | padding waste |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['requests']} | {r['peak_rss'] / 2**30:.2f} | {r['flat_tokens']} | "
              f"{r['padded_tokens']} | {r['padded_tokens'] / r['flat_tokens']:.2f}x |")
    os.makedirs("bench_out", exist_ok=True)
    json.dump(rows, open("bench_out/memory_cpu.json", "w"), indent=1)


if __name__ == "__main__":
    random.seed(0)
    main()
