"""Vectorised sampler with per-request parameters; host `prepare`, device `sample`.

Order (as vLLM): logit_bias, min_tokens mask, penalties -> (logprobs of these processed logits) ->
greedy argmax | temperature, min-p, top-k, top-p, exponential-race draw.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from flatserve.engine.request import Request

Logprobs = list[tuple[int, float]]  # (token id, logprob): the sampled token first, then top-n


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


def _row_seed(seed: int, position: int) -> int:
    # The same request, seed and output index always draw the same noise, whatever the batch.
    return hash((seed, position)) & 0x7FFF_FFFF_FFFF_FFFF


class Sampler:
    def __init__(self, vocab_size: int, eos_token_ids: frozenset[int], seed: int = 0) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.generator: torch.Generator | None = None
        self.seed = seed

    def prepare(self, reqs: list[Request], device: torch.device) -> SamplingTensors:
        ps = [r.params for r in reqs]
        V = self.vocab_size

        def t(vals: list, dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(vals, dtype=dtype).to(device, non_blocking=True)

        greedy = [p.greedy for p in ps]
        return SamplingTensors(
            greedy=t(greedy, torch.bool), all_greedy=all(greedy),
            temperature=t([1.0 if p.greedy else p.temperature for p in ps], torch.float32),
            top_k=t([p.top_k or V for p in ps], torch.int64) if any(p.top_k for p in ps) else None,
            top_p=t([p.top_p for p in ps], torch.float32) if any(p.top_p < 1 for p in ps) else None,
            min_p=t([p.min_p for p in ps], torch.float32) if any(p.min_p > 0 for p in ps) else None,
            seeds=[None if p.seed is None else _row_seed(p.seed, r.num_output_tokens)
                   for p, r in zip(ps, reqs)],
            num_logprobs=[p.logprobs for p in ps],
        )

    def apply_logits_processors(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """Bias, min_tokens and penalties, in place on fp32 logits [S, V]."""
        for i, r in enumerate(reqs):
            p = r.params
            if p.logit_bias:
                ids = torch.tensor(list(p.logit_bias), device=logits.device)
                logits[i, ids] += torch.tensor(list(p.logit_bias.values()), device=logits.device)
            if r.num_output_tokens < p.min_tokens:
                stops = set(p.stop_token_ids or ()) | (set() if p.ignore_eos else set(self.eos_token_ids))
                if stops:
                    logits[i, list(stops)] = float("-inf")
            if p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty:
                self._penalise(logits[i], r)
        return logits

    def _penalise(self, row: torch.Tensor, r: Request) -> None:
        p = r.params
        out = torch.tensor(r.output_token_ids, dtype=torch.int64, device=row.device)
        counts = torch.zeros_like(row).index_add_(0, out, torch.ones_like(out, dtype=row.dtype))
        if p.repetition_penalty != 1.0:
            seen = counts > 0
            seen[torch.tensor(r.prompt_token_ids, device=row.device)] = True
            pen = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            row.copy_(torch.where(seen, pen, row))
        row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)

    def sample(self, logits: torch.Tensor, reqs: list[Request], st: SamplingTensors
               ) -> tuple[torch.Tensor, list[Logprobs | None]]:
        """logits [S, V] -> token ids [S] (int64, on device) and per-row logprobs."""
        logits = self.apply_logits_processors(logits.float(), reqs)
        logprobs = logits.log_softmax(-1) if any(n is not None for n in st.num_logprobs) else None
        tokens = logits.argmax(dim=-1)
        if not st.all_greedy:
            probs = self._probs(logits, st)
            drawn = (probs / self._exponential(probs, st)).argmax(dim=-1)
            tokens = torch.where(st.greedy, tokens, drawn)
        return tokens, self._pick_logprobs(logprobs, tokens, st)

    def _probs(self, logits: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
        logits = logits / st.temperature[:, None]
        if st.min_p is not None:
            probs = logits.softmax(-1)
            thresh = st.min_p[:, None] * probs.max(dim=-1, keepdim=True).values
            logits = logits.masked_fill(probs < thresh, float("-inf"))
        if st.top_k is not None or st.top_p is not None:
            logits = top_k_top_p(logits, st.top_k, st.top_p)
        return logits.softmax(-1)

    def _exponential(self, probs: torch.Tensor, st: SamplingTensors) -> torch.Tensor:
        if self.generator is None or self.generator.device != probs.device:
            self.generator = torch.Generator(probs.device).manual_seed(self.seed)
        q = torch.empty_like(probs).exponential_(generator=self.generator)
        for i, seed in enumerate(st.seeds):
            if seed is not None:
                g = torch.Generator(probs.device).manual_seed(seed)
                q[i].exponential_(generator=g)
        return q

    @staticmethod
    def _pick_logprobs(lp: torch.Tensor | None, tokens: torch.Tensor, st: SamplingTensors
                       ) -> list[Logprobs | None]:
        if lp is None:
            return [None] * len(st.num_logprobs)
        k = max(n or 0 for n in st.num_logprobs)
        top_v, top_i = lp.topk(max(k, 1), dim=-1)
        chosen = lp.gather(1, tokens[:, None])[:, 0]
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
