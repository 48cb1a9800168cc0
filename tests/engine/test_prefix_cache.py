"""Prefix caching end to end: identical outputs, only new tokens prefilled, sliding windows, abort."""
from __future__ import annotations

import random

import pytest

from flatserve import LLM, SamplingParams


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    from tests.conftest import build_checkpoint

    root = tmp_path_factory.mktemp("pc")
    return {f: build_checkpoint(f, root)[0] for f in ("qwen3", "gemma3")}


def _conversation(rng: random.Random, turns: int) -> list[list[int]]:
    """Each turn resends the whole history plus a new message (an agent's growing prefix)."""
    history: list[int] = [1]
    prompts = []
    for _ in range(turns):
        history = history + [rng.randrange(4, 512) for _ in range(rng.randint(5, 60))]
        prompts.append(list(history))
        history = history + [rng.randrange(4, 512) for _ in range(rng.randint(3, 20))]  # "reply"
    return prompts


@pytest.mark.parametrize("family", ["qwen3", "gemma3"])
def test_outputs_identical_with_and_without_caching(ckpts, family: str) -> None:
    rng = random.Random()
    convs = [_conversation(rng, 5) for _ in range(3)]
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    results = {}
    for caching in (True, False):
        llm = LLM(device="cpu", model=str(ckpts[family]), dtype="float32", num_gpu_blocks_override=200,
                  max_model_len=1024, enable_prefix_caching=caching, max_num_batched_tokens=64)
        outs = []
        for turn in range(5):  # turn by turn, as a client would send them
            batch = [{"prompt_token_ids": c[turn]} for c in convs]
            outs += [o.outputs[0].token_ids for o in llm.generate(batch, params, use_tqdm=False)]
        results[caching] = (outs, llm.engine.runner.num_forward_tokens, llm.engine.kv)
    assert results[True][0] == results[False][0]
    assert results[True][1] < results[False][1], "caching must skip recomputation"
    kv = results[True][2]
    assert kv.hit_tokens > 0 and kv.num_used_blocks == 0


def test_shared_prefix_prefills_only_new_tokens(ckpts) -> None:
    llm = LLM(device="cpu", model=str(ckpts["qwen3"]), dtype="float32", num_gpu_blocks_override=100, max_model_len=512)
    rng = random.Random()
    prefix = [rng.randrange(4, 512) for _ in range(160)]  # 10 full blocks
    p = SamplingParams(max_tokens=1, temperature=0)
    llm.generate([{"prompt_token_ids": prefix + [7, 8, 9]}], p, use_tqdm=False)
    before = llm.engine.runner.num_forward_tokens
    out = llm.generate([{"prompt_token_ids": prefix + [10, 11, 12, 13]}], p, use_tqdm=False)[0]
    ran = llm.engine.runner.num_forward_tokens - before
    assert out.num_cached_tokens == 160 and ran == 4
    # A prompt that is entirely cached still recomputes its last token for the logits.
    before = llm.engine.runner.num_forward_tokens
    out = llm.generate([{"prompt_token_ids": prefix}], p, use_tqdm=False)[0]
    assert llm.engine.runner.num_forward_tokens - before == 16  # the last block is recomputed
    assert out.num_cached_tokens == 144


def test_abort_mid_prefill_leaves_no_blocks(ckpts) -> None:
    llm = LLM(device="cpu", model=str(ckpts["qwen3"]), dtype="float32", num_gpu_blocks_override=100,
              max_model_len=512, max_num_batched_tokens=32)
    eng = llm.engine
    rid = eng.add_request(list(range(4, 300)), SamplingParams(max_tokens=5))
    eng.step()
    assert eng.num_used_blocks > 0
    eng.abort(rid)
    assert eng.num_used_blocks == 0
    eng.kv.check_invariants()
