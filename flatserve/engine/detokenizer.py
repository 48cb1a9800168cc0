"""Streaming-safe incremental detokenisation with stop strings (torch-free).

Text is released only when the last token decodes to whole characters (no trailing U+FFFD),
so a multi-byte character split across tokens is never emitted in halves.
"""
from __future__ import annotations

from typing import Any

_CONTEXT = 5  # prompt tokens decoded alongside, so leading spaces come out as the model meant


class IncrementalDetokenizer:
    def __init__(self, tokenizer: Any, prompt_ids: list[int], stop: list[str],
                 skip_special_tokens: bool = True, include_stop: bool = False) -> None:
        self.tok = tokenizer
        self.ids = list(prompt_ids[-_CONTEXT:])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)
        self._text = ""
        self.pending: list[int] = []
        self.stop = stop
        self.include_stop = include_stop
        self.skip = skip_special_tokens
        self.max_stop = max((len(s) for s in stop), default=0)

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.skip)

    def add(self, token_id: int) -> str | None:
        """Append a token; returns the stop string if one now appears (text is cut before it).

        Without stop strings decoding is deferred to the next read of the text: offline runs
        then decode once per request instead of twice per token on the step's critical path.
        """
        self.pending.append(token_id)
        return self._flush() if self.stop else None

    def _flush(self) -> str | None:
        if not self.stop and len(self.pending) > 1 and self._add_many(self.pending):
            self.pending.clear()
            return None
        hit = None
        for tok in self.pending:
            hit = self._add_one(tok)
            if hit is not None:
                break
        self.pending.clear()
        return hit

    def _add_one(self, token_id: int) -> str | None:
        self.ids.append(token_id)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            new = full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
            self._text += new
            return self._check_stop(len(new))
        return None

    def _add_many(self, ids: list[int]) -> bool:
        """Deferred tokens in two decodes instead of two per token (no stop strings to watch).
        False (nothing changed) when the tail is an unfinished character: go token by token."""
        window = self.ids[self.prefix_offset:]
        prefix = self._decode(window[:self.read_offset - self.prefix_offset])
        full = self._decode(window + ids)
        if len(full) < len(prefix) or full.endswith("\ufffd"):
            return False
        self.ids.extend(ids)
        self._text += full[len(prefix):]
        self.prefix_offset, self.read_offset = len(self.ids) - 1, len(self.ids)
        return True

    def _check_stop(self, num_new: int) -> str | None:
        if not self.stop:
            return None
        # A stop string can straddle the boundary between old and new text.
        start = max(0, len(self._text) - num_new - self.max_stop + 1)
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self._text.find(s, start)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self._text = self._text[:i + len(s)] if self.include_stop else self._text[:i]
        return s

    @property
    def text(self) -> str:
        if self.pending:
            self._flush()
        return self._text

    def visible_text(self, finished: bool) -> str:
        """Text safe to stream: hold back what could still become the start of a stop string."""
        if finished or not self.stop:
            return self.text
        return self.text[:max(0, len(self.text) - self.max_stop + 1)]
