"""Scheduler without a model: token budget, chunked prefill beside decodes, preemption, abort."""
from __future__ import annotations

import random

from hypothesis import given, settings, strategies as st

from flatserve.engine.kv_manager import KVCacheManager
from flatserve.engine.request import Request, RequestStatus
from flatserve.engine.sampling_params import SamplingParams
from flatserve.engine.scheduler import Scheduler, SchedulerConfig


def _sched(blocks: int = 64, budget: int = 32, seqs: int = 8, caching: bool = False) -> Scheduler:
    kv = KVCacheManager(blocks, 4, enable_caching=caching)
    # As the memory budget guarantees: one max_model_len sequence always fits in the pool.
    max_len = min(256, (blocks - 1) * 4)
    return Scheduler(SchedulerConfig(seqs, budget, max_len), kv, eos_token_ids=frozenset({0}))


def _req(rid: str, n: int, max_tokens: int = 4) -> Request:
    return Request(rid, [1 + (i % 50) for i in range(n)], SamplingParams(max_tokens=max_tokens),
                   max_tokens)


def _step(s: Scheduler, token: int = 5):
    out = s.schedule()
    new = {x.request.request_id: [token] for x in out.scheduled if x.samples}
    return out, s.update(out, new)


def test_long_prompt_is_chunked_while_decodes_keep_running() -> None:
    s = _sched(budget=16)
    s.add_request(_req("short", 3, max_tokens=20))
    _step(s)  # short's prompt done, it now decodes
    s.add_request(_req("long", 50))
    seen_chunks = []
    for _ in range(4):
        out, _ = _step(s)
        by_id = {x.request.request_id: x.num_tokens for x in out.scheduled}
        assert by_id.get("short") == 1, "the decode runs every step"
        seen_chunks.append(by_id.get("long", 0))
        assert out.num_batched_tokens <= 16
    assert seen_chunks == [15, 15, 15, 5]


def test_preemption_frees_newest_and_everyone_finishes() -> None:
    s = _sched(blocks=9, budget=64)  # 8 usable blocks of 4 tokens = 32 tokens
    for i in range(3):
        s.add_request(_req(f"r{i}", 8, max_tokens=8))  # each needs 4 blocks at the end
    finished = []
    for _ in range(200):
        if not s.has_unfinished():
            break
        _, done = _step(s)
        finished += [r.request_id for r in done]
    assert sorted(finished) == ["r0", "r1", "r2"]
    assert s.num_preemptions > 0
    assert s.kv.num_used_blocks == 0


def test_abort_at_any_time_frees_blocks() -> None:
    s = _sched()
    s.add_request(_req("a", 30))
    s.add_request(_req("b", 5))
    _step(s)
    s.abort("a")
    assert s.kv.block_ids("a") == []
    s.abort("b")
    assert s.kv.num_used_blocks == 0 and not s.has_unfinished()


def test_stops_on_eos_and_length() -> None:
    s = _sched()
    s.add_request(_req("e", 3, max_tokens=10))
    _, done = _step(s, token=0)
    assert done[0].status == RequestStatus.FINISHED_STOPPED
    s.add_request(_req("l", 3, max_tokens=2))
    _step(s)
    _, done = _step(s)
    assert done[0].status == RequestStatus.FINISHED_LENGTH and done[0].num_output_tokens == 2


def test_max_model_len_enforced_at_admission() -> None:
    s = _sched()
    try:
        s.add_request(_req("x", 256))
    except ValueError as e:
        assert "256" in str(e)
    else:
        raise AssertionError("accepted a prompt of max_model_len tokens")


@settings(max_examples=60, deadline=None)
@given(st.integers(0, 2**31), st.integers(4, 40), st.integers(6, 40))
def test_random_traffic_budget_never_exceeded_and_no_leak(seed: int, budget: int, blocks: int) -> None:
    rng = random.Random(seed)
    s = _sched(blocks=blocks, budget=budget, seqs=4, caching=rng.random() < 0.5)
    nreq = 0
    for _ in range(150):
        if rng.random() < 0.3 and nreq < 12:
            n = rng.randint(1, min(20, s.cfg.max_model_len - 1))
            s.add_request(_req(f"r{nreq}", n, rng.randint(1, 6)))
            nreq += 1
        if rng.random() < 0.05 and s.requests:
            s.abort(rng.choice(sorted(s.requests)))
        out, _ = _step(s, token=rng.randint(1, 9))
        assert out.num_batched_tokens <= budget
        assert len(s.running) <= 4
        s.kv.check_invariants()
    for _ in range(2000):
        if not s.has_unfinished():
            break
        _step(s)
    assert not s.has_unfinished(), "requests starved"
    assert s.kv.num_used_blocks == 0


def test_drafts_count_in_the_budget_and_rejections_roll_back() -> None:
    s = _sched(budget=6)
    s.add_request(_req("a", 6, max_tokens=20))
    _step(s)  # prompt done: 7 known tokens, 6 computed, blocks cover 7 tokens (2 of 4)
    req = s.requests["a"]
    req.spec_token_ids = [10, 11, 12, 13, 14, 15, 16]  # 1 known + 7 drafts > the budget of 6
    out = s.schedule()
    (x,) = out.scheduled
    assert x.num_tokens == 6 and x.spec_token_ids == [10, 11, 12, 13, 14]  # the budget cuts drafts
    assert x.new_token_ids == [5, 10, 11, 12, 13, 14] and x.samples
    assert len(s.kv.block_ids("a")) == 3  # slots for 12 tokens
    s.update(out, {"a": [10, 11, 99]})  # 2 drafts accepted, then the target's own token
    assert req.output_token_ids == [5, 10, 11, 99] and req.spec_token_ids == []
    assert req.num_computed_tokens == 9 == req.num_tokens - 1  # the 3 rejected drafts' KV is gone
    assert len(s.kv.block_ids("a")) == 3  # 10 tokens need 3 blocks: nothing else held
    req.spec_token_ids = [1]
    out = s.schedule()
    s.update(out, {"a": [2]})  # the draft rejected at once
    assert req.num_computed_tokens == 10 and len(s.kv.block_ids("a")) == 3
    s.kv.check_invariants()


def test_rejected_drafts_give_back_their_blocks() -> None:
    s = _sched(blocks=20, budget=32)
    s.add_request(_req("a", 3, max_tokens=30))
    _step(s)  # 4 known tokens: 1 block
    req = s.requests["a"]
    req.spec_token_ids = list(range(20, 30))  # 10 drafts: slots for 14 tokens = 4 blocks
    out = s.schedule()
    assert len(s.kv.block_ids("a")) == 4
    free_before = s.kv.num_free_blocks
    s.update(out, {"a": [7]})  # all rejected: 5 known tokens need 2 blocks
    assert len(s.kv.block_ids("a")) == 2 and s.kv.num_free_blocks == free_before + 2
    s.kv.check_invariants()
