"""CPU attention backend: decode rows through a C++ kernel that reads paged KV in place.

Every query row of a sequence with at most MAX_KERNEL_ROWS new tokens (decodes, draft-verify
runs) goes to `csrc/paged_decode_cpu.cpp` in one call per layer, each row as a decode at its own
position; longer prefill chunks (compute-bound) keep the torch reference's per-sequence SDPA. The kernel is compiled on
first use with the machine's C++ compiler (torch.utils.cpp_extension, cached under
~/.cache/torch_extensions); where that fails, `available()` is False and the device module picks
the torch backend instead.
"""
from __future__ import annotations

import logging
from pathlib import Path
from types import ModuleType

import torch

from flatserve import device as dev
from flatserve.attention.base import LayerAttnParams
from flatserve.attention.metadata import AttentionMetadata
from flatserve.attention.torch_backend import attend_seqs, paged_attention_ref, write_kv

log = logging.getLogger(__name__)
_SRC = Path(__file__).parent / "csrc" / "paged_decode_cpu.cpp"
LANES = 16  # the kernel's slice width (kLanes): head sizes must be multiples of it
_module: ModuleType | None = None
_error: str | None = None


def kernel() -> ModuleType | None:
    """The compiled module, built once per process (None, with the reason logged, if it fails)."""
    global _module, _error
    if _module is None and _error is None:
        try:
            _module = dev.build_cpu_extension("flatserve_paged_decode_cpu", str(_SRC))
        except Exception as e:  # no compiler, no ninja, headers missing: fall back, say why
            _error = dev.build_error(e)
            log.warning("CPU paged-decode kernel unavailable (%s); using the torch backend", _error)
    return _module


def available() -> bool:
    return kernel() is not None


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_table: torch.Tensor, seq_lens: torch.Tensor, p: LayerAttnParams,
                 sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [S, Hq, D], one token per sequence at position seq_lens-1 -> [S, Hq, D]."""
    mod = kernel()
    assert mod is not None, "CPU paged-decode kernel not built"
    empty = torch.empty(0, dtype=torch.float32)
    return mod.paged_decode(q.contiguous(), k_cache, v_cache, block_table.contiguous(),
                            seq_lens.contiguous(), p.scale, p.sliding_window or 0,
                            p.softcap or 0.0, empty if sinks is None else sinks)


# Sequences with at most this many new rows (decodes, draft-verify runs of k + 1, short chunks)
# go through the decode kernel one row at a time; longer chunks keep the per-sequence SDPA.
# Each row re-reads its sequence's K/V, which a 1,500-token Gemma context (1.5 MB a layer) keeps
# in L2 between the run's rows; the SDPA path costs ~0.5 ms of host work per sequence and layer
# (4-token verify runs at 16 requests: 166 ms of a 230 ms step in cProfile, before this path).
MAX_KERNEL_ROWS = 16


def _split(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """-> (q rows for the kernel [R], their block-table rows [R, max_blocks], each row's visible
    length [R] int32, the sequences left to SDPA); found on the step's first layer and kept on
    its metadata for the others."""
    got = meta.derived.get("cpu_split")
    if got is None:
        cu, lens = meta.cu_seqlens_q_host, meta.seq_lens_host
        rows: list[int] = []
        seqs: list[int] = []
        vis: list[int] = []
        rest: list[int] = []
        for s in range(meta.num_seqs):
            n = cu[s + 1] - cu[s]
            if n > MAX_KERNEL_ROWS:
                rest.append(s)
                continue
            for j in range(n):  # row j sits at position lens[s] - n + j and sees keys up to it
                rows.append(cu[s] + j)
                seqs.append(s)
                vis.append(lens[s] - n + j + 1)
        table = meta.block_table[torch.tensor(seqs, dtype=torch.long)].contiguous()
        got = meta.derived["cpu_split"] = (torch.tensor(rows, dtype=torch.long), table,
                                           torch.tensor(vis, dtype=torch.int32), rest)
    return got


class CpuAttentionBackend:
    name = "cpu"

    def __init__(self) -> None:
        if kernel() is None:
            raise ValueError(f"attention backend 'cpu' needs its C++ kernel, which did not build: {_error}")

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                p: LayerAttnParams, sinks: torch.Tensor | None = None) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
        if q.shape[-1] % LANES:  # the kernel works in 16-lane slices of the head
            return paged_attention_ref(q, k_cache, v_cache, meta, p, sinks)
        if meta.is_decode_only and q.shape[0] == meta.num_seqs:  # one row per sequence
            return paged_decode(q, k_cache, v_cache, meta.block_table, meta.seq_lens, p, sinks)
        rows, table, vis, rest = _split(meta)
        if not rest:  # every row through the kernel, already in row order
            return paged_decode(q, k_cache, v_cache, table, vis, p, sinks)
        out = torch.empty_like(q)
        if len(rows):
            out[rows] = paged_decode(q[rows], k_cache, v_cache, table, vis, p, sinks)
        attend_seqs(q, k_cache, v_cache, meta, p, sinks, out, rest)
        return out
