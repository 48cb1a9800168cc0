"""RequestOutputKind: DELTA outputs concatenate to the CUMULATIVE ones; FINAL_ONLY emits once."""
from __future__ import annotations

import random

import pytest

from flatserve import LLM, SamplingParams
from flatserve.engine.outputs import RequestOutputKind
from tests.conftest import build_checkpoint


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path, _ = build_checkpoint("qwen3", tmp_path_factory.mktemp("ckpt"))
    return LLM(model=str(path), device="cpu", dtype="float32", attention_backend="torch",
               max_model_len=256, kv_cache_memory=1 << 26)


def _run(llm, kind: RequestOutputKind, prompts, seed: int, stop=None) -> dict[str, list]:
    eng = llm.engine
    got: dict[str, list] = {}
    for i, p in enumerate(prompts):
        params = SamplingParams(max_tokens=random.Random(seed + i).randint(5, 30), temperature=1.0,
                                seed=seed + i, logprobs=2, n=2, stop=stop, output_kind=kind)
        got[eng.add_request(p, params)] = []
    while eng.has_unfinished():
        for out in eng.step():
            got[out.request_id].append(out)
    return got


@pytest.mark.parametrize("stop", [None, ["a b"]])
def test_delta_outputs_add_up_to_the_cumulative_ones(llm, stop) -> None:
    rng = random.Random()
    seed = rng.randrange(1 << 20)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randint(3, 40))] for _ in range(5)]
    cum = _run(llm, RequestOutputKind.CUMULATIVE, prompts, seed, stop)
    dlt = _run(llm, RequestOutputKind.DELTA, prompts, seed, stop)
    fin = _run(llm, RequestOutputKind.FINAL_ONLY, prompts, seed, stop)
    for a, b, f in zip(cum.values(), dlt.values(), fin.values()):
        assert len(f) == 1 and f[0].finished  # one output, at the end
        last = a[-1]
        for k in range(2):
            text = "".join(o.outputs[k].text for o in b)
            ids = [t for o in b for t in o.outputs[k].token_ids]
            lps = [d for o in b for d in o.outputs[k].logprobs]
            assert text == last.outputs[k].text == f[0].outputs[k].text
            assert ids == last.outputs[k].token_ids == f[0].outputs[k].token_ids
            # Two runs of the engine batch differently, so fp32 logprobs may differ in the last
            # bits (seen: 5e-7); which tokens and ranks they hold must not.
            ref = last.outputs[k].logprobs
            assert len(lps) == len(ref)
            for d, r in zip(lps, ref):
                assert d.keys() == r.keys()
                assert all(abs(d[t].logprob - r[t].logprob) < 1e-4 and d[t].rank == r[t].rank
                           for t in d)
            assert b[-1].outputs[k].finish_reason == last.outputs[k].finish_reason
