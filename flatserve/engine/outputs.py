"""Result records shaped like vLLM's (`RequestOutput.outputs[i].text` etc.)."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field


class RequestOutputKind(enum.Enum):
    """What each RequestOutput of a request carries (vLLM's names). CUMULATIVE: everything so
    far, every step. DELTA: only what is new since the last output (streaming: a step's work per
    request stays constant instead of growing with the output). FINAL_ONLY: one output, at the
    end (non-streaming requests: nothing is built while they run)."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass(slots=True)
class Logprob:
    logprob: float
    rank: int | None = None  # 1-based rank in the distribution, when known
    decoded_token: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that fired

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """Host times (time.monotonic(), seconds) as vLLM's `RequestOutput.metrics`: when the request
    arrived, when its first output token reached the host, and when it finished (None before)."""

    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    num_cached_tokens: int = 0
    metrics: RequestMetrics | None = None
    # Set when this request failed on its own (its sampling raised); its outputs end "abort".
    error: str | None = None
