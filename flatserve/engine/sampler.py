"""Vectorised sampler with per-request parameters; host `prepare`, device `sample`.

Order (as vLLM): logit_bias, min_tokens mask, penalties -> (logprobs of these processed logits) ->
greedy argmax | temperature, min-p, top-k, top-p, exponential-race draw.

Rows, not requests: a request verifying k draft tokens owns k + 1 consecutive rows, row j seeing
the request's outputs plus drafts[:j] (so penalties, min_tokens and seeds match what plain
decoding would have seen there). Row j accepts draft j by rejection sampling against a point-mass
proposal: accept with probability p_j(draft), else draw from p_j with the draft removed and
renormalised. Marginally that is exactly p_j (P(x) = p(d)[x=d] + (1-p(d)) p(x)/(1-p(d))[x!=d]),
so speculation never changes the output distribution; greedy rows accept iff draft == argmax.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from flatserve import device as dev
from flatserve import kernels
from flatserve.engine.request import Request
from flatserve.engine.structured import apply_bitmask

Logprobs = list[tuple[int, float]]  # (token id, logprob): the sampled token first, then top-n


@dataclass(slots=True)
class SampleRow:
    """One logits row: `req` after it has (tentatively) emitted `drafts`."""

    req: Request
    drafts: list[int]  # draft tokens before this row
    draft: int  # the draft token this row verifies; -1 on the request's last (bonus) row

    @property
    def num_output_tokens(self) -> int:
        """Index of the token this row samples: outputs known, in flight (async), and drafts."""
        return self.req.num_output_tokens + self.req.num_pending + len(self.drafts)

    @property
    def output_token_ids(self) -> list[int]:
        return self.req.output_token_ids + self.drafts


Group = tuple[Request, list[int]]  # a sampling request and the drafts it verifies this step


def expand(groups: list[Group]) -> list[SampleRow]:
    return [SampleRow(req, drafts[:j], drafts[j] if j < len(drafts) else -1)
            for req, drafts in groups for j in range(len(drafts) + 1)]


def accept_walk(groups: list[Group], emitted: list[int], accepted: list[int]) -> list[list[int]]:
    """Per group: accepted drafts up to the first rejection, then that row's own token."""
    out, r = [], 0
    for _, drafts in groups:
        k, toks = len(drafts), []
        for j in range(k + 1):
            toks.append(emitted[r + j])
            if j == k or not accepted[r + j]:
                break
        out.append(toks)
        r += k + 1
    return out


@dataclass(slots=True)
class SamplingTensors:
    greedy: torch.Tensor  # [S] bool
    all_greedy: bool
    temperature: torch.Tensor  # [S]
    top_k: torch.Tensor | None  # [S] int64, V where disabled
    top_p: torch.Tensor | None  # [S]
    min_p: torch.Tensor | None  # [S]
    seeds: list[int | None]  # per row; None -> the engine's generator
    num_logprobs: list[int | None]
    draft: torch.Tensor | None = None  # [R] int64, -1 on bonus rows; None without drafts
    bitmask: torch.Tensor | None = None  # [R, ceil(V/32)] int32 allowed tokens (grammars); None: all

    def rows(self, a: int, b: int) -> SamplingTensors:
        """The same parameters for rows a..b only."""
        def cut(x: torch.Tensor | None) -> torch.Tensor | None:
            return None if x is None else x[a:b]

        return SamplingTensors(self.greedy[a:b], self.all_greedy, self.temperature[a:b], cut(self.top_k),
                               cut(self.top_p), cut(self.min_p), self.seeds[a:b],
                               self.num_logprobs[a:b], cut(self.draft), cut(self.bitmask))


# The fp32 path's [rows, vocab] temporaries (the fp32 copy, probabilities, sort values and int64
# indices, noise) are made this many bytes of fp32 rows at a time. Unchunked, the start-up
# profile of 64 requests verifying 3 drafts each (256 rows of Gemma 3's 262k vocabulary) set the
# process's peak, which the memory budget then took from the KV cache (benchmarks/offline_cpu.py,
# ngram at 16 requests: peak RSS 3.92 -> 2.30 GiB).
CHUNK_BYTES = 64 << 20
LOGPROB_FLOOR = -9999.0  # what a -inf (or NaN) logprob is reported as


def _penalised(r: SampleRow) -> bool:
    p = r.req.params
    return p.repetition_penalty != 1.0 or bool(p.frequency_penalty) or bool(p.presence_penalty)


def _min_tokens_due(r: SampleRow) -> bool:
    return r.num_output_tokens < r.req.params.min_tokens


def _processed(r: SampleRow) -> bool:
    """Whether the row's logits pass through a processor: the same three tests that
    `apply_logits_processors` makes, so the greedy fast path never skips one."""
    return bool(r.req.params.logit_bias) or _min_tokens_due(r) or _penalised(r)


def _row_seed(seed: int, position: int) -> int:
    # The same request, seed and output index always draw the same noise, whatever the batch.
    return hash((seed, position)) & 0x7FFF_FFFF_FFFF_FFFF


class Sampler:
    def __init__(self, vocab_size: int, eos_token_ids: frozenset[int], seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.generator: torch.Generator | None = None
        self.seed = seed

    def prepare(self, rows: list[SampleRow], device: torch.device) -> SamplingTensors:
        ps = [r.req.params for r in rows]
        V = self.vocab_size

        def t(vals: list, dtype: torch.dtype) -> torch.Tensor:
            return dev.to_device(torch.tensor(vals, dtype=dtype), device)

        greedy = [p.greedy for p in ps]
        return SamplingTensors(
            greedy=t(greedy, torch.bool), all_greedy=all(greedy),
            temperature=t([1.0 if p.greedy else p.temperature for p in ps], torch.float32),
            top_k=t([p.top_k or V for p in ps], torch.int64) if any(p.top_k for p in ps) else None,
            top_p=t([p.top_p for p in ps], torch.float32) if any(p.top_p < 1 for p in ps) else None,
            min_p=t([p.min_p for p in ps], torch.float32) if any(p.min_p > 0 for p in ps) else None,
            seeds=[None if p.seed is None else _row_seed(p.seed, r.num_output_tokens)
                   for p, r in zip(ps, rows)],
            num_logprobs=[p.logprobs for p in ps],
            draft=t([r.draft for r in rows], torch.int64) if any(r.draft >= 0 for r in rows) else None,
        )

    def apply_logits_processors(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """Bias, min_tokens and penalties, in place on fp32 logits [R, V]."""
        for i, r in enumerate(rows):
            p = r.req.params
            if p.logit_bias:
                ids = torch.tensor(list(p.logit_bias), device=logits.device)
                logits[i, ids] += torch.tensor(list(p.logit_bias.values()), device=logits.device)
            if _min_tokens_due(r):
                stops = set(p.stop_token_ids or ()) | (set() if p.ignore_eos else set(self.eos_token_ids))
                if stops:
                    logits[i, list(stops)] = float("-inf")
            if _penalised(r):
                self._penalise(logits[i], r)
        return logits

    def _penalise(self, row: torch.Tensor, r: SampleRow) -> None:
        p = r.req.params
        out = torch.tensor(r.output_token_ids, dtype=torch.int64, device=row.device)
        counts = torch.zeros_like(row).index_add_(0, out, torch.ones_like(out, dtype=row.dtype))
        if p.repetition_penalty != 1.0:
            seen = counts > 0
            seen[torch.tensor(r.req.prompt_token_ids, device=row.device)] = True
            pen = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            row.copy_(torch.where(seen, pen, row))
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
        # A valid penalty near 0 (1e-300 is 0 in fp32) sends positive logits to +inf, and the
        # softmax's inf - inf is NaN: cap them at fp32's largest (-inf stays: masked tokens).
        row.clamp_(max=torch.finfo(row.dtype).max)

    @staticmethod
    def argmax_only(rows: list[SampleRow], st: SamplingTensors) -> bool:
        """Every row takes the argmax of the raw logits: greedy, no logprobs, nothing that
        edits logits (penalties, bias, a min_tokens eos mask)."""
        return (st.all_greedy and st.bitmask is None and all(n is None for n in st.num_logprobs)
                and not any(map(_processed, rows)))

    def sample(self, logits: torch.Tensor, rows: list[SampleRow], st: SamplingTensors
               ) -> tuple[torch.Tensor, torch.Tensor | None, list[Logprobs | None]]:
        """logits [R, V] -> (emitted token per row [R] int64, accepted-draft flags [R] bool or
        None without drafts, per-row logprobs of the emitted tokens); all on device."""
        if self.argmax_only(rows, st):
            # Widening to fp32 is exact, so the model-dtype logits have the same max and first
            # index: skip the [R, V] fp32 copy (16 x 262k bf16 on the dev box: 1.9 ms against
            # 2.6 with the copy, whose fresh 16 MB also page-faulted every few steps).
            tokens = kernels.row_argmax(logits)  # [R]
            accepted = None if st.draft is None else tokens == st.draft
            return tokens, accepted, [None] * len(rows)
        step = max(1, CHUNK_BYTES // (4 * logits.shape[-1]))
        if len(rows) <= step:
            return self._sample_rows(logits, rows, st)
        parts = [self._sample_rows(logits[a:a + step], rows[a:a + step], st.rows(a, a + step))
                 for a in range(0, len(rows), step)]
        accepted = None if parts[0][1] is None else torch.cat([x[1] for x in parts])
        return torch.cat([x[0] for x in parts]), accepted, [lp for x in parts for lp in x[2]]

    def _sample_rows(self, logits: torch.Tensor, rows: list[SampleRow], st: SamplingTensors
                     ) -> tuple[torch.Tensor, torch.Tensor | None, list[Logprobs | None]]:
        logits = logits.float()
        if st.bitmask is not None:  # grammars first: bias or penalties never revive a masked token
            apply_bitmask(logits, st.bitmask)
        logits = self.apply_logits_processors(logits, rows)
        logprobs = logits.log_softmax(-1) if any(n is not None for n in st.num_logprobs) else None
        # max(dim).indices' rule (argmax's first-index tie rule; on the CPU a vector kernel).
        tokens = kernels.row_argmax(logits)  # [R]
        d = st.draft
        accepted = None if d is None else tokens == d  # greedy acceptance
        if not st.all_greedy:
            probs = self._probs(logits, st)  # [R, V]
            noise, u = self._noise(probs, st)
            if d is not None:
                has = d >= 0
                dd = d.clamp(min=0)[:, None]  # [R, 1]
                p_d = probs.gather(1, dd)[:, 0] * has
                probs = probs.scatter(1, dd, torch.where(has[:, None], 0.0, probs.gather(1, dd)))
                accepted = torch.where(st.greedy, accepted, u < p_d)
            drawn = (probs / noise).max(dim=-1).indices  # exponential race = a draw from probs
            tokens = torch.where(st.greedy, tokens, drawn)
        if accepted is not None:
            tokens = torch.where(accepted, d, tokens)
        return tokens, accepted, self._pick_logprobs(logprobs, tokens, st)

    def _probs(self, logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
        logits = logits / st.temperature[:, None]
        if st.min_p is not None:
            probs = logits.softmax(-1)
            thresh = st.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            logits = logits.masked_fill(probs < thresh, float("-inf"))
        if st.top_k is not None or st.top_p is not None:
            logits = top_k_top_p(logits, st.top_k, st.top_p)
        return logits.softmax(-1)

    def _noise(self, probs: torch.Tensor, st: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor]:
        """Exponential race noise [R, V] and acceptance uniforms [R]; seeded rows draw their own."""
        if self.generator is None or self.generator.device != probs.device:
            self.generator = torch.Generator(probs.device).manual_seed(self.seed)
        q = torch.empty_like(probs).exponential_(generator=self.generator)
        u = torch.rand(probs.shape[0], device=probs.device, generator=self.generator)
        for i, seed in enumerate(st.seeds):
            if seed is not None:
                g = torch.Generator(probs.device).manual_seed(seed)
                q[i].exponential_(generator=g)
                u[i] = torch.rand((), device=probs.device, generator=g)
        return q, u

    @staticmethod
    def _pick_logprobs(lp: torch.Tensor | None, tokens: torch.Tensor, st: SamplingTensors
                       ) -> list[Logprobs | None]:
        if lp is None:
            return [None] * len(st.num_logprobs)
        k = max(n or 0 for n in st.num_logprobs)
        top_v, top_i = lp.topk(max(k, 1), dim=-1)
        chosen = lp.gather(1, tokens[:, None])[:, 0]
        # JSON has no -inf or NaN: a masked token's logprob is reported as vLLM does, -9999.0.
        top_v = top_v.nan_to_num(nan=LOGPROB_FLOOR).clamp_(min=LOGPROB_FLOOR)
        chosen = chosen.nan_to_num(nan=LOGPROB_FLOOR).clamp_(min=LOGPROB_FLOOR)
        top_v, top_i, chosen, toks = top_v.tolist(), top_i.tolist(), chosen.tolist(), tokens.tolist()
        out: list[Logprobs | None] = []
        for i, n in enumerate(st.num_logprobs):
            if n is None:
                out.append(None)
                continue
            out.append([(toks[i], chosen[i])] + list(zip(top_i[i][:n], top_v[i][:n])))
        return out


def top_k_top_p(logits: torch.Tensor, k: torch.Tensor | None, p: torch.Tensor | None) -> torch.Tensor:
    """Mask [S, V] logits outside each row's top-k and nucleus p (at least one token survives)."""
    srt, idx = logits.sort(dim=-1, descending=True)  # [S, V]
    if k is not None:
        kth = srt.gather(1, (k - 1).clamp(0, logits.shape[-1] - 1)[:, None])  # [S, 1]
        srt = srt.masked_fill(srt < kth, float("-inf"))
    if p is not None:
        probs = srt.softmax(-1)
        # Drop a token when the mass strictly before it already reaches p.
        drop = (probs.cumsum(-1) - probs) >= p[:, None]
        drop[:, 0] = False
        srt = srt.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, idx, srt)
