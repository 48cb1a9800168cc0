"""Helpers the GPU benchmark scripts share: seeded random prompts and the measured copy bandwidth
(the memory floor's denominator)."""
from __future__ import annotations

import random
import time


def prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """n prompts of `length` random ids in [4, vocab): no two share a prefix."""
    rng = random.Random(seed)
    return [[rng.randrange(4, vocab) for _ in range(length)] for _ in range(n)]


def copy_bandwidth() -> float:
    """Device-to-device copy rate, bytes read + written per second (256 MiB, best of 20)."""
    import torch

    x = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(20):
        y.copy_(x)
    torch.cuda.synchronize()
    return 2 * x.numel() * 20 / (time.perf_counter() - t)
