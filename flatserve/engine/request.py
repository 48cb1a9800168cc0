"""A request as the scheduler sees it: token counts, not phases (torch-free)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

from flatserve.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in _FINISHED  # a frozenset: asked several times per request per step


_FINISHED = frozenset((RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                       RequestStatus.FINISHED_ABORTED))


@dataclass(slots=True, eq=False)  # identity equality: two requests are never 'equal'
class Request:
    """All tokens of a request live in `token_ids` (prompt then output).

    NOTE: invariant `0 <= num_computed_tokens <= num_tokens`; the scheduler schedules
    `num_tokens - num_computed_tokens` tokens (a prompt chunk, one decode token, or a
    recompute after preemption) without knowing which phase that is.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int  # resolved: params.max_tokens or what max_model_len leaves
    arrival: int = 0  # monotonic order for FCFS and "newest first" preemption
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    # Speculative decoding: tokens proposed for the next step (not yet part of `token_ids`),
    # and how many tokens the draft model's own KV holds (draft-model proposer only).
    spec_token_ids: list[int] = field(default_factory=list)
    num_draft_computed: int = 0
    # Async scheduling: tokens sampled by a launched step whose values are still on the device
    # (0 or 1 between steps). The scheduler counts them as known; the runner reads them there.
    num_pending: int = 0
    # Constrained decoding: the request's grammar state (engine/structured.py); the scheduler
    # never reads it, and the engine admits the request only once its grammar has compiled.
    grammar: Any = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def finish_reason(self) -> str | None:
        return self.status.value if self.status.finished else None
