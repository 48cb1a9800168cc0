"""Per-request sampling parameters, shaped like vLLM's `SamplingParams` (torch-free)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from flatserve.engine.outputs import RequestOutputKind

# Seeds of any size are reduced to 64 bits, deterministically (Python ints are unbounded; the
# generators take 64). n past this many samples is refused: each is a full request's state.
SEED_MOD = 1 << 64
MAX_N = 256


class ParamError(ValueError):
    """A bad per-request value; `param` names the field (the HTTP layer's 400 carries it)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


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
    output_kind: RequestOutputKind = RequestOutputKind.CUMULATIVE
    _stop_list: list[str] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self._stop_list = [self.stop]
        else:
            self._stop_list = list(self.stop or [])
        if self.top_k == -1:
            self.top_k = 0
        if _is_int(self.seed):
            self.seed %= SEED_MOD
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
        """Raise ParamError (a ValueError) naming the bad value and its allowed range."""
        for name in ("n", "min_tokens", "top_k"):
            _int(self, name)
        for name in ("max_tokens", "logprobs", "prompt_logprobs", "seed"):
            if getattr(self, name) is not None:
                _int(self, name)
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):
            _finite(self, name)
        if not 1 <= self.n <= MAX_N:
            raise ParamError(f"n must be in [1, {MAX_N}], got {self.n!r}", "n")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ParamError(f"max_tokens must be at least 1, got {self.max_tokens}", "max_tokens")
        if self.min_tokens < 0:
            raise ParamError(f"min_tokens must be >= 0, got {self.min_tokens}", "min_tokens")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ParamError(
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})", "min_tokens")
        if self.temperature < 0:
            raise ParamError(f"temperature must be >= 0, got {self.temperature}", "temperature")
        if not 0.0 < self.top_p <= 1.0:
            raise ParamError(f"top_p must be in (0, 1], got {self.top_p}", "top_p")
        if self.top_k < 0:
            raise ParamError(f"top_k must be -1 (disabled) or >= 1, got {self.top_k}", "top_k")
        if not 0.0 <= self.min_p <= 1.0:
            raise ParamError(f"min_p must be in [0, 1], got {self.min_p}", "min_p")
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ParamError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
                             "presence_penalty")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ParamError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
                             "frequency_penalty")
        if self.repetition_penalty <= 0:
            raise ParamError(f"repetition_penalty must be > 0, got {self.repetition_penalty}",
                             "repetition_penalty")
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not 0 <= v <= 20:
                raise ParamError(f"{name} must be in [0, 20], got {v}", name)
        if any(not isinstance(s, str) or not s for s in self._stop_list):
            raise ParamError("stop strings must be non-empty strings", "stop")
        for s in self._stop_list:
            check_text(s, "stop")
        for k, v in (self.logit_bias or {}).items():
            if not _is_int(k) or isinstance(v, bool) or not isinstance(v, (int, float)) \
                    or not math.isfinite(v):
                raise ParamError(f"logit_bias must map token ids to finite numbers, got {k!r}: {v!r}",
                                 "logit_bias")
        if any(not _is_int(t) for t in self.stop_token_ids or ()):
            raise ParamError("stop_token_ids must be integers", "stop_token_ids")

    def check_vocab(self, vocab_size: int) -> None:
        """The checks that need the model: every token id in [0, vocab_size); top_k past the
        vocabulary is the same as no top_k (the sampler's tensors index [0, V))."""
        for k in self.logit_bias or {}:
            if not 0 <= k < vocab_size:
                raise ParamError(f"logit_bias key {k} is not a token id of this model: ids are in "
                                 f"[0, {vocab_size})", "logit_bias")
        for t in self.stop_token_ids or ():
            if not 0 <= t < vocab_size:
                raise ParamError(f"stop token id {t} is outside the vocabulary [0, {vocab_size})",
                                 "stop_token_ids")
        if self.top_k >= vocab_size:
            self.top_k = 0


def check_text(text: str, param: str) -> None:
    """Refuse a lone surrogate (U+D800..U+DFFF): JSON's \\ud800 escape makes one, and no
    tokenizer or UTF-8 encoder can take it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise ParamError(f"{param} contains a lone surrogate (U+{ord(text[e.start]):04X}) at "
                         f"character {e.start}: text must be valid Unicode", param) from None


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int(p: SamplingParams, name: str) -> None:
    v = getattr(p, name)
    if not _is_int(v):
        raise ParamError(f"{name} must be an integer, got {v!r}", name)


def _finite(p: SamplingParams, name: str) -> None:
    v = getattr(p, name)
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ParamError(f"{name} must be a finite number, got {v!r}", name)


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
