"""Constrained decoding through xgrammar: compile (cached, off the step loop), match, mask.

One `GrammarCompiler` per engine compiles each distinct (kind, spec) once on a worker thread;
a request whose grammar is still compiling waits outside the scheduler while the others step.
Each constrained request owns a `GrammarMatcher`. Per step the host fills one 32-bit-packed row
of allowed tokens per sampled row ([R, ceil(V/32)] int32, the layout xgrammar writes), and the
sampler applies every row's mask in one vectorised op on the device (`apply_bitmask`).

Speculative decoding: a request verifying k drafts owns k + 1 rows; row j's mask is filled after
the matcher tentatively accepts drafts[:j], then the matcher rolls those drafts back. A draft the
grammar rejects is masked out of its own row, so the sampler rejects it there.
"""
from __future__ import annotations

import json
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from flatserve.engine.sampling_params import StructuredOutputs

if TYPE_CHECKING:
    from flatserve.engine.sampler import SampleRow

log = logging.getLogger("flatserve")


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, impl: str = "auto") -> torch.Tensor:
    """logits [R, V] (any float dtype, any device), bitmask [R, W] int32 with W = ceil(V / 32):
    bit b of word w set means token 32 w + b is allowed. Disallowed logits become -inf, in place.

    fp32 on the CPU goes through xgrammar's C++ loop, which reads the bits in place; elsewhere
    (CUDA, other dtypes; impl="torch") the bits are unpacked into a [R, V] mask in one torch op."""
    R, V = logits.shape
    if impl == "auto" and logits.device.type == "cpu" and logits.dtype == torch.float32 \
            and logits.is_contiguous():
        import xgrammar as xgr

        xgr.apply_token_bitmask_inplace(logits, bitmask, vocab_size=V, backend="cpu")
        return logits
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = (bitmask.unsqueeze(-1) >> shifts) & 1  # [R, W, 32]
    allowed = bits.view(R, -1)[:, :V].bool()  # [R, V]
    return logits.masked_fill_(~allowed, float("-inf"))


@dataclass(slots=True)
class RequestGrammar:
    """A request's grammar: the compile (a future, maybe shared) and, once ready, its matcher."""

    compiled: Future
    stop_token_ids: list[int]  # the tokens that end this request (eos, its stop_token_ids)
    matcher: Any = None
    failed: str | None = None

    def ready(self) -> bool:
        return self.matcher is not None or self.failed is not None

    def poll(self) -> bool:
        """Make the matcher once the compile is done; True when the request may be scheduled."""
        if self.ready():
            return True
        if not self.compiled.done():
            return False
        err = self.compiled.exception()
        if err is not None:
            self.failed = str(err)
        else:
            import xgrammar as xgr

            self.matcher = xgr.GrammarMatcher(self.compiled.result(),
                                              override_stop_tokens=self.stop_token_ids)
        return True

    def accept(self, token: int) -> bool:
        """Advance over an emitted token; False when the grammar has ended (or refuses it)."""
        m = self.matcher
        if m.is_terminated():
            return False
        ok = m.accept_token(token)
        if not ok:
            log.warning("grammar refused emitted token %d (masking bug?); ending the request", token)
        return ok and not m.is_terminated()


# xgrammar (0.2.9, the newest on PyPI on 2026-11-29) writes the characters of a length-bounded
# JSON string ({"type": "string", "maxLength": n}, or minLength) as [^"\\\r\n]: a tab or any other control
# character passes unescaped, which is not JSON (json.loads refuses it; a served request returned
# {"sku": "]}]] }\t\t"}). Its unbounded strings already exclude \0-\x1f.
_BOUNDED_CHARS, _JSON_CHARS = r'[^\"\\\r\n]', r'[^\0-\x1f\"\\]'


def json_schema_ebnf(schema: str) -> str | None:
    """xgrammar's grammar for `schema` (compact separators) as EBNF with its bounded strings'
    characters restricted to JSON's (no control characters; escapes stay out of them, as
    xgrammar has it), or None where it has no such rule (compile the schema as it is)."""
    import xgrammar as xgr

    text = str(xgr.Grammar.from_json_schema(schema, any_whitespace=False))
    return text.replace(_BOUNDED_CHARS, _JSON_CHARS) if _BOUNDED_CHARS in text else None


class GrammarCache:
    """Compiles each distinct spec once, on one worker thread, shared by every request."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> None:
        self._tokenizer, self.vocab_size, self._stops = tokenizer, vocab_size, stop_token_ids
        self._compiler: Any = None
        self._futures: dict[tuple[str, str], Future] = {}
        self._lock = threading.Lock()
        # One worker: each compile fans out over 2 xgrammar threads (its per-token mask cache);
        # a compile is then done in one go rather than several interleaved ones.
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="flatserve-grammar")
        self.num_compiles = 0

    def submit(self, spec: StructuredOutputs) -> Future:
        key = spec.key()
        with self._lock:
            fut = self._futures.get(key)
            if fut is None:
                fut = self._futures[key] = self._pool.submit(self._compile, spec)
        return fut

    def request_grammar(self, spec: StructuredOutputs, stop_token_ids: list[int]) -> RequestGrammar:
        return RequestGrammar(self.submit(spec), sorted(set(stop_token_ids)))

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _compile(self, spec: StructuredOutputs) -> Any:
        import xgrammar as xgr

        if self._compiler is None:  # ~3 s for Gemma 3's 262k vocabulary, once per engine
            info = xgr.TokenizerInfo.from_huggingface(self._tokenizer, vocab_size=self.vocab_size,
                                                      stop_token_ids=self._stops)
            self._compiler = xgr.GrammarCompiler(info, max_threads=2)
        self.num_compiles += 1
        c, kind, val = self._compiler, spec.kind, spec.value
        try:
            if kind == "json":
                # Compact separators, no free whitespace: a sampled model cannot pad forever.
                fixed = json_schema_ebnf(val)
                return c.compile_json_schema(val, any_whitespace=False) if fixed is None \
                    else c.compile_grammar(fixed)
            if kind == "json_object":
                return c.compile_json_schema('{"type": "object"}', any_whitespace=False)
            if kind == "any_json":
                return c.compile_builtin_json_grammar()
            if kind == "regex":
                return c.compile_regex(val)
            if kind == "grammar":
                return c.compile_grammar(val)
            if kind == "choice":
                return c.compile_grammar(choice_ebnf(json.loads(val)))
        except Exception as e:  # xgrammar raises RuntimeError/ValueError subclasses
            raise ValueError(f"invalid {kind} for structured output: {_short(e)}") from None
        raise ValueError(f"unknown structured output kind {kind!r}")


def _short(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return msg[-1][:300] if msg else type(e).__name__


def choice_ebnf(choices: list[str]) -> str:
    # JSON string literals are valid EBNF string literals in xgrammar (same escapes).
    return "root ::= " + " | ".join(json.dumps(c) for c in choices)


def fill_bitmask(rows: list[SampleRow], vocab_size: int) -> torch.Tensor | None:
    """[R, ceil(V/32)] int32 host bitmask for the step's rows; all-ones on unconstrained rows.
    None when no row is constrained."""
    if not any(r.req.grammar is not None for r in rows):
        return None
    import xgrammar as xgr

    bm = xgr.allocate_token_bitmask(len(rows), vocab_size)  # all ones
    i = 0
    while i < len(rows):
        g = rows[i].req.grammar
        k = i + 1 + _num_drafts_after(rows, i)  # this request's rows: i..k-1
        if g is not None and g.matcher is not None:
            _fill_group(g.matcher, rows[i:k], bm, i)
        i = k
    return bm


def _num_drafts_after(rows: list[SampleRow], i: int) -> int:
    """Rows i.. of one request: the first has no drafts before it; the group ends at draft -1."""
    n = 0
    while rows[i + n].draft >= 0:
        n += 1
    return n


def _fill_group(m: Any, group: list[SampleRow], bm: torch.Tensor, first: int) -> None:
    """Row j after drafts[:j]: tentatively accept each draft, fill, then roll back."""
    if m.is_terminated():
        return
    accepted = 0
    for j, r in enumerate(group):
        m.fill_next_token_bitmask(bm, first + j)
        if r.draft < 0 or not m.accept_token(r.draft):
            break  # a refused draft is masked out of its own row: rows after it are never used
        accepted += 1
        if m.is_terminated():
            break
    if accepted:
        m.rollback(accepted)
