"""CPU attention backend: decode rows through a C++ kernel that reads paged KV in place.

Every query row that is a sequence's only new token (plain decode) goes to
`csrc/paged_decode_cpu.cpp` in one call per layer; prefill chunks and verify runs (several
tokens, compute-bound) keep the torch reference's per-sequence SDPA. The kernel is compiled on
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


def _split(meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """-> (q rows of one-token sequences, those sequences, the other sequences), found on the
    step's first layer and kept on its metadata for the other layers."""
    got = meta.derived.get("cpu_split")
    if got is None:
        cu = meta.cu_seqlens_q_host
        single = [s for s in range(meta.num_seqs) if cu[s + 1] - cu[s] == 1]
        rest = [s for s in range(meta.num_seqs) if cu[s + 1] - cu[s] > 1]
        got = meta.derived["cpu_split"] = (torch.tensor([cu[s] for s in single], dtype=torch.long),
                                           torch.tensor(single, dtype=torch.long), rest)
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
        rows, idx, rest = _split(meta)
        out = torch.empty_like(q)
        if len(idx):
            out[rows] = paged_decode(q[rows], k_cache, v_cache, meta.block_table[idx],
                                     meta.seq_lens[idx], p, sinks)
        attend_seqs(q, k_cache, v_cache, meta, p, sinks, out, rest)
        return out
