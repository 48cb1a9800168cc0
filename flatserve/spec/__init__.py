"""Speculative decoding: proposers put draft tokens on `Request.spec_token_ids`; the scheduler
counts them in the token budget, the runner verifies them inside the normal flat step, and the
sampler accepts or rejects them (flatserve/engine/sampler.py). Nothing else changes."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from flatserve.engine.request import Request


class Proposer(Protocol):
    def propose(self, reqs: list[Request]) -> None:
        """Set `spec_token_ids` on each request (possibly empty)."""


@dataclass(slots=True)
class SpecStats:
    """Acceptance counters over verify groups (a request that carried >= 1 draft in a step)."""

    num_groups: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    def record(self, num_emitted: int, num_drafts: int) -> None:
        if num_drafts:
            self.num_groups += 1
            self.num_draft_tokens += num_drafts
            self.num_accepted_tokens += num_emitted - 1

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per verify step (accepted drafts + the target's own token)."""
        return (self.num_accepted_tokens + self.num_groups) / max(self.num_groups, 1)

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / max(self.num_draft_tokens, 1)


def max_drafts(req: Request, k: int, max_model_len: int) -> int:
    """Drafts this request can carry: k + 1 emitted tokens must fit max_tokens and the context."""
    return max(0, min(k, req.max_tokens - req.num_output_tokens - 1,
                      max_model_len - req.num_tokens - 1))
