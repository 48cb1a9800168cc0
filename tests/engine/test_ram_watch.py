"""The memory budget on shared RAM counts other processes: at start (the plan uses the RAM
available then) and while serving (under the reserve the KV pool stops growing, and the
scheduler preempts or queues instead)."""
from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from flatserve import LLM, SamplingParams
from flatserve.engine.kv_manager import BlockPool
from flatserve.memory import GiB, BudgetRequest, MemoryProbe, RamWatch, plan
from tests.conftest import VOCAB, build_checkpoint
from tests.server.live import no_cpp_builds


def _req(**kw) -> BudgetRequest:
    return BudgetRequest(**{**dict(weights=1 * GiB, peak_activations=GiB // 2, bytes_per_block=2**20,
                                   block_size=16, model_max_len=4096, runtime=GiB // 2), **kw})


def test_plan_counts_ram_other_processes_hold() -> None:
    idle = plan(MemoryProbe(32 * GiB, 32 * GiB - GiB // 2, True, "cpu"), _req())
    busy = plan(MemoryProbe(32 * GiB, 12 * GiB, True, "cpu"), _req())
    # 32 GiB box, reserve 6: idle leaves 32-6-0.5-1-0.5 = 24 GiB for KV. Busy: others hold
    # 32 - 12 available - 0.5 ours = 19.5 GiB; they keep that plus the 1 GiB floor (20.5), not
    # just the reserve (6): 14.5 GiB more held back, 9.5 GiB for KV.
    assert idle.kv_budget == 24 * GiB and idle.others == 0 and idle.free_floor == GiB
    assert busy.others == 29 * GiB // 2
    assert busy.kv_budget == idle.kv_budget - busy.others == 19 * GiB // 2
    assert busy.num_blocks == busy.kv_budget // 2**20
    assert "other processes 14.50 GiB" in busy.startup_line()
    assert "(--kv-cache-memory overrides)" not in busy.startup_line()
    # At a full pool the busy box still has its floor free: 12 - 1 - 0.5 - 9.5 = 1 GiB.
    assert 12 * GiB - busy.weights - busy.peak - busy.kv_budget == busy.free_floor
    assert plan(MemoryProbe(32 * GiB, 12 * GiB, True, "cpu"), _req(os_reserve_gb=0)).free_floor == 0


def test_ram_watch_freezes_under_reserve_with_hysteresis() -> None:
    free = [10 * GiB]
    w = RamWatch(4 * GiB, lambda: free[0], interval=1.0, hysteresis=GiB // 4)
    assert not w.frozen_now(0.0)
    free[0] = 3 * GiB
    assert not w.frozen_now(0.5)  # read at most once per interval
    assert w.frozen_now(1.0) and w.num_freezes == 1
    free[0] = 4 * GiB + GiB // 8  # above the reserve, inside the hysteresis: still frozen
    assert w.frozen_now(2.0)
    free[0] = 5 * GiB
    assert not w.frozen_now(3.0)
    free[0] = 0
    assert w.frozen_now(4.0) and w.num_freezes == 2


def test_frozen_pool_reuses_but_maps_no_new_blocks() -> None:
    pool = BlockPool(100, enable_caching=False)
    a = pool.take(10)
    pool.release(a[:4])
    pool.limit_growth(0)  # no fresh block at all
    assert pool.num_free == 99 - 6 and pool.num_takeable == 4
    b = pool.take(4)
    assert sorted(b) == sorted(a[:4]) and pool.num_takeable == 0
    pool.limit_growth(12)  # the first 12 usable blocks: ids 11 and 12 may still be mapped
    assert pool.num_takeable == 2 and pool.take(2) == [11, 12] and pool.num_takeable == 0
    pool.limit_growth(None)
    assert pool.num_takeable == 87 and pool.take(1) == [13]


@pytest.fixture(scope="module")
def llm(tmp_path_factory) -> Iterator[LLM]:
    path, _ = build_checkpoint("qwen3", tmp_path_factory.mktemp("ram"))
    with no_cpp_builds():
        yield LLM(model=str(path), dtype="float32", device="cpu", max_model_len=256,
                  num_gpu_blocks_override=400, max_num_seqs=16, attention_backend="torch",
                  fused_ops="none", cpu_gemm="torch", enable_prefix_caching=False)


def _run(eng, prompts: list[list[int]], sp: SamplingParams, max_steps: int = 3000) -> list:
    """Step the engine to the end; a livelock (no progress) fails instead of hanging."""
    rids = [eng.add_request(p, sp) for p in prompts]
    done = {}
    for _ in range(max_steps):
        for o in eng.step():
            if o.finished:
                done[o.request_id] = o
        if not eng.has_unfinished():
            return [done[r] for r in rids]
    raise AssertionError(f"no end after {max_steps} steps: {eng.stats()}")


def test_low_ram_stops_pool_growth_and_requests_still_finish(llm) -> None:
    rng = random.Random()
    seed = rng.randrange(1 << 30)
    rng.seed(seed)
    eng = llm.engine
    assert eng.ram_watch is not None
    eng.ram_watch.available, eng.ram_watch.interval = (lambda: 1 << 62), 0.0  # plenty of RAM
    sp = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    prompts = [[rng.randrange(4, VOCAB) for _ in range(rng.randint(20, 60))] for _ in range(6)]
    ref = _run(eng, prompts, sp)
    held = eng.kv.pool.fresh_next  # blocks ever mapped so far
    # Now other processes take the RAM: available is under the reserve from here on.
    eng.ram_watch.available = lambda: 0
    # Twice the sequences at once: they need more blocks than the pool has mapped.
    more = prompts + [[rng.randrange(4, VOCAB) for _ in range(60)] for _ in range(6)]
    outs = _run(eng, more, sp)
    assert eng.kv.pool.fresh_next == held, "the pool mapped new blocks under the reserve"
    for o, r in zip(outs, ref):
        assert o.outputs[0].token_ids == r.outputs[0].token_ids, f"seed={seed}"
    assert all(len(o.outputs[0].token_ids) == 24 for o in outs)
    assert eng.num_used_blocks == 0
    eng.kv.check_invariants()
    eng.ram_watch.available = lambda: 1 << 62  # RAM back: growth resumes
    _run(eng, more, sp)
    assert eng.kv.pool.fresh_next > held
