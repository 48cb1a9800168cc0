"""Random paged-attention cases shared by the kernel tests (Triton on CUDA, C++ on the CPU)."""
from __future__ import annotations

import random

import torch

from flatserve.attention.metadata import AttentionMetadata


def make_case(q_lens: list[int], seq_lens: list[int], hq: int, hkv: int, d: int, bs: int,
              dtype: torch.dtype, seed: int | None = None, device: str = "cuda"):
    """Random q, paged caches with shuffled (non-contiguous) block tables, and the metadata."""
    g = torch.Generator(device=device).manual_seed(seed if seed is not None else random.randrange(1 << 30))
    need = [-(-L // bs) for L in seq_lens]
    num_blocks = sum(need) + 8
    ids = torch.randperm(num_blocks - 1, device="cpu")[: sum(need)] + 1  # never the null block
    table = torch.zeros(len(seq_lens), max(need), dtype=torch.int32)
    o = 0
    for i, n in enumerate(need):
        table[i, :n] = ids[o:o + n]
        o += n
    kc = torch.randn(num_blocks, bs, hkv, d, generator=g, device=device).to(dtype)
    vc = torch.randn(num_blocks, bs, hkv, d, generator=g, device=device).to(dtype)
    T = sum(q_lens)
    q = torch.randn(T, hq, d, generator=g, device=device).to(dtype)
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    pos = torch.cat([torch.arange(L - n, L) for n, L in zip(q_lens, seq_lens)])
    seq_of = torch.repeat_interleave(torch.arange(len(q_lens)), torch.tensor(q_lens))
    slots = table[seq_of, pos // bs].long() * bs + pos % bs
    meta = AttentionMetadata(
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_table=table.to(device), slot_mapping=slots.to(device), max_q_len=max(q_lens),
        max_seq_len=max(seq_lens), cu_seqlens_q_host=cu, seq_lens_host=list(seq_lens))
    return q, kc, vc, meta


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert not torch.isnan(out).any(), "NaN in output"
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()
