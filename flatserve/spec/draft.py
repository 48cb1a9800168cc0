"""Draft-model proposer: a smaller model with the target's tokenizer runs k cheap steps ahead.

Its KV lives in its own tensor but under the *target's* block ids: one block table per request,
one pool, one budget (start-up sizes blocks by target + draft bytes). `num_draft_computed` counts
the tokens whose draft KV is valid; the first draft step catches up on whatever the target ran
since (the prompt once, then the accepted tokens), the next k - 1 steps feed back its own drafts.
Drafts are the draft model's greedy choice after the target's own logits processors (bias,
penalties and min_tokens, seeing the drafts so far); the sampler's rejection rule keeps the target's
distribution exact for any proposal (a point mass included), at some acceptance cost for T > 0.
"""
from __future__ import annotations

import torch

from flatserve.engine.kv_manager import KVCacheManager
from flatserve.engine.request import Request
from flatserve.engine.sampler import Sampler, expand
from flatserve.engine.scheduler import ScheduledRequest, SchedulerOutput
from flatserve.runner import ModelRunner, build_flat_batch
from flatserve.spec import max_drafts


class DraftProposer:
    def __init__(self, runner: ModelRunner, kv: KVCacheManager, k: int, max_model_len: int,
                 max_num_batched_tokens: int, sampler: Sampler | None = None) -> None:
        self.runner, self.kv, self.k, self.sampler = runner, kv, k, sampler
        self.max_model_len = max_model_len
        self.max_tokens = max_num_batched_tokens  # caps one catch-up forward, like a target step

    def propose(self, reqs: list[Request]) -> None:
        first, live = self._catch_up_plan(reqs)
        if not first:
            return
        drafts = {r.request_id: [t] for r, t in self._run(first)}
        for s in first:
            s.request.num_draft_computed += s.num_tokens
        live = [(r, k) for r, k in live if r.request_id in drafts]
        for j in range(1, max((k for _, k in live), default=0)):
            # Position N + j - 1 holds draft j; its logits give draft j + 1. A view of the request
            # with its drafts appended keeps them out of the verify-row logic (`spec_token_ids`).
            step = [(r, ScheduledRequest(
                Request(r.request_id, r.prompt_token_ids, r.params, r.max_tokens,
                        token_ids=r.token_ids + drafts[r.request_id]),
                r.num_tokens + j - 1, 1, self.kv.block_ids(r.request_id))) for r, k in live if k > j]
            for (r, _), (_, t) in zip(step, self._run([s for _, s in step])):
                drafts[r.request_id].append(t)
                r.num_draft_computed += 1
        for r, _ in live:
            r.spec_token_ids = drafts[r.request_id]

    def _catch_up_plan(self, reqs: list[Request]
                       ) -> tuple[list[ScheduledRequest], list[tuple[Request, int]]]:
        first: list[ScheduledRequest] = []
        live: list[tuple[Request, int]] = []
        budget = self.max_tokens
        for r in reqs:
            r.spec_token_ids = []
            # Draft KV past the last known token belonged to rejected drafts.
            r.num_draft_computed = min(r.num_draft_computed, r.num_tokens - 1)
            k = max_drafts(r, self.k, self.max_model_len)
            if k == 0 or budget <= 0:
                continue
            m = min(r.num_tokens - r.num_draft_computed, budget)
            done = r.num_draft_computed + m == r.num_tokens
            # Catching up to the newest token writes draft KV at N - 1, and drafts 1..k-1 at
            # N..N+k-2: hold slots now (the target's verify step needs them next anyway). N - 1
            # may open a block the target has not allocated yet (N - 1 = 16 j). Without room for
            # k, propose one; without room for N - 1, catch up to N - 2 and propose nothing.
            if done and k > 1 and self.kv.allocate_slots(r, k, cache=False) is None:
                k = 1
            if done and k == 1 and self.kv.allocate_slots(r, 1, cache=False) is None:
                m, done = m - 1, False
            if m <= 0:
                continue
            first.append(ScheduledRequest(r, r.num_draft_computed, m, self.kv.block_ids(r.request_id)))
            budget -= m
            if done:
                live.append((r, k))
        return first, live

    @torch.inference_mode()
    def _run(self, sched: list[ScheduledRequest]) -> list[tuple[Request, int]]:
        """One draft forward -> (request, greedy next token) for every request that samples."""
        batch = build_flat_batch(SchedulerOutput(sched), self.runner.block_size, self.runner.device)
        logits = self.runner.forward_logits(batch).float()  # [R, V_draft]
        if self.sampler is not None:  # the target's bias/penalties/min_tokens: drafts it would pick
            V = self.sampler.vocab_size
            if logits.shape[-1] < V:
                logits = torch.nn.functional.pad(logits, (0, V - logits.shape[-1]), value=float("-inf"))
            logits = self.sampler.apply_logits_processors(logits, expand(batch.groups))
        return list(zip((r for r, _ in batch.groups), logits.argmax(dim=-1).tolist()))
