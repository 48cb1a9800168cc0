"""N-gram (prompt lookup) proposer: if the text's last n tokens occurred before, propose what
followed them. Host-only numpy; free on repetitive text (code edits, quoting summaries)."""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from flatserve.engine.request import Request
from flatserve.spec import max_drafts


def ngram_lookup(tokens: np.ndarray, k: int, min_n: int, max_n: int) -> list[int]:
    """Longest suffix n-gram (max_n down to min_n) with an earlier occurrence; the next k tokens
    after its most recent occurrence that has k of them (else its earliest). tokens: [L] int64.

    (In a loop like "a b a b a b" the latest match has one token after it; an earlier one has k.)"""
    L = len(tokens)
    for n in range(min(max_n, L - 1), min_n - 1, -1):
        # Windows starting at 0..L-n-1: each has at least one token after it.
        wins = sliding_window_view(tokens[:L - 1], n)  # [L-n, n]
        hits = np.flatnonzero((wins == tokens[L - n:]).all(axis=1))
        if hits.size:
            full = hits[hits + n + k <= L]
            start = int(full[-1] if full.size else hits[0]) + n
            return tokens[start:start + k].tolist()
    return []


class NgramProposer:
    def __init__(self, k: int, min_n: int, max_n: int, max_model_len: int) -> None:
        self.k, self.min_n, self.max_n, self.max_model_len = k, min_n, max_n, max_model_len

    def propose(self, reqs: list[Request]) -> None:
        for r in reqs:
            k = max_drafts(r, self.k, self.max_model_len)
            r.spec_token_ids = (ngram_lookup(np.asarray(r.token_ids, np.int64), k, self.min_n,
                                             self.max_n) if k else [])
