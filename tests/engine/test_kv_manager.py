"""KV manager without torch: allocation, sharing, eviction order, leaks (property test)."""
from __future__ import annotations

import sys

from hypothesis import given, settings, strategies as st

from flatserve.engine.kv_manager import KVCacheManager
from flatserve.engine.request import Request
from flatserve.engine.sampling_params import SamplingParams


def _req(rid: str, tokens: list[int]) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=8), 8)


def test_module_imports_no_torch() -> None:
    import subprocess

    code = ("import sys; import flatserve.engine.kv_manager, flatserve.engine.scheduler; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def test_allocate_counts_blocks_and_frees_everything() -> None:
    kv = KVCacheManager(num_blocks=10, block_size=4, enable_caching=False)
    r = _req("a", list(range(9)))
    assert len(kv.allocate_slots(r, 9)) == 3  # ceil(9 / 4)
    r.num_computed_tokens = 9
    assert len(kv.allocate_slots(r, 3)) == 3  # 12 tokens still fit in 3 blocks
    r.num_computed_tokens = 12
    assert len(kv.allocate_slots(r, 1)) == 4
    assert kv.num_used_blocks == 4
    assert kv.allocate_slots(_req("b", list(range(40))), 40) is None  # 10 > 9 - 4 free
    kv.free("a")
    assert kv.num_used_blocks == 0
    kv.check_invariants()


def test_prefix_hit_shares_blocks_without_copy_and_recomputes_last_token() -> None:
    kv = KVCacheManager(num_blocks=20, block_size=4)
    a = _req("a", list(range(12)))
    blocks_a = list(kv.allocate_slots(a, 12))
    b = _req("b", list(range(12)))  # the same 12 tokens: 3 full blocks
    hit, n = kv.get_computed_blocks(b)
    assert n == 8 and hit == blocks_a[:2], "last block is recomputed to get logits"
    blocks_b = kv.allocate_slots(b, 12 - n, hit)
    assert blocks_b[:2] == blocks_a[:2] and blocks_b[2] != blocks_a[2]
    assert kv.pool.blocks[blocks_a[0]].ref_cnt == 2
    kv.check_invariants()


def test_reset_prefix_cache_forgets_prefixes_only_when_nothing_is_held() -> None:
    kv = KVCacheManager(num_blocks=20, block_size=4)
    a = _req("a", list(range(12)))
    kv.allocate_slots(a, 12)
    assert not kv.reset_prefix_cache()  # a holds blocks: nothing changes
    assert kv.get_computed_blocks(_req("x", list(range(12))))[1] == 8
    kv.free("a")
    assert kv.get_computed_blocks(_req("y", list(range(12))))[1] == 8  # freed, still cached
    assert kv.reset_prefix_cache()
    assert kv.get_computed_blocks(_req("z", list(range(12)))) == ([], 0)
    assert kv.pool.num_free == 19 and not kv.pool.free and not kv.pool.cached
    kv.check_invariants()


def test_freed_blocks_stay_cached_and_evict_lru() -> None:
    kv = KVCacheManager(num_blocks=5, block_size=2)  # 4 usable
    a, b = _req("a", [1, 2, 3]), _req("b", [7, 8, 9])
    kv.allocate_slots(a, 3)
    kv.allocate_slots(b, 3)
    kv.free("a")  # a's full block [1,2] is cached with ref 0
    kv.free("b")  # then b's [7,8]: least recently freed is a's
    c = _req("c", [1, 2, 5])
    hit, n = kv.get_computed_blocks(c)
    assert n == 2, "a's prefix survived being freed"
    # A new request that needs every free block evicts in LRU order: a's tail, a's head, ...
    d = _req("d", [40, 41, 42, 43, 44, 45, 46])
    kv.allocate_slots(d, 7)  # 4 blocks: all of them, every cached hash is gone
    assert kv.get_computed_blocks(_req("e", [1, 2, 3]))[1] == 0
    kv.free("d")
    kv.check_invariants()


def test_eviction_order_prefers_least_recently_freed() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2)  # 3 usable
    kv.allocate_slots(_req("old", [1, 2]), 2)
    kv.free("old")  # its cached block enters the eviction queue first
    kv.allocate_slots(_req("new", [3, 4]), 2)  # a never-used block: nothing evicted yet
    kv.free("new")
    kv.allocate_slots(_req("x", [9, 9, 9, 9]), 4)  # the last fresh block, then the LRU one
    assert kv.get_computed_blocks(_req("o2", [1, 2, 5]))[1] == 0, "old prefix evicted first"
    assert kv.get_computed_blocks(_req("n2", [3, 4, 5]))[1] == 2, "newer prefix still cached"


def test_reuse_order_spare_then_fresh_then_cached() -> None:
    """Freed blocks without a cached prefix come back before never-used ones (whose CPU pages
    are not mapped yet), and never-used ones before evicting a cached prefix."""
    kv = KVCacheManager(num_blocks=64, block_size=2)
    a = kv.allocate_slots(_req("a", [1, 2, 3]), 3)  # a full cached block + a partial one
    partial = a[1]
    kv.free("a")
    b = kv.allocate_slots(_req("b", [7]), 1)
    assert b == [partial], "the freed partial block is reused first"
    c = kv.allocate_slots(_req("c", [8, 8, 8]), 3)
    assert a[0] not in c and max(c) == max(a) + 2, "then never-used ids, in order"
    assert kv.get_computed_blocks(_req("a2", [1, 2, 5]))[1] == 2, "the cached prefix survives"
    kv.check_invariants()


def test_churn_without_caching_touches_only_what_is_live() -> None:
    """Many short requests through a large pool: the ids ever handed out stay within the most
    blocks live at once, so the pool's untouched pages stay unmapped."""
    kv = KVCacheManager(num_blocks=10_000, block_size=4, enable_caching=False)
    seen: set[int] = set()
    for i in range(200):
        for j in range(3):  # 3 live requests of 1..40 tokens
            n = 1 + (i * 7 + j * 13) % 40
            seen.update(kv.allocate_slots(_req(f"r{i}-{j}", list(range(n))), n))
        for j in range(3):
            kv.free(f"r{i}-{j}")
    assert len(seen) <= 3 * 10 and max(seen) <= 30, sorted(seen)[-5:]
    kv.check_invariants()


ops = st.lists(st.tuples(st.sampled_from(["add", "grow", "free", "preempt"]),
                         st.integers(0, 5), st.integers(1, 40)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops, st.booleans())
def test_no_leak_no_negative_refcounts_under_random_ops(seq, caching: bool) -> None:
    kv = KVCacheManager(num_blocks=16, block_size=4, enable_caching=caching)
    live: dict[str, Request] = {}
    for op, slot, n in seq:
        rid = f"r{slot}"
        if op == "add" and rid not in live:
            r = _req(rid, [(slot * 3 + i) % 7 for i in range(n)])  # shared prefixes happen
            hit, k = kv.get_computed_blocks(r)
            if kv.allocate_slots(r, n - k, hit) is not None:
                r.num_computed_tokens = n
                live[rid] = r
        elif op == "grow" and rid in live:
            r = live[rid]
            r.token_ids.extend([1] * n)
            if kv.allocate_slots(r, n) is not None:
                r.num_computed_tokens += n
        elif op in ("free", "preempt") and rid in live:
            kv.free(rid)
            del live[rid]
        kv.check_invariants()
        assert all(b.ref_cnt >= 0 for b in kv.pool.blocks)
    for rid in list(live):
        kv.free(rid)
    assert kv.num_used_blocks == 0
    kv.check_invariants()
