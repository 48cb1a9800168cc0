"""Per-request sampling parameters, shaped like vLLM's `SamplingParams` (torch-free)."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    logprobs: int | None = None  # top-n logprobs per generated token (plus the sampled one)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    structured_outputs: StructuredOutputs | None = None  # an output constraint (grammar)
    _stop_list: list[str] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self._stop_list = [self.stop]
        else:
            self._stop_list = list(self.stop or [])
        if self.top_k == -1:
            self.top_k = 0
        self.validate()

    @property
    def stop_strings(self) -> list[str]:
        return self._stop_list

    @property
    def uses_history(self) -> bool:
        """Penalties read every earlier output token (async scheduling waits for them)."""
        return self.repetition_penalty != 1.0 or bool(self.frequency_penalty or self.presence_penalty)

    @property
    def greedy(self) -> bool:
        # vLLM treats temperature below 1e-5 as greedy.
        return self.temperature < 1e-5

    def validate(self) -> None:
        """Raise ValueError naming the bad value and its allowed range."""
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"n must be an integer >= 1, got {self.n!r}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be >= 0, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be in [0, 20], got {self.logprobs}")
        if any(not s for s in self._stop_list):
            raise ValueError("stop strings must be non-empty")


_KINDS = ("json", "json_object", "any_json", "regex", "grammar", "choice")


@dataclass(slots=True)
class StructuredOutputs:
    """One output constraint, as vLLM's `StructuredOutputsParams`: a JSON schema (`json`, a dict or
    its text), `json_object` (any JSON object), `any_json` (any JSON value), a `regex`, an EBNF/GBNF
    `grammar`, or a `choice` list. Exactly one is set. Compiled by flatserve/engine/structured.py."""

    json: dict | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool = False
    any_json: bool = False

    def __post_init__(self) -> None:
        set_ = [k for k in _KINDS if getattr(self, k) not in (None, False)]
        if len(set_) != 1:
            raise ValueError("structured outputs need exactly one of json, json_object, any_json, "
                             f"regex, grammar, choice; got {set_ or 'none'}")
        if self.choice is not None and (not self.choice or not all(isinstance(c, str) and c
                                                                  for c in self.choice)):
            raise ValueError("structured output choice must be a non-empty list of non-empty strings")
        if isinstance(self.json, str):
            import json as _json

            try:
                self.json = _json.loads(self.json)
            except ValueError as e:
                raise ValueError(f"structured output json schema is not valid JSON: {e}") from None
        if self.json is not None and not isinstance(self.json, dict):
            raise ValueError("structured output json schema must be a JSON object")
        for k in ("regex", "grammar"):
            v = getattr(self, k)
            if v is not None and (not isinstance(v, str) or not v):
                raise ValueError(f"structured output {k} must be a non-empty string")

    @property
    def kind(self) -> str:
        return next(k for k in _KINDS if getattr(self, k) not in (None, False))

    @property
    def value(self) -> str:
        """The spec as text (schemas and choice lists as canonical JSON)."""
        import json as _json

        v = getattr(self, self.kind)
        if isinstance(v, (dict, list)):
            return _json.dumps(v, sort_keys=True, separators=(",", ":"))
        return v if isinstance(v, str) else ""

    def key(self) -> tuple[str, str]:
        return self.kind, self.value
