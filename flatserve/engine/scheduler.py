"""Token-counting scheduler: FCFS, chunked prefill mixed with decodes, preemption by recompute.

Each step every request asks for `num_tokens - num_computed_tokens` tokens (a decode asks for
1, a prompt for the rest of its prompt); the step grants them under `max_num_batched_tokens`
and `max_num_seqs`, running requests first. Nothing here knows "prefill" or "decode".
Torch-free: unit-tested without a model.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from flatserve.engine.kv_manager import KVCacheManager
from flatserve.engine.request import Request, RequestStatus


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    # Async: step N+1 is scheduled before step N's tokens are read. `commit` advances the
    # computed counts at launch and marks the sampled token pending; `update` only appends.
    async_scheduling: bool = False


@dataclass(slots=True)
class ScheduledRequest:
    request: Request
    start_pos: int  # == num_computed_tokens before this step
    num_tokens: int  # new tokens this step, speculative ones included
    block_ids: list[int]
    # Draft tokens verified this step; they follow the request's known tokens on the flat axis,
    # so a request with k drafts contributes k + 1 query tokens and k + 1 sampled rows.
    spec_token_ids: list[int] = field(default_factory=list)

    @property
    def samples(self) -> bool:
        """True when this step reaches the last known token, so its logits give the next one."""
        r = self.request
        return self.start_pos + self.num_tokens == r.num_tokens + r.num_pending + len(self.spec_token_ids)

    @property
    def new_token_ids(self) -> list[int]:
        """Host-known tokens of this run; a pending token (async) is missing at the end."""
        toks = self.request.token_ids
        end = self.start_pos + self.num_tokens
        if end <= len(toks):
            return toks[self.start_pos:end]
        return (toks + self.spec_token_ids)[self.start_pos:end]


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(self, cfg: SchedulerConfig, kv: KVCacheManager,
                 eos_token_ids: frozenset[int] = frozenset()) -> None:
        self.cfg = cfg
        self.kv = kv
        self.eos_token_ids = eos_token_ids
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._arrivals = 0

    # ---------------------------------------------------------------- intake
    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in flight")
        if req.num_tokens >= self.cfg.max_model_len:
            raise ValueError(f"prompt has {req.num_tokens} tokens; max_model_len is "
                             f"{self.cfg.max_model_len} (room must remain for 1 output token)")
        self._arrivals += 1
        req.arrival = self._arrivals
        self.requests[req.request_id] = req
        self.waiting.append(req)

    def abort(self, request_id: str) -> Request | None:
        req = self.requests.get(request_id)
        if req is None:
            return None
        self._finish(req, RequestStatus.FINISHED_ABORTED)
        return req

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    # ---------------------------------------------------------------- a step
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.cfg.max_num_batched_tokens)
        self._schedule_waiting(out, budget)
        assert out.num_batched_tokens <= self.cfg.max_num_batched_tokens
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.num_pending and self._length_reached(req, req.num_pending):
                i += 1  # its pending token is its last: nothing to compute
                continue
            known = req.num_tokens + req.num_pending - req.num_computed_tokens
            n = min(known + len(req.spec_token_ids), budget)
            blocks = self.kv.allocate_slots(req, n)
            while blocks is None:
                victim = self.running.pop()  # newest running request: FCFS keeps the oldest
                self._preempt(victim, out)
                if victim is req:
                    return budget
                blocks = self.kv.allocate_slots(req, n)
            # Drafts only ride behind the whole known remainder; the budget may cut some off.
            spec = req.spec_token_ids[:max(0, n - known)]
            out.scheduled.append(ScheduledRequest(req, req.num_computed_tokens, n, blocks, spec))
            budget -= n
            i += 1
        return budget

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            req = self.waiting[0]
            if req.num_pending:
                break  # preempted with a token in flight: re-admitted once it is read
            hit, num_hit = self.kv.get_computed_blocks(req)
            n = min(req.num_tokens - num_hit, budget)
            blocks = self.kv.allocate_slots(req, n, hit)
            if blocks is None:
                break  # FCFS: nobody jumps the queue head
            self.kv.record_prefix_query(req.num_tokens, num_hit)
            self.waiting.popleft()
            req.num_computed_tokens = num_hit
            req.num_cached_tokens = max(req.num_cached_tokens, num_hit)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.scheduled.append(ScheduledRequest(req, num_hit, n, blocks))
            budget -= n

    def _preempt(self, req: Request, out: SchedulerOutput) -> None:
        # Recompute, not swap: the blocks go back to the pool (cached blocks may survive).
        self.kv.free(req.request_id)
        req.num_computed_tokens = 0
        req.num_draft_computed = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted_ids.append(req.request_id)

    def _length_reached(self, req: Request, in_flight: int = 0) -> bool:
        """max_tokens or max_model_len reached once `in_flight` more tokens land."""
        return (req.num_output_tokens + in_flight >= req.max_tokens
                or req.num_tokens + in_flight >= self.cfg.max_model_len)

    def commit(self, out: SchedulerOutput) -> None:
        """Async: the step is launched; count its tokens computed and its samples pending."""
        assert self.cfg.async_scheduling
        for s in out.scheduled:
            req = s.request
            sampled = s.samples  # before the counts below move
            req.num_computed_tokens += s.num_tokens
            req.num_pending += sampled

    # ---------------------------------------------------------------- after the forward
    def update(self, out: SchedulerOutput, new_tokens: dict[str, list[int]]) -> list[Request]:
        """Advance computed counts, append sampled tokens, apply token-level stops.

        With k drafts, `new_tokens` holds the a accepted drafts plus one token from the target;
        the k - a rejected drafts' KV is rolled back: the computed count skips them and blocks
        past the known tokens go back to the pool.
        """
        finished: list[Request] = []
        for s in out.scheduled:
            req = s.request
            if req.status.finished:  # aborted while the step ran
                continue
            toks = new_tokens.get(req.request_id, ())
            if self.cfg.async_scheduling:  # counts moved at commit; the token is read now
                req.num_pending -= 1 if toks else 0
            else:
                rejected = len(s.spec_token_ids) - (len(toks) - 1) if toks else 0
                req.num_computed_tokens += s.num_tokens - rejected
            req.spec_token_ids = []
            for tok in toks:
                req.token_ids.append(tok)
                status = self._check_stop(req, tok)
                if status is not None:
                    self._finish(req, status)
                    finished.append(req)
                    break
            if s.spec_token_ids and not req.status.finished:
                self.kv.trim(req)
        return finished

    def _check_stop(self, req: Request, tok: int) -> RequestStatus | None:
        p = req.params
        if req.num_output_tokens >= p.min_tokens:
            if tok in self.eos_token_ids and not p.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if p.stop_token_ids and tok in p.stop_token_ids:
                req.stop_reason = tok
                return RequestStatus.FINISHED_STOPPED
        if self._length_reached(req):
            return RequestStatus.FINISHED_LENGTH
        return None

    def finish(self, request_id: str, status: RequestStatus, reason: str | None = None) -> None:
        """Finish from outside (a stop string found by the detokenizer)."""
        req = self.requests.get(request_id)
        if req is not None:
            req.stop_reason = reason
            self._finish(req, status)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        self.requests.pop(req.request_id, None)
        if req in self.running:
            self.running.remove(req)
        else:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        self.kv.free(req.request_id)
