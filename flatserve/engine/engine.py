"""The step loop: schedule -> one flat forward -> sample -> update -> outputs."""
from __future__ import annotations

import dataclasses
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from flatserve.config import EngineConfig
from flatserve.engine.detokenizer import IncrementalDetokenizer
from flatserve.engine.kv_manager import KVCacheManager
from flatserve.engine.outputs import (CompletionOutput, Logprob, RequestMetrics, RequestOutput,
                                      RequestOutputKind)
from flatserve.engine.request import Request, RequestStatus
from flatserve.engine.sampler import Logprobs, Sampler
from flatserve.engine.sampling_params import SEED_MOD, ParamError, SamplingParams, check_text
from flatserve.engine.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from flatserve.engine.startup import EngineState, start_up
from flatserve.engine.structured import GrammarCache
from flatserve.memory import RamWatch
from flatserve.runner import InFlight
from flatserve.spec import Proposer, SpecStats

log = logging.getLogger("flatserve")


@dataclass(slots=True)
class _Child:
    req: Request
    detok: IncrementalDetokenizer
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float = 0.0
    sent_tokens: int = 0  # DELTA outputs: tokens and characters already handed out
    sent_chars: int = 0


@dataclass(slots=True)
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    metrics: RequestMetrics
    kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    children: list[_Child] = field(default_factory=list)

    @property
    def finished(self) -> bool:
        for c in self.children:  # a loop, not all(genexpr): called per request per step
            if not c.req.status.finished:
                return False
        return True


class Engine:
    def __init__(self, cfg: EngineConfig) -> None:
        self.state: EngineState
        if cfg.data_parallel_size > 1:
            raise ValueError("data_parallel_size > 1 is served by `flatserve serve` (one replica "
                             "per engine behind one server); an Engine is one replica")
        self.executor = None  # tensor parallelism: the other ranks (flatserve/distributed)
        if cfg.distributed:
            from flatserve.distributed.executor import TPExecutor

            self.executor = ex = TPExecutor(cfg)
            self.state, self.tokenizer, self.runner, draft_runner = ex.state, ex.tokenizer, ex.runner, None
        else:
            self.state, self.tokenizer, self.runner, draft_runner = start_up(cfg)
        s = self.state
        assert s.config is not None
        self.cfg = cfg = s.config  # the step limits as sized at start-up
        self.kv = KVCacheManager(s.budget.num_blocks, cfg.block_size, cfg.enable_prefix_caching)
        self.spec = SpecStats()
        self.async_mode = resolve_async(cfg, s.device.type)
        self.scheduler = Scheduler(
            SchedulerConfig(cfg.max_num_seqs, cfg.max_num_batched_tokens, s.max_model_len,
                            self.async_mode),
            self.kv, s.eos_token_ids)
        self.sampler = Sampler(s.model.vocab_size, s.eos_token_ids, cfg.seed)
        self.proposer = make_proposer(cfg, self.kv, draft_runner, s.max_model_len, self.sampler)
        self.parents: dict[str, _Parent] = {}
        self.children: dict[str, tuple[_Parent, _Child]] = {}
        self._ids = itertools.count()
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self._inflight: tuple[SchedulerOutput, InFlight | None] | None = None  # async only
        self._history_readers: set[str] = set()  # live parents with penalties (sync steps)
        self.grammars = GrammarCache(self.tokenizer, s.model.vocab_size, sorted(s.eos_token_ids))
        self._awaiting: list[Request] = []  # constrained requests whose grammar is compiling
        self.ram_watch = _ram_watch(s)
        self._ram_warned = 0

    # ---------------------------------------------------------------- requests
    def tokenize(self, prompt: str | list[int]) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if not prompt:
                raise ParamError("prompt is empty", "prompt")
            check_text(prompt, "prompt")
            return prompt, self.tokenizer(prompt).input_ids
        ids = list(prompt)
        if not ids:
            raise ParamError("prompt is empty", "prompt")
        V = self.state.model.vocab_size
        bad = [t for t in ids if type(t) is not int or not 0 <= t < V]
        if bad:
            raise ParamError(f"prompt token id {bad[0]!r} is outside the vocabulary [0, {V})", "prompt")
        return None, ids

    def add_request(self, prompt: str | list[int], params: SamplingParams,
                    request_id: str | None = None) -> str:
        """Validate and queue; raises ValueError naming the bad value and its limit."""
        params.validate()
        params.check_vocab(self.state.model.vocab_size)
        text, ids = self.tokenize(prompt)
        max_len = self.state.max_model_len
        if len(ids) >= max_len:
            raise ValueError(f"prompt has {len(ids)} tokens but max_model_len is {max_len} "
                             f"(at least 1 token must remain for the output)")
        rid = request_id if request_id is not None else str(next(self._ids))
        if rid in self.parents:
            raise ValueError(f"request id {rid!r} is already in flight")
        room = max_len - len(ids)
        max_tokens = min(params.max_tokens or room, room)
        parent = _Parent(rid, text, ids, RequestMetrics(time.monotonic()), params.output_kind)
        for i in range(params.n):
            child_params = params
            if params.n > 1 and params.seed is not None:  # distinct, reproducible samples
                child_params = _with_seed(params, (params.seed + i) % SEED_MOD)
            req = Request(f"{rid}#{i}" if params.n > 1 else rid, ids, child_params, max_tokens)
            child = _Child(req, IncrementalDetokenizer(
                self.tokenizer, ids, params.stop_strings, params.skip_special_tokens,
                params.include_stop_str_in_output), [] if params.logprobs is not None else None)
            parent.children.append(child)
        if params.structured_outputs is not None:
            stops = [*self.state.eos_token_ids, *(params.stop_token_ids or [])]
            for child in parent.children:
                child.req.grammar = self.grammars.request_grammar(params.structured_outputs, stops)
        for child in parent.children:
            if child.req.grammar is not None:
                self._awaiting.append(child.req)  # admitted by `_admit` once compiled
            else:
                self.scheduler.add_request(child.req)
            self.children[child.req.request_id] = (parent, child)
        self.parents[rid] = parent
        if params.uses_history:
            self._history_readers.add(rid)
        self.num_prompt_tokens += len(ids) * params.n
        return rid

    def abort(self, request_id: str) -> bool:
        parent = self.parents.pop(request_id, None)
        self._history_readers.discard(request_id)
        if parent is None:
            return False
        for c in parent.children:
            self.scheduler.abort(c.req.request_id)
            self.children.pop(c.req.request_id, None)
            if c.req in self._awaiting:
                self._awaiting.remove(c.req)
                c.req.status = RequestStatus.FINISHED_ABORTED
        return True

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks (nothing to do on one device)."""
        if self.executor is not None:
            self.executor.shutdown()

    def _admit(self, wait: bool) -> list[RequestOutput]:
        """Queue constrained requests whose grammar has compiled; end those whose compile failed.
        `wait`: nothing else can step, so block briefly on a compile instead of spinning."""
        if not self._awaiting:
            return []
        if wait and not any(r.grammar.poll() for r in self._awaiting):
            from concurrent.futures import FIRST_COMPLETED
            from concurrent.futures import wait as wait_futures

            wait_futures([r.grammar.compiled for r in self._awaiting], 0.05, FIRST_COMPLETED)
        failed: dict[str, _Parent] = {}
        still = []
        for req in self._awaiting:
            if not req.grammar.poll():
                still.append(req)
            elif req.grammar.failed is not None:
                req.status, req.stop_reason = RequestStatus.FINISHED_ABORTED, req.grammar.failed
                failed[self.children[req.request_id][0].request_id] = self.children[req.request_id][0]
            else:
                self.scheduler.add_request(req)
        self._awaiting = still
        results = []
        for parent in failed.values():
            if parent.finished:
                results.append(self._output(parent))
                self._drop(parent)
        return results

    def has_unfinished(self) -> bool:
        return bool(self.parents) or self._inflight is not None

    # ---------------------------------------------------------------- the step
    def step(self, emit_unfinished: bool = True) -> list[RequestOutput]:
        """One engine step. `emit_unfinished=False` (offline runs) reports finished requests only,
        so no text is built for requests still generating.

        Async scheduling: step N+1 is scheduled and launched before step N's tokens are read,
        so the host's bookkeeping of step N overlaps the GPU's work on N+1; outputs lag a step.
        """
        prev = self._inflight
        if prev is not None and self._history_readers:
            # Penalties read every earlier output on the host: drain, then step synchronously.
            self._inflight = None
            return self._finish_step(*prev, emit_unfinished)
        if self.ram_watch is not None:
            self._watch_ram()
        results: list[RequestOutput] = self._admit(wait=prev is None and not self.scheduler.requests)
        out = self.scheduler.schedule()
        launched = None

        def finish_prev() -> None:
            # Async with grammars: the masks of this step need the previous step's tokens, so
            # the runner reads them here, after this step's forward is enqueued, before sampling.
            nonlocal prev
            if prev is not None:
                self._inflight, done, prev = None, prev, None
                results.extend(self._finish_step(*done, emit_unfinished))

        if not out.is_empty:
            launched = self.runner.launch(out, self.sampler, prev[1] if prev else None,
                                          finish_prev if self.async_mode else None)
            if self.async_mode:
                self.scheduler.commit(out)
        finish_prev()
        if not out.is_empty:
            if self.async_mode:
                self._inflight = (out, launched)
            else:
                results.extend(self._finish_step(out, launched, emit_unfinished))
        return results

    def _watch_ram(self) -> None:
        """Shared RAM under the free floor: no new KV pages, except what the oldest request needs
        to finish (the plan guarantees one full sequence fits), so that it always goes on; the
        scheduler preempts newer requests for it or leaves them queued."""
        w, pool = self.ram_watch, self.kv.pool
        if not w.frozen_now(time.monotonic()):
            pool.limit_growth(None)
            return
        sched = self.scheduler
        live = sched.running + list(itertools.islice(sched.waiting, 1))
        need = 0
        if live:
            r = min(live, key=lambda q: q.arrival)
            need = -(-min(r.num_prompt_tokens + r.max_tokens, self.state.max_model_len)
                     // self.cfg.block_size)
        pool.limit_growth(need)
        if w.num_freezes > self._ram_warned:  # once per episode of low RAM
            self._ram_warned = w.num_freezes
            log.warning("available RAM is under %.1f GiB: the KV pool stops growing "
                        "at %d blocks", w.reserve / 2**30, pool.fresh_next - 1)

    def _finish_step(self, out: SchedulerOutput, launched: InFlight | None,
                     emit_unfinished: bool) -> list[RequestOutput]:
        """Read a launched step's tokens; scheduler update, detokenize, stop strings, outputs."""
        reqs, tokens, logprobs = self.runner.collect(launched)
        # Requests whose own sampling raised end here, before `update` could append a token.
        results = self._fail(launched.failed) if launched is not None and launched.failed else []
        out_spec = {s.request.request_id: len(s.spec_token_ids) for s in out.scheduled if s.spec_token_ids}
        before = {r.request_id: r.num_tokens for r in reqs}
        self.scheduler.update(out, {r.request_id: t for r, t in zip(reqs, tokens)})
        touched: dict[str, _Parent] = {}
        for req, toks, lps in zip(reqs, tokens, logprobs):
            entry = self.children.get(req.request_id)
            if entry is None or req.num_tokens == before[req.request_id]:
                continue  # gone, or finished before this (async) step's token arrived
            parent, child = entry
            self.spec.record(len(toks), out_spec.get(req.request_id, 0))
            # The scheduler appended tokens up to an eos/length stop; a stop string may cut earlier.
            start = before[req.request_id]
            n = req.num_tokens - start
            try:
                for i, (tok, lp) in enumerate(zip(toks[:n], lps)):
                    ended = self._absorb(child, tok, lp)
                    if req.grammar is not None and not req.grammar.accept(tok) and not ended:
                        ended = True  # the grammar is complete (its stop token) or refused the token
                        if not req.status.finished:
                            self.scheduler.finish(req.request_id, RequestStatus.FINISHED_STOPPED)
                    if ended:
                        del req.token_ids[start + i + 1:]
                        break
            except Exception as e:  # one request's detokenizer or stop check: it alone fails
                results += self._fail({req.request_id: f"{type(e).__name__}: {e}"})
                continue
            touched[parent.request_id] = parent
        if self.proposer is not None:
            self.proposer.propose([r for r in self.scheduler.running
                                   if r.num_computed_tokens == r.num_tokens - 1])
        now = time.monotonic()  # one clock read per step: when these tokens reached the host
        for parent in touched.values():
            if self.parents.get(parent.request_id) is not parent:
                continue  # failed above (another of its n samples)
            done = parent.finished
            if parent.metrics.first_token_time is None:
                parent.metrics.first_token_time = now
            if done:
                parent.metrics.finished_time = now
            if done or (emit_unfinished and parent.kind is not RequestOutputKind.FINAL_ONLY):
                results.append(self._output(parent))
            if done:
                self._drop(parent)
        return results

    def _drop(self, parent: _Parent) -> None:
        self.parents.pop(parent.request_id, None)
        self._history_readers.discard(parent.request_id)
        for c in parent.children:
            self.children.pop(c.req.request_id, None)

    def _fail(self, failed: dict[str, str]) -> list[RequestOutput]:
        """End each failed child's whole request (all n samples) with an error; free its KV."""
        outs = []
        for rid, why in failed.items():
            entry = self.children.get(rid)
            if entry is None:
                continue  # already gone (aborted, or failed in an earlier step's report)
            parent = entry[0]
            log.warning("request %s failed: %s", parent.request_id, why)
            for c in parent.children:
                if not c.req.status.finished:
                    self.scheduler.finish(c.req.request_id, RequestStatus.FINISHED_ABORTED)
            self._drop(parent)
            parent.metrics.finished_time = time.monotonic()
            out = self._output(parent)
            out.error = why
            outs.append(out)
        return outs

    def _absorb(self, child: _Child, tok: int, lp: Logprobs | None) -> bool:
        """Take one output token; True when a stop string ended the request on it."""
        self.num_generation_tokens += 1
        if lp is not None and child.logprobs is not None:
            child.cumulative_logprob += lp[0][1]
            child.logprobs.append(self._logprob_dict(lp))
        stop = child.detok.add(tok)
        if stop is not None:
            req = child.req
            if req.status.finished:  # eos/length fired on the same token: the stop string wins
                req.status, req.stop_reason = RequestStatus.FINISHED_STOPPED, stop
            else:
                self.scheduler.finish(req.request_id, RequestStatus.FINISHED_STOPPED, stop)
            return True
        return False

    def _logprob_dict(self, lp: Logprobs) -> dict[int, Logprob]:
        (tok, val), top = lp[0], lp[1:]
        d = {t: Logprob(v, rank + 1, self.tokenizer.decode([t])) for rank, (t, v) in enumerate(top)}
        if tok not in d:
            d[tok] = Logprob(val, None, self.tokenizer.decode([tok]))
        return d

    def _output(self, parent: _Parent) -> RequestOutput:
        outs = []
        delta = parent.kind is RequestOutputKind.DELTA
        for i, c in enumerate(parent.children):
            r = c.req
            text, lps = c.detok.visible_text(r.status.finished), c.logprobs
            if delta:  # only what is new: slices as long as this step's tokens, not the output
                t0, c0 = c.sent_tokens, c.sent_chars
                c.sent_tokens, c.sent_chars = r.num_output_tokens, len(text)
                ids = r.token_ids[r.num_prompt_tokens + t0:]
                text, lps = text[c0:], None if lps is None else lps[t0:]
            else:
                ids = r.output_token_ids  # a fresh list
            outs.append(CompletionOutput(
                i, text, ids, c.cumulative_logprob if c.logprobs is not None else None, lps,
                r.finish_reason, r.stop_reason))
        return RequestOutput(parent.request_id, parent.prompt, parent.prompt_token_ids, outs,
                             parent.finished, max(c.req.num_cached_tokens for c in parent.children),
                             dataclasses.replace(parent.metrics))

    # ---------------------------------------------------------------- introspection
    @property
    def num_used_blocks(self) -> int:
        return self.kv.num_used_blocks

    def stats(self) -> dict[str, Any]:
        return {"running": len(self.scheduler.running), "waiting": len(self.scheduler.waiting),
                "kv_blocks_used": self.kv.num_used_blocks,
                "kv_blocks_total": self.kv.pool.num_usable,
                "preemptions": self.scheduler.num_preemptions,
                "prompt_tokens": self.num_prompt_tokens,
                "generation_tokens": self.num_generation_tokens,
                "prefix_cache_hits": self.kv.hit_tokens, "prefix_cache_queries": self.kv.query_tokens,
                "spec_draft_tokens": self.spec.num_draft_tokens,
                "spec_accepted_tokens": self.spec.num_accepted_tokens,
                "spec_verify_steps": self.spec.num_groups}


def _ram_watch(s: EngineState) -> RamWatch | None:
    """CPU pools map pages as blocks are first written: watch the RAM they come from."""
    if s.device.type != "cpu" or not s.budget.unified or not s.budget.free_floor:
        return None
    import psutil

    return RamWatch(s.budget.free_floor, lambda: psutil.virtual_memory().available)


def resolve_async(cfg: EngineConfig, device_type: str) -> bool:
    """Async scheduling: on by default where the forward runs asynchronously to the host (CUDA);
    never with speculative decoding (a verify step's token count is known only after it)."""
    if cfg.speculative_method is not None:
        if cfg.async_scheduling:
            raise ValueError("async_scheduling cannot be combined with speculative decoding")
        return False
    if cfg.distributed:  # the workers read no pending tokens: every step's ids are host-known
        return False
    return device_type == "cuda" if cfg.async_scheduling is None else cfg.async_scheduling


def make_proposer(cfg: EngineConfig, kv: KVCacheManager, draft_runner: Any,
                  max_model_len: int, sampler: Sampler) -> Proposer | None:
    k = cfg.num_speculative_tokens
    if cfg.speculative_method == "ngram":
        from flatserve.spec.ngram import NgramProposer

        return NgramProposer(k, cfg.prompt_lookup_min, cfg.prompt_lookup_max, max_model_len)
    if cfg.speculative_method == "draft":
        from flatserve.spec.draft import DraftProposer

        return DraftProposer(draft_runner, kv, k, max_model_len, cfg.max_num_batched_tokens, sampler)
    return None


def _with_seed(p: SamplingParams, seed: int) -> SamplingParams:
    import copy

    q = copy.copy(p)
    q.seed = seed
    return q

