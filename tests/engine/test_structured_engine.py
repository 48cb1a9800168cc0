"""Grammar-constrained generation through the whole engine on the default model, with n-gram
speculative decoding on: drafted tokens are verified against the grammar (a refused draft is
rejected, the matcher rolls back), so every emitted token stays inside the grammar."""
from __future__ import annotations

import json

import pytest

xgr = pytest.importorskip("xgrammar")
jsonschema = pytest.importorskip("jsonschema")

from flatserve import LLM, SamplingParams  # noqa: E402
from flatserve.engine.sampling_params import StructuredOutputs  # noqa: E402

# Repetitive records: the n-gram proposer finds drafts in the output's own keys and braces.
SCHEMA = {"type": "array", "minItems": 2, "maxItems": 4, "items": {
    "type": "object", "additionalProperties": False, "required": ["id", "ok"],
    "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}}}}


@pytest.fixture(scope="module")
def llm(default_model_path) -> LLM:
    return LLM(device="cpu", attention_backend="torch", fused_ops="none", cpu_gemm="torch",
               enforce_eager=True, kv_cache_memory=256 << 20, max_model_len=512,
               max_num_batched_tokens=256, speculative_method="ngram", num_speculative_tokens=3,
               prompt_lookup_min=1, prompt_lookup_max=3)


def test_ngram_drafts_never_leave_the_grammar(llm: LLM) -> None:
    spec = StructuredOutputs(json=SCHEMA)
    prompts = [f'Records {i}: [{{"id": 1, "ok": true}}, {{"id": 2, "ok": false}}] again:' for i in range(4)]
    outs = llm.generate(prompts, SamplingParams(max_tokens=80, temperature=1.0, seed=5,
                                                structured_outputs=spec), use_tqdm=False)
    compiled = llm.engine.grammars.submit(spec).result()
    eos = sorted(llm.engine.state.eos_token_ids)
    for o in outs:
        c = o.outputs[0]
        m = xgr.GrammarMatcher(compiled, override_stop_tokens=eos)
        for t in c.token_ids:  # every emitted token (drafts accepted included) is grammatical
            assert m.accept_token(t), (c.text, t)
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.text), SCHEMA)
    assert llm.engine.spec.num_draft_tokens > 0  # the verify path really ran


def test_bad_grammar_fails_the_call_and_the_engine_still_serves(llm: LLM) -> None:
    with pytest.raises(ValueError, match="regex"):
        llm.generate(["x"], SamplingParams(max_tokens=4, structured_outputs=StructuredOutputs(
            regex="(open")), use_tqdm=False)
    assert not llm.engine.has_unfinished() and llm.engine.num_used_blocks == 0
    out = llm.generate(["Pick one:"], SamplingParams(max_tokens=6, temperature=1.0,
                                                     structured_outputs=StructuredOutputs(
                                                         choice=["left", "right"])), use_tqdm=False)
    assert out[0].outputs[0].text in ("left", "right")


def test_a_compiling_grammar_does_not_stall_other_requests(llm: LLM, monkeypatch) -> None:
    """The compile runs on the grammar thread: while it is held, an unconstrained request beside
    it is served to the end; released, the constrained one runs and keeps its grammar."""
    import random
    import re
    import threading

    grammars = llm.engine.grammars
    release, entered = threading.Event(), threading.Event()
    compile_ = grammars._compile

    def held(spec):  # noqa: ANN001, ANN202 - the cache's own signature
        entered.set()
        assert release.wait(60), "the test never released the compile"
        return compile_(spec)

    monkeypatch.setattr(grammars, "_compile", held)
    pattern = f"(yes|no)-{random.randrange(10**6)}-[a-z]{{3}}"  # a spec no earlier test compiled
    eng = llm.engine
    held_id = eng.add_request("Answer:", SamplingParams(
        max_tokens=16, temperature=1.0, structured_outputs=StructuredOutputs(regex=pattern)))
    free_id = eng.add_request("Once upon a time", SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    done: dict[str, str] = {}
    for _ in range(200):
        done.update({o.request_id: o.outputs[0].text for o in eng.step() if o.finished})
        if free_id in done:
            break
    assert entered.is_set() and free_id in done and held_id not in done
    release.set()
    for _ in range(400):
        if held_id in done:
            break
        done.update({o.request_id: o.outputs[0].text for o in eng.step() if o.finished})
    assert re.fullmatch(pattern, done[held_id]), done[held_id]
    assert not eng.has_unfinished() and eng.num_used_blocks == 0
