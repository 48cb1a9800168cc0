"""Step limits sized by the device when unset (flatserve/engine/limits.py)."""
from __future__ import annotations

import random

from flatserve.engine.limits import (CPU_SEQS, CPU_TOKENS, CPU_TOKENS_EMULATED_BF16, CPU_TOKENS_NO_AMX,
                                     GPU_TIERS, size_limits)
from flatserve.memory import GiB


def test_cpu_keeps_its_measured_defaults_and_flags_override() -> None:
    lim = size_limits(None, None, "cpu", 24 * GiB, 640, 2048, 2)
    assert (lim.max_num_seqs, lim.max_num_batched_tokens) == (CPU_SEQS, CPU_TOKENS)
    lim = size_limits(None, None, "cpu", 24 * GiB, 640, 2048, 2, fast_bf16=False)
    assert (lim.max_num_seqs, lim.max_num_batched_tokens) == (CPU_SEQS, CPU_TOKENS_EMULATED_BF16)
    for fast in (True, False):  # no AMX: its budget, or the emulated-bf16 one (why: the start-up line)
        lim = size_limits(None, None, "cpu", 24 * GiB, 640, 2048, 2, fast_bf16=fast, amx=False)
        assert lim.max_num_batched_tokens == (CPU_TOKENS_NO_AMX if fast else CPU_TOKENS_EMULATED_BF16)
        assert ("no AMX" in lim.why) == fast
    assert max(CPU_TOKENS_EMULATED_BF16, CPU_TOKENS_NO_AMX) < CPU_TOKENS
    t = random.randint(1, 99999)
    assert size_limits(None, t, "cpu", 24 * GiB, 640, 2048, 2, fast_bf16=False).max_num_batched_tokens == t
    s, t = random.randint(1, 999), random.randint(1, 99999)
    lim = size_limits(s, t, "cuda", 80 * GiB, 4096, 14336, 2)
    assert (lim.max_num_seqs, lim.max_num_batched_tokens, lim.why) == (s, t, "as given")
    lim = size_limits(s, None, "cuda", 80 * GiB, 1024, 3072, 2)
    assert lim.max_num_seqs == s and lim.max_num_batched_tokens == GPU_TIERS[0][2]


def test_gpu_tiers_by_memory_and_activation_bound() -> None:
    # An 80 GB card with a small model takes the top tier whole.
    lim = size_limits(None, None, "cuda", 80 * GiB, 1024, 3072, 2)
    assert (lim.max_num_seqs, lim.max_num_batched_tokens) == GPU_TIERS[0][1:]
    # A 24 GB card: the middle tier.
    lim = size_limits(None, None, "cuda", 24 * GiB, 1024, 3072, 2)
    assert (lim.max_num_seqs, lim.max_num_batched_tokens) == GPU_TIERS[1][1:]
    # A wide model on a small card: the token budget is halved until a step's activations
    # (6 hidden + 3 intermediate values a token) fit a tenth of the memory, never below the
    # sequence cap.
    mem, h, i = 8 * GiB, 8192, 28672
    lim = size_limits(None, None, "cuda", mem, h, i, 2)
    per_token = (6 * h + 3 * i) * 2
    assert lim.max_num_batched_tokens * per_token <= 0.1 * mem or lim.max_num_batched_tokens == 2048
    assert lim.max_num_batched_tokens >= lim.max_num_seqs
    assert lim.max_num_batched_tokens * 2 * per_token > 0.1 * mem  # halved no further than needed
