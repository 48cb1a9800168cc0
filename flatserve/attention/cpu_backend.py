"""CPU attention backend: decode rows through a C++ kernel that reads paged KV in place.

Every sequence with at most MAX_KERNEL_ROWS new tokens (decodes, draft-verify runs) goes to
`csrc/paged_decode_cpu.cpp` in one call per layer, each row seeing the keys up to its own
position; longer prefill chunks (compute-bound) keep the torch reference's per-sequence SDPA.
The kernel is compiled on first use with the machine's C++ compiler (torch.utils.cpp_extension,
cached under ~/.cache/torch_extensions); where that fails, `available()` is False and the device
module picks the torch backend instead.
"""
from __future__ import annotations

from pathlib import Path

import torch

from flatserve import device as dev
from flatserve.attention.base import LayerAttnParams
from flatserve.attention.metadata import AttentionMetadata
from flatserve.attention.torch_backend import attend_seqs, paged_attention_ref, write_kv

_SRC = Path(__file__).parent / "csrc" / "paged_decode_cpu.cpp"
LANES = 16  # the kernel's slice width (kLanes): head sizes must be multiples of it
# The compiled module, built once per process (None, with the reason logged, if it fails).
kernel = dev.CpuExtension("flatserve_paged_decode_cpu", str(_SRC), "attention uses the torch backend")


def available() -> bool:
    return kernel() is not None


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_table: torch.Tensor, seq_lens: torch.Tensor, p: LayerAttnParams,
                 sinks: torch.Tensor | None = None, cu_seqlens_q: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """q [R, Hq, D] -> [R, Hq, D]. Without cu_seqlens_q: one token per sequence (R == S) at
    position seq_lens - 1. With it ([S + 1] int32): sequence s's rows cu[s]..cu[s + 1] end at
    position seq_lens[s] - 1, each row seeing the keys up to its own position."""
    mod = kernel()
    assert mod is not None, "CPU paged-decode kernel not built"
    empty = torch.empty(0, dtype=torch.float32)
    cu = torch.empty(0, dtype=torch.int32) if cu_seqlens_q is None else cu_seqlens_q.contiguous()
    return mod.paged_decode(q.contiguous(), k_cache, v_cache, block_table.contiguous(),
                            seq_lens.contiguous(), cu, p.scale, p.sliding_window or 0,
                            p.softcap or 0.0, empty if sinks is None else sinks)


# Sequences with at most this many new rows (decodes, draft-verify runs of k + 1, short chunks)
# go through the decode kernel; longer chunks keep the per-sequence SDPA. The kernel walks a
# run's KV once for all its rows; its maths per row is a decode's (no matmul), so long chunks
# are better served by SDPA, whose per-sequence host work dominated short verify runs
# (benchmarks/offline_cpu.py, 16 requests with ngram speculation: 139.9 -> 193.7-239.1 tok/s).
MAX_KERNEL_ROWS = 16


def _split(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                               torch.Tensor, list[int]]:
    """-> the kernel's share (q rows [R], block-table rows [S', max_blocks], seq_lens [S'],
    cu_seqlens_q [S' + 1] over those rows) and the sequences left to SDPA; found on the step's
    first layer and kept on its metadata for the others."""
    got = meta.derived.get("cpu_split")
    if got is None:
        cu = meta.cu_seqlens_q_host
        short = [s for s in range(meta.num_seqs) if cu[s + 1] - cu[s] <= MAX_KERNEL_ROWS]
        rest = [s for s in range(meta.num_seqs) if cu[s + 1] - cu[s] > MAX_KERNEL_ROWS]
        rows = [t for s in short for t in range(cu[s], cu[s + 1])]
        local = [0]
        for s in short:
            local.append(local[-1] + cu[s + 1] - cu[s])
        idx = torch.tensor(short, dtype=torch.long)
        got = meta.derived["cpu_split"] = (
            torch.tensor(rows, dtype=torch.long), meta.block_table[idx].contiguous(),
            meta.seq_lens[idx].contiguous(), torch.tensor(local, dtype=torch.int32), rest)
    return got


class CpuAttentionBackend:
    name = "cpu"

    def __init__(self) -> None:
        if kernel() is None:
            raise ValueError(f"attention backend 'cpu' needs its C++ kernel, which did not build: "
                             f"{kernel.error}")

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                p: LayerAttnParams, sinks: torch.Tensor | None = None) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if q.shape[-1] % LANES:  # the kernel works in 16-lane slices of the head
            return paged_attention_ref(q, k_cache, v_cache, meta, p, sinks)
        if meta.max_q_len <= MAX_KERNEL_ROWS:  # decodes and verify runs only: all to the kernel
            return paged_decode(q, k_cache, v_cache, meta.block_table, meta.seq_lens, p, sinks,
                                meta.cu_seqlens_q)
        rows, table, lens, cu, rest = _split(meta)
        out = torch.empty_like(q)
        if len(rows):
            out[rows] = paged_decode(q[rows], k_cache, v_cache, table, lens, p, sinks, cu)
        attend_seqs(q, k_cache, v_cache, meta, p, sinks, out, rest)
        return out
