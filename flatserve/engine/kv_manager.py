"""Paged KV bookkeeping: block pool, per-request block tables, prefix cache (torch-free).

Blocks layout of one request (block_size = 4, 10 tokens, 3 of them new this step):

    tokens   | t0 t1 t2 t3 | t4 t5 t6 t7 | t8 t9 __ __ |
    blocks   |    b17      |    b3       |    b42      |
    hashes   |    h0       | h1=H(h0,..) |  (partial: not cached)
             ^ computed (prefix hit or earlier steps) ^ new tokens: t7 t8 t9

Only full blocks get a hash, chained through the parent's, so equal hashes mean equal
prefixes. A block with ref_cnt 0 sits in the free queue but keeps its hash until the
queue's LRU order reuses it: freed prompts stay cached at no extra memory.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from flatserve.engine.request import Request

NULL_BLOCK = 0  # reserved: padding rows of block tables point here


@dataclass(slots=True)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: int | None = None


class BlockPool:
    """Free blocks in three places, taken in this order:

    - `spare`: freed blocks holding nothing reusable (no hash), last freed first (hot in cache);
    - fresh: never handed out, ids [fresh_next, num_blocks). The CPU pool's pages are mapped on
      first write (device.zeros_on_demand), so taking these last keeps RSS at what the workload
      has used: 16 benchmark requests touch ~700 of the default pool's 57k blocks;
    - `free`: freed blocks that keep a cached prefix's hash, in eviction order (least recently
      freed first): reused only when nothing else is left.
    """

    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        if num_blocks < 2:
            raise ValueError(f"need at least 2 KV blocks (one is reserved), got {num_blocks}")
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.blocks[NULL_BLOCK].ref_cnt = 1  # never freed, never handed out
        self.spare: list[int] = []
        self.fresh_next = NULL_BLOCK + 1
        # Fresh ids below this may be taken. Shared memory running low (memory.RamWatch) sets it
        # near fresh_next: the pool stops mapping new pages and reuses what it holds, so the
        # scheduler queues or preempts instead of pushing the machine into swap.
        self.fresh_limit = num_blocks
        self.free: OrderedDict[int, None] = OrderedDict()
        self.cached: dict[int, int] = {}  # block_hash -> block_id
        self.enable_caching = enable_caching

    @property
    def num_free(self) -> int:
        return len(self.spare) + len(self.blocks) - self.fresh_next + len(self.free)

    @property
    def num_takeable(self) -> int:
        """Free blocks that may be handed out now (num_free less fresh ones while frozen)."""
        fresh = max(0, min(self.fresh_limit, len(self.blocks)) - self.fresh_next)
        return len(self.spare) + fresh + len(self.free)

    def limit_growth(self, num_blocks: int | None) -> None:
        """None: the whole pool may be used. Else no fresh block past the first `num_blocks`
        usable ones (or past those already handed out, whichever is more)."""
        n = len(self.blocks)
        self.fresh_limit = n if num_blocks is None else max(self.fresh_next, min(n, num_blocks + 1))

    @property
    def num_usable(self) -> int:
        return len(self.blocks) - 1

    def is_free(self, bid: int) -> bool:
        return bid >= self.fresh_next or bid in self.free or bid in self.spare

    def take(self, n: int) -> list[int]:
        assert n <= self.num_takeable, "caller checks capacity first"
        out = []
        for _ in range(n):
            if self.spare:
                bid = self.spare.pop()
            elif self.fresh_next < self.fresh_limit:
                bid, self.fresh_next = self.fresh_next, self.fresh_next + 1
            else:
                bid, _ = self.free.popitem(last=False)
                blk = self.blocks[bid]  # evict: its content is about to be overwritten
                if self.cached.get(blk.block_hash) == bid:
                    del self.cached[blk.block_hash]
                blk.block_hash = None
            self.blocks[bid].ref_cnt = 1
            out.append(bid)
        return out

    def touch(self, block_ids: list[int]) -> None:
        """Take a reference on cached blocks (prefix hit); revive them from the free queue."""
        for bid in block_ids:
            blk = self.blocks[bid]
            if blk.ref_cnt == 0:
                del self.free[bid]  # only hashed blocks are found, and those wait in `free`
            blk.ref_cnt += 1

    def release(self, block_ids: list[int]) -> None:
        # Reversed: a request's tail blocks are the least likely to be shared, evict them first.
        for bid in reversed(block_ids):
            blk = self.blocks[bid]
            blk.ref_cnt -= 1
            assert blk.ref_cnt >= 0, f"block {bid} ref count went negative"
            if blk.ref_cnt == 0:
                if blk.block_hash is None:
                    self.spare.append(bid)
                else:
                    self.free[bid] = None

    def lookup(self, block_hash: int) -> int | None:
        return self.cached.get(block_hash) if self.enable_caching else None

    def reset_cache(self) -> None:
        """Forget every cached prefix: free hashed blocks become spare ones (callers check that
        no block is held)."""
        for bid in self.free:
            self.blocks[bid].block_hash = None
        self.spare.extend(self.free)
        self.free.clear()
        self.cached.clear()

    def set_hash(self, bid: int, block_hash: int) -> None:
        if not self.enable_caching or block_hash in self.cached:
            return  # an identical block already serves this prefix; keep the first one
        self.blocks[bid].block_hash = block_hash
        self.cached[block_hash] = bid


def hash_block(parent: int | None, tokens: tuple[int, ...], extra: object = None) -> int:
    return hash((parent, tokens, extra))


class KVCacheManager:
    """The one owner of `request_id -> [block_id]`."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_blocks: dict[str, list[int]] = {}
        self.req_hashes: dict[str, list[int]] = {}  # hashes of the request's full blocks
        # Prefix-cache counters, in tokens (exported as prefix_cache_hits/queries).
        self.hit_tokens = 0
        self.query_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_usable - self.pool.num_free

    def block_ids(self, request_id: str) -> list[int]:
        return self.req_blocks.get(request_id, [])

    def _full_block_hashes(self, req: Request) -> list[int]:
        hashes = self.req_hashes.setdefault(req.request_id, [])
        bs = self.block_size
        for i in range(len(hashes), req.num_tokens // bs):
            parent = hashes[-1] if hashes else None
            hashes.append(hash_block(parent, tuple(req.token_ids[i * bs:(i + 1) * bs])))
        return hashes

    def get_computed_blocks(self, req: Request) -> tuple[list[int], int]:
        """Longest cached prefix of a waiting request: (block ids, tokens they hold)."""
        if not self.pool.enable_caching:
            return [], 0
        hashes = self._full_block_hashes(req)
        # The last token is always recomputed: its logits are needed to sample.
        max_blocks = (req.num_tokens - 1) // self.block_size
        hit: list[int] = []
        for h in hashes[:max_blocks]:
            bid = self.pool.lookup(h)
            if bid is None:
                break
            hit.append(bid)
        return hit, len(hit) * self.block_size

    def record_prefix_query(self, num_tokens: int, num_hit: int) -> None:
        if self.pool.enable_caching:
            self.query_tokens += num_tokens
            self.hit_tokens += num_hit

    def allocate_slots(self, req: Request, num_new_tokens: int,
                       computed_blocks: list[int] | None = None, cache: bool = True) -> list[int] | None:
        """Make room for `num_new_tokens` more tokens; None if the pool cannot (caller preempts).

        `computed_blocks` (a prefix hit) are shared, not copied: they gain a reference. `cache`
        False: slots held ahead of the step that writes them (the draft proposer's), not hashed,
        so a preemption before that step cannot leave a cached block with an unwritten row.
        """
        held = self.req_blocks.get(req.request_id, [])
        bs = self.block_size
        end = req.num_computed_tokens + num_new_tokens
        if not computed_blocks and end <= len(held) * bs:  # a decode inside its last block
            if cache and end // bs > req.num_computed_tokens // bs:  # ...that fills it: cache it
                self._cache_full_blocks(req, end)
            return held
        computed_blocks = computed_blocks or []
        num_computed = req.num_computed_tokens + len(computed_blocks) * self.block_size
        need = -(-(num_computed + num_new_tokens) // self.block_size)
        num_new_blocks = need - len(held) - len(computed_blocks)
        # Reviving a cached block from the free queue also consumes a free slot.
        revived = sum(1 for b in computed_blocks if self.pool.blocks[b].ref_cnt == 0)
        if num_new_blocks + revived > self.pool.num_takeable:
            return None
        self.pool.touch(computed_blocks)
        blocks = self.req_blocks.setdefault(req.request_id, [])
        blocks.extend(computed_blocks)
        if num_new_blocks > 0:
            blocks.extend(self.pool.take(num_new_blocks))
        if cache:
            self._cache_full_blocks(req, num_computed + num_new_tokens)
        return blocks

    def _cache_full_blocks(self, req: Request, num_tokens_after_step: int) -> None:
        if not self.pool.enable_caching:
            return
        hashes = self._full_block_hashes(req)
        blocks = self.req_blocks[req.request_id]
        for i in range(min(num_tokens_after_step // self.block_size, len(hashes))):
            if self.pool.blocks[blocks[i]].block_hash is None:
                self.pool.set_hash(blocks[i], hashes[i])

    def trim(self, req: Request) -> None:
        """Give back blocks past the request's known tokens (rejected drafts' slots)."""
        blocks = self.req_blocks.get(req.request_id)
        keep = -(-req.num_tokens // self.block_size)
        if blocks and len(blocks) > keep:
            self.pool.release(blocks[keep:])  # past the known tokens: never hashed, never shared
            del blocks[keep:]

    def free(self, request_id: str) -> None:
        blocks = self.req_blocks.pop(request_id, None)
        self.req_hashes.pop(request_id, None)
        if blocks:
            self.pool.release(blocks)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached prefix (vLLM's reset_prefix_cache); False, changing nothing,
        while a request holds blocks (their hashes may be shared)."""
        if self.num_used_blocks:
            return False
        self.pool.reset_cache()
        self.req_hashes.clear()
        return True

    def check_invariants(self) -> None:
        """Debug/test helper: ref counts equal the number of holders; free queue is exact."""
        counts = [0] * len(self.pool.blocks)
        for blocks in self.req_blocks.values():
            for b in blocks:
                counts[b] += 1
        for blk in self.pool.blocks[1:]:
            assert blk.ref_cnt == counts[blk.block_id], (blk, counts[blk.block_id])
            assert (blk.ref_cnt == 0) == self.pool.is_free(blk.block_id), blk
