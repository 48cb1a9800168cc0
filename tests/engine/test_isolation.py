"""One request's bad values never reach the engine, and one request's failure stays its own.

Tiny random-weight Qwen3 (tests/conftest.py), fp32 on the CPU. Faults are injected two ways:
values written into a request's SamplingParams after validation (what a bug in validation
would let through: an out-of-vocabulary logit_bias id, a top_k past int64), and a sampler
method patched to raise for one marked request.
"""
from __future__ import annotations

import math
import random
from collections.abc import Iterator

import pytest

from flatserve import LLM, SamplingParams
from flatserve.engine.sampler import Sampler
from flatserve.engine.sampling_params import SEED_MOD, ParamError
from tests.conftest import VOCAB, build_checkpoint
from tests.server.live import no_cpp_builds


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> Iterator[LLM]:
    path, _ = build_checkpoint("qwen3", tmp_path_factory.mktemp("iso"))
    # The torch backend and no fused ops: nothing here needs the C++ kernels (or their build).
    with no_cpp_builds():
        yield LLM(model=str(path), dtype="float32", device="cpu", max_model_len=256,
                  num_gpu_blocks_override=200, max_num_seqs=16, attention_backend="torch",
                  fused_ops="none", cpu_gemm="torch")


BAD = [
    (dict(logit_bias={VOCAB: 1.0}), "logit_bias"),
    (dict(logit_bias={-1: 100.0}), "logit_bias"),
    (dict(logit_bias={-300000: 1.0}), "logit_bias"),
    (dict(logit_bias={10**23: 1.0}), "logit_bias"),
    (dict(logit_bias={5: float("nan")}), "logit_bias"),
    (dict(logit_bias={"5": 1.0}), "logit_bias"),
    (dict(stop_token_ids=[VOCAB + 3]), "stop_token_ids"),
    (dict(stop_token_ids=[-2]), "stop_token_ids"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(presence_penalty=float("-inf")), "presence_penalty"),
    (dict(n=10**9), "n"),
    (dict(n=2.0), "n"),
    (dict(max_tokens=1.5), "max_tokens"),
    (dict(max_tokens=0), "max_tokens"),
    (dict(top_k=-7), "top_k"),
    (dict(top_k="50"), "top_k"),
    (dict(logprobs=21), "logprobs"),
    (dict(logprobs=True), "logprobs"),
    (dict(seed=1.5), "seed"),
    (dict(stop=["a\ud800"]), "stop"),
]


@pytest.mark.parametrize("kw,param", BAD)
def test_bad_values_refused_naming_the_field(llm, kw, param) -> None:
    eng = llm.engine
    with pytest.raises(ParamError) as e:
        eng.add_request([5, 6, 7], SamplingParams(**kw))
    assert e.value.param == param, str(e.value)
    assert not eng.has_unfinished() and eng.num_used_blocks == 0


def test_bad_prompts_refused(llm) -> None:
    eng = llm.engine
    for prompt in ([5, VOCAB], [5, -1], [True, 5], "a\ud800b", "", []):
        with pytest.raises(ParamError) as e:
            eng.add_request(prompt, SamplingParams(max_tokens=2))
        assert e.value.param == "prompt"
    assert not eng.has_unfinished()


def test_huge_seed_reduced_deterministically_and_top_k_clamped(llm) -> None:
    prompt = [random.randrange(4, VOCAB) for _ in range(12)]
    big = 2**200 + 12345
    kw = dict(max_tokens=8, temperature=1.0, ignore_eos=True)
    a = llm.generate({"prompt_token_ids": prompt}, SamplingParams(seed=big, **kw), use_tqdm=False)
    b = llm.generate({"prompt_token_ids": prompt}, SamplingParams(seed=big % SEED_MOD, **kw),
                     use_tqdm=False)
    c = llm.generate({"prompt_token_ids": prompt}, SamplingParams(seed=-big, **kw), use_tqdm=False)
    assert a[0].outputs[0].token_ids == b[0].outputs[0].token_ids
    assert len(c[0].outputs[0].token_ids) == 8
    # top_k at or past the vocabulary is no top_k at all: same tokens as top_k disabled.
    d = llm.generate({"prompt_token_ids": prompt}, SamplingParams(seed=7, top_k=2**63, **kw),
                     use_tqdm=False)
    e = llm.generate({"prompt_token_ids": prompt}, SamplingParams(seed=7, **kw), use_tqdm=False)
    assert d[0].outputs[0].token_ids == e[0].outputs[0].token_ids


def test_tiny_repetition_penalty_gives_finite_logprobs(llm) -> None:
    out = llm.generate({"prompt_token_ids": [5, 6, 7, 5, 6]},
                       SamplingParams(max_tokens=6, temperature=0.7, seed=3, logprobs=5,
                                      repetition_penalty=1e-300, ignore_eos=True), use_tqdm=False)
    lps = out[0].outputs[0].logprobs
    assert len(lps) == 6
    assert all(math.isfinite(lp.logprob) for d in lps for lp in d.values())


def _mixed(rng: random.Random) -> list[tuple[list[int], SamplingParams]]:
    kinds = [SamplingParams(max_tokens=10, temperature=0, ignore_eos=True),
             SamplingParams(max_tokens=10, temperature=0.9, seed=rng.randrange(1 << 30), ignore_eos=True),
             SamplingParams(max_tokens=10, temperature=0, logprobs=2, ignore_eos=True),
             SamplingParams(max_tokens=10, temperature=0.8, top_k=20, n=2, seed=4, ignore_eos=True)]
    return [([rng.randrange(4, VOCAB) for _ in range(rng.randint(3, 40))], kinds[i % 4])
            for i in range(8)]


def _corrupt_bias(p: SamplingParams) -> None:
    p.logit_bias = {VOCAB + 5: 1.0}  # after validation: indexes past the logits row


def _corrupt_top_k(p: SamplingParams) -> None:
    p.top_k = 2**63  # after validation: overflows int64 in the sampler's tensors


@pytest.mark.parametrize("corrupt", [_corrupt_bias, _corrupt_top_k, "patched"])
def test_one_failing_request_leaves_the_batch_running(llm, corrupt, monkeypatch) -> None:
    seed = random.randrange(1 << 30)
    reqs = _mixed(random.Random(seed))
    ref = llm.generate([{"prompt_token_ids": p} for p, _ in reqs], [sp for _, sp in reqs],
                       use_tqdm=False)
    eng = llm.engine
    bad = SamplingParams(max_tokens=10, temperature=0.5, frequency_penalty=0.25, seed=1)
    if corrupt == "patched":
        orig = Sampler._penalise

        def boom(self, row, r):
            if r.req.params is bad:
                raise RuntimeError("injected sampling fault")
            return orig(self, row, r)

        monkeypatch.setattr(Sampler, "_penalise", boom)
    rids = [eng.add_request(p, sp) for p, sp in reqs[:4]]
    bad_id = eng.add_request([9, 10, 11], bad)
    rids += [eng.add_request(p, sp) for p, sp in reqs[4:]]
    if corrupt != "patched":
        corrupt(bad)
    done = {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
    assert done[bad_id].error and done[bad_id].outputs[0].finish_reason == "abort"
    for rid, r in zip(rids, ref):
        assert done[rid].error is None
        for x, y in zip(done[rid].outputs, r.outputs):
            assert x.token_ids == y.token_ids, f"seed={seed}"
            assert x.finish_reason == "length"
    assert eng.num_used_blocks == 0
    eng.kv.check_invariants()
