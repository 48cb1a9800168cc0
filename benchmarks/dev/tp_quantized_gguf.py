"""A GGUF kept quantized under tensor parallelism (flatserve/distributed/quant_shards.py) against
TP=1: greedy tokens and rank 0's block bytes per format (the engine's weight_formats).

    .venv/bin/python benchmarks/dev/tp_quantized_gguf.py [--model PATH] [--tp 2] [--tokens 24]

Default: the embedded default model (Gemma 3 270M, Q4_K_M) on the CPU.
"""
from __future__ import annotations

import argparse
import sys

sys.path.insert(0, ".")


def main() -> None:  # ranks are spawned: this module must not start engines on import
    from flatserve import LLM, SamplingParams
    from flatserve.model.loader import default_model_path

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--prompt", default="The capital of France is")
    a = ap.parse_args()
    path = a.model or str(default_model_path())
    toks = {}
    for tp in (1, a.tp):
        with LLM(model=path, tensor_parallel_size=tp, max_model_len=512) as llm:
            out = llm.generate([a.prompt], SamplingParams(max_tokens=a.tokens, temperature=0),
                               use_tqdm=False)[0].outputs[0]
            fmts = {f: b for f, _, b in llm.engine.state.weight_formats}
            toks[tp] = out.token_ids
            print(f"TP={tp}: rank 0 holds {sum(fmts.values()) / 1e6:.1f} MB of weights in linears "
                  f"{ {f: round(b / 1e6, 2) for f, b in fmts.items()} }; text {out.text!r}")
    print(f"greedy tokens equal: {toks[1] == toks[a.tp]} ({len(toks[1])} tokens)")


if __name__ == "__main__":
    main()
