"""Attention metadata: built once per step by the runner, read by every attention layer."""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """The flat batch's boundaries. T = new tokens this step, S = scheduled sequences.

    Query token j of sequence s sits at absolute position seq_lens[s] - q_len[s] + j and sees
    keys 0..=that position (further limited by a layer's sliding window).
    """

    cu_seqlens_q: torch.Tensor  # [S+1] int32, exclusive prefix sum of query lengths
    seq_lens: torch.Tensor  # [S] int32, context length including this step's tokens
    block_table: torch.Tensor  # [S, max_blocks] int32, padded with the null block 0
    slot_mapping: torch.Tensor  # [T] int64, block_id * block_size + offset; < 0 = skip
    max_q_len: int
    max_seq_len: int
    # Host copies so backends can loop/choose paths without reading device tensors.
    cu_seqlens_q_host: list[int]
    seq_lens_host: list[int]
    # Each sequence's prompt length (LongRoPE picks its factors by it); None in decode graphs,
    # whose tokens all sit past their prompts.
    prompt_lens_host: list[int] | None = None
    # What a backend derives from the above on the step's first layer and every later layer
    # reuses (e.g. the CPU backend's decode/prefill row split); dies with the step.
    derived: dict[str, Any] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def is_decode_only(self) -> bool:
        return self.max_q_len == 1


class _Scope:
    __slots__ = ("current",)

    def __init__(self) -> None:
        self.current: AttentionMetadata | None = None


class _ThreadScope(threading.local):
    current: AttentionMetadata | None = None


# One process-wide scope, unless data-parallel replicas step engines on several threads at once
# (`per_thread_scopes`): a threading.local read costs more than a slot read, per layer per step.
_scope: _Scope | _ThreadScope = _Scope()


def per_thread_scopes() -> None:
    """Give every thread its own forward scope; call before any forward runs."""
    global _scope
    if not isinstance(_scope, _ThreadScope):
        _scope = _ThreadScope()


@contextlib.contextmanager
def forward_context(meta: AttentionMetadata) -> Iterator[None]:
    """Scope the step's metadata; never nested, always reset (even when the forward raises)."""
    assert _scope.current is None, "forward_context is not re-entrant"
    _scope.current = meta
    try:
        yield
    finally:
        _scope.current = None


def current_metadata() -> AttentionMetadata:
    meta = _scope.current
    assert meta is not None, "attention called outside forward_context"
    return meta
