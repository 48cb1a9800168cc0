"""Helpers the GPU benchmark scripts share: seeded random prompts and the measured copy bandwidth
(the memory floor's denominator), and the weight bytes a MoE decode step reads."""
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


def moe_active_bytes(st, bs: int) -> float:
    """Weight bytes a decode step of `bs` rows reads: all but the experts, plus the experts
    selected, E * (1 - (1 - k/E)^bs) per sparse layer in expectation under uniform routing
    (random weights route near-uniformly; Qwen3-30B-A3B at 64 rows: 126 of 128 experts)."""
    m, moe = st.model, st.model.moe
    per_expert = 3 * m.hidden_size * moe.intermediate_size * 2  # gate, up, down in bf16
    sparse = sum(moe.sparse_layers)
    chosen = moe.num_experts * (1 - (1 - moe.top_k / moe.num_experts) ** bs)
    return st.weights_bytes - sparse * per_expert * (moe.num_experts - chosen)


def decode_step_ms(eng, bs: int, vocab: int, ctx: int, emit: bool = False,
                   with_mean: bool = False):
    """Decode-step time of `bs` requests at context ~ctx: the median interval of 30 back-to-back
    `Engine.step`s (async scheduling overlaps host and GPU only when stepped back to back; the
    median drops a GC pause or an OS hiccup) and, with_mean, their mean. `emit` steps as the
    server does (outputs for unfinished requests too)."""
    import torch

    from flatserve import SamplingParams

    for p in prompts(bs, ctx, vocab, seed=bs + emit):  # fresh prompts: no prefix-cache hits
        eng.add_request(p, SamplingParams(max_tokens=40, ignore_eos=True, temperature=0))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.requests.values()):
        eng.step(emit)
    for _ in range(3):
        eng.step(emit)
    torch.cuda.synchronize()
    stamps = [time.perf_counter()]
    for _ in range(30):
        eng.step(emit)
        stamps.append(time.perf_counter())
    torch.cuda.synchronize()
    gaps = sorted(b - a for a, b in zip(stamps, stamps[1:]))
    mean = (time.perf_counter() - stamps[0]) / 30 * 1e3
    while eng.has_unfinished():
        eng.step(emit)
    med = gaps[len(gaps) // 2] * 1e3
    return (med, mean) if with_mean else med
