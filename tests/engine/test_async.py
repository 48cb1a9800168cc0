"""Async scheduling (step N+1 scheduled before step N's tokens are read) changes no output.

Runs on the CPU: the mechanism (pending tokens read from the previous step's device tensor,
counts committed at launch, late stops, preemption with a token in flight) is the same code the
GPU runs; only the overlap is missing here.
"""
from __future__ import annotations

import random

import pytest

from flatserve import LLM, SamplingParams
from tests.conftest import engine_families
from flatserve.engine.request import Request
from flatserve.engine.scheduler import Scheduler, SchedulerConfig
from flatserve.engine.kv_manager import KVCacheManager


def _requests(rng: random.Random, stop_tok: int, stop_str: str) -> list[tuple[list[int], SamplingParams]]:
    """Fresh prompts with every parameter the pending-token path touches."""
    kinds = [
        SamplingParams(max_tokens=rng.randint(1, 24), temperature=0, ignore_eos=True),
        SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=rng.randrange(1 << 20)),
        SamplingParams(max_tokens=20, temperature=0, stop_token_ids=[stop_tok], logprobs=3),
        SamplingParams(max_tokens=20, temperature=0, stop=[stop_str]),
        SamplingParams(max_tokens=12, temperature=1.0, seed=5, min_tokens=6, top_k=20),
        SamplingParams(max_tokens=16, temperature=0.9, n=2, seed=rng.randrange(1 << 20)),
    ]
    out = []
    for i in range(18):
        p = kinds[i % len(kinds)]
        out.append(([rng.randrange(4, 500) for _ in range(rng.randint(1, 160))], p))
    return out


def _run(path, reqs, **kw) -> tuple[list, LLM]:
    llm = LLM(device="cpu", model=str(path), dtype="float32", max_model_len=256, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in reqs], [sp for _, sp in reqs],
                        use_tqdm=False)
    return outs, llm


@engine_families
@pytest.mark.parametrize("mode", ["plain", "chunked+preempt", "penalties"])
def test_async_outputs_equal_sync(tiny_checkpoint, mode) -> None:
    family, path, _ = tiny_checkpoint
    seed = random.randrange(1 << 30)
    rng = random.Random(seed)
    kw: dict = dict(max_num_seqs=8)
    if mode == "chunked+preempt":  # 32-token chunks; 17 blocks of 16 cannot hold 8 sequences
        kw.update(max_num_batched_tokens=32, num_gpu_blocks_override=18)
    # Stop id and stop string taken from a plain greedy run so that they do fire.
    probe, _ = _run(path, [([7, 8, 9], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))])
    toks, text = probe[0].outputs[0].token_ids, probe[0].outputs[0].text
    reqs = _requests(rng, toks[4], text[len(text) // 2:len(text) // 2 + 3] or "w")
    if mode == "penalties":  # history-reading requests force synchronous steps between async ones
        reqs[3] = (reqs[3][0], SamplingParams(max_tokens=20, temperature=0, repetition_penalty=1.3,
                                              frequency_penalty=0.5))
    ref, _ = _run(path, reqs, async_scheduling=False, **kw)
    got, llm = _run(path, reqs, async_scheduling=True, **kw)
    assert llm.engine.async_mode
    for a, b in zip(got, ref):
        for x, y in zip(a.outputs, b.outputs):
            assert x.token_ids == y.token_ids, f"{family} {mode} seed={seed}"
            assert (x.text, x.finish_reason) == (y.text, y.finish_reason), f"seed={seed}"
            if y.logprobs:
                assert [sorted(d) for d in x.logprobs] == [sorted(d) for d in y.logprobs]
    eng = llm.engine
    assert eng.num_used_blocks == 0 and not eng.has_unfinished()
    eng.kv.check_invariants()
    if mode == "chunked+preempt":
        assert eng.scheduler.num_preemptions > 0


@engine_families
def test_async_abort_mid_flight(tiny_checkpoint) -> None:
    """Aborts while a token is in flight free every block; the other requests are untouched."""
    _, path, _ = tiny_checkpoint
    rng = random.Random()
    prompts = [[rng.randrange(4, 500) for _ in range(rng.randint(5, 80))] for _ in range(6)]
    sp = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    ref, _ = _run(path, [(p, sp) for p in prompts], async_scheduling=False)
    llm = LLM(device="cpu", model=str(path), dtype="float32", max_model_len=256, async_scheduling=True)
    eng = llm.engine
    ids = [eng.add_request(p, sp) for p in prompts]
    done = {}
    for step in range(200):
        if step == 3:
            assert eng.abort(ids[1]) and eng.abort(ids[4])
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
        if not eng.has_unfinished():
            break
    assert set(done) == {ids[i] for i in (0, 2, 3, 5)}
    for i in (0, 2, 3, 5):
        assert done[ids[i]].outputs[0].token_ids == ref[i].outputs[0].token_ids
    assert eng.num_used_blocks == 0
    eng.kv.check_invariants()


def test_scheduler_schedules_a_pending_token_once() -> None:
    """Torch-free: commit counts the launched step; the next step takes the pending token."""
    kv = KVCacheManager(64, 16, enable_caching=False)
    s = Scheduler(SchedulerConfig(8, 64, 512, async_scheduling=True), kv)
    req = Request("a", list(range(1, 21)), SamplingParams(max_tokens=3, ignore_eos=True), 3)
    s.add_request(req)
    out = s.schedule()
    assert [(x.start_pos, x.num_tokens, x.samples) for x in out.scheduled] == [(0, 20, True)]
    s.commit(out)
    assert (req.num_computed_tokens, req.num_pending) == (20, 1)
    out2 = s.schedule()  # before step 1's token is read
    assert [(x.start_pos, x.num_tokens, x.samples) for x in out2.scheduled] == [(20, 1, True)]
    assert out2.scheduled[0].new_token_ids == []  # the runner reads it on the device
    s.commit(out2)
    s.update(out, {"a": [99]})
    assert req.token_ids[-1] == 99 and req.num_pending == 1
    out3 = s.schedule()  # computes 98 (still pending) at position 21, samples output 3
    assert [(x.start_pos, x.num_tokens, x.samples) for x in out3.scheduled] == [(21, 1, True)]
    s.commit(out3)
    s.update(out2, {"a": [98]})
    out4 = s.schedule()  # 2 outputs known + 1 pending = max_tokens: nothing left to compute
    assert out4.is_empty
    s.update(out3, {"a": [97]})
    assert req.status.finished and req.output_token_ids == [99, 98, 97]
    assert kv.num_used_blocks == 0 and req.num_pending == 0


@engine_families
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_request_metrics_are_stamped_in_order(tiny_checkpoint, async_scheduling) -> None:
    """RequestOutput.metrics (vLLM's shape): arrival <= first token <= finish; one-token requests
    finish on the step of their first token, longer ones strictly later."""
    _, path, _ = tiny_checkpoint
    rng = random.Random()
    reqs = [([rng.randrange(4, 500) for _ in range(rng.randint(1, 100))],
             SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)) for n in (1, 1, 5, 9, 17)]
    outs, _ = _run(path, reqs, async_scheduling=async_scheduling)
    for o, (_, sp) in zip(outs, reqs):
        m = o.metrics
        assert m is not None and m.first_token_time is not None and m.finished_time is not None
        assert m.arrival_time <= m.first_token_time <= m.finished_time
        assert m.time_to_first_token == m.first_token_time - m.arrival_time
        if sp.max_tokens == 1:
            assert m.finished_time == m.first_token_time
        else:
            assert m.finished_time > m.first_token_time
