"""CPU attention backend: C++ kernels that read paged KV in place.

Decode and draft-verify sequences with at most MAX_KERNEL_ROWS new tokens go to
`csrc/paged_decode_cpu.cpp` in one call per layer, each row seeing the keys up to its own
position. Prompt rows (a sequence whose new rows start inside its prompt, whatever their count)
and other long runs go to `csrc/paged_prompt_cpu.cpp`, whose rows are row-invariant: a prompt
row gives the same bits whole, chunked, or after a prefix-cache hit. On CPUs with AMX bf16
tiles (bf16 models) they go to `csrc/paged_prefill_amx.cpp` instead (faster; row-invariant too,
with and without a sliding window: tests/attention/test_cpu_prefill.py, run on a 2-core Xeon with
AMX on 2026-11-26). The decode and prompt kernels are built at every ISA level, the AMX one at the
amx level only (flatserve/kernels.py: built by scripts/setup.sh, cached); where the decode
kernel has no build here, `available()` is False and kernels.default_backend picks the torch
backend; without the prompt kernel, prompt rows take the torch reference's per-sequence SDPA.
"""
from __future__ import annotations

from pathlib import Path

import torch

from flatserve import device as dev
from flatserve.kernel_build import CpuKernel
from flatserve.attention.base import LayerAttnParams
from flatserve.attention.metadata import AttentionMetadata
from flatserve.attention.torch_backend import attend_seqs, paged_attention_ref, write_kv

_SRC = Path(__file__).parent / "csrc" / "paged_decode_cpu.cpp"
_PREFILL_SRC = Path(__file__).parent / "csrc" / "paged_prefill_amx.cpp"
_PROMPT_SRC = Path(__file__).parent / "csrc" / "paged_prompt_cpu.cpp"
LANES = 16  # the kernel's slice width (kLanes): head sizes must be multiples of it
# The compiled module, built once per process (None, with the reason logged, if it fails).
kernel = CpuKernel("flatserve_paged_decode_cpu", _SRC, "attention uses the torch backend")


# The row-invariant prompt kernel, at every level.
prompt_kernel = CpuKernel("flatserve_paged_prompt_cpu", _PROMPT_SRC, "prompt rows use torch SDPA")


# The AMX prefill kernel, built at the amx level only (elsewhere long chunks keep SDPA).
prefill_kernel = CpuKernel("flatserve_paged_prefill", _PREFILL_SRC, "prefill chunks use torch SDPA",
                           levels=("amx",))


def available() -> bool:
    return kernel() is not None


_prefill_ok: dict[str, bool] = {}


def prefill_available() -> bool:
    """This run's ISA level is amx, the kernel built, and tile state granted (asked once per
    level: every layer asks)."""
    isa = dev.cpu_isa()
    if isa not in _prefill_ok:
        mod = prefill_kernel() if prefill_kernel.level(isa) else None
        _prefill_ok[isa] = mod is not None and bool(mod.available())
    return _prefill_ok[isa]


def prefill_fits(q: torch.Tensor, k_cache: torch.Tensor, p: LayerAttnParams,
                 sinks: torch.Tensor | None) -> bool:
    """The AMX prefill kernel's cases: bf16, heads of 32..256 in steps of 32, at most 32 query
    heads per KV head, no softcap or sinks (those keep SDPA / the maths path)."""
    d, g = q.shape[-1], q.shape[1] // k_cache.shape[2]
    return (q.dtype == k_cache.dtype == torch.bfloat16 and d % 32 == 0 and d <= 256 and g <= 32
            and p.softcap is None and sinks is None and prefill_available())


def paged_prefill(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                  block_table: torch.Tensor, seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor,
                  p: LayerAttnParams, seqs: torch.Tensor | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """q [R, Hq, D] bf16, sequence s's rows cu[s]..cu[s + 1] ending at position seq_lens[s] - 1,
    each row causal over its sequence's paged keys (and inside the window) -> [R, Hq, D].
    With `seqs` ([S'] int32): only those sequences' rows, written into `out` (q's shape)."""
    mod = prefill_kernel()
    assert mod is not None, "CPU AMX prefill kernel not built"
    return mod.paged_prefill(q.contiguous(), k_cache, v_cache, block_table.contiguous(),
                             seq_lens.contiguous(), cu_seqlens_q.contiguous(), p.scale,
                             p.sliding_window or 0, seqs, out)


def paged_prompt(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_table: torch.Tensor, seq_lens: torch.Tensor, cu_seqlens_q: torch.Tensor,
                 p: LayerAttnParams, sinks: torch.Tensor | None = None,
                 seqs: torch.Tensor | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """paged_prefill's contract for any dtype, softcap and sinks; each row's bits depend on
    that row alone (csrc/paged_prompt_cpu.cpp)."""
    mod = prompt_kernel()
    assert mod is not None, "CPU prompt kernel not built"
    return mod.paged_prompt(q.contiguous(), k_cache, v_cache, block_table.contiguous(),
                            seq_lens.contiguous(), cu_seqlens_q.contiguous(), p.scale,
                            p.sliding_window or 0, p.softcap or 0.0,
                            _NO_SINKS if sinks is None else sinks, seqs, out)


def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 block_table: torch.Tensor, seq_lens: torch.Tensor, p: LayerAttnParams,
                 sinks: torch.Tensor | None = None, cu_seqlens_q: torch.Tensor | None = None,
                 seqs: torch.Tensor | None = None, out: torch.Tensor | None = None
                 ) -> torch.Tensor:
    """q [R, Hq, D] -> [R, Hq, D]. Without cu_seqlens_q: one token per sequence (R == S) at
    position seq_lens - 1. With it ([S + 1] int32): sequence s's rows cu[s]..cu[s + 1] end at
    position seq_lens[s] - 1, each row seeing the keys up to its own position. With `seqs`
    ([S'] int32): only those sequences' rows, written into `out` (q's shape)."""
    mod = kernel()
    assert mod is not None, "CPU paged-decode kernel not built"
    cu = _NO_CU if cu_seqlens_q is None else cu_seqlens_q.contiguous()
    return mod.paged_decode(q.contiguous(), k_cache, v_cache, block_table.contiguous(),
                            seq_lens.contiguous(), cu, p.scale, p.sliding_window or 0,
                            p.softcap or 0.0, _NO_SINKS if sinks is None else sinks, seqs, out)


# "None" for the kernel's tensor arguments, made once: the kernel only reads their size, and a
# fresh torch.empty per layer call was measurable host time in an 18-layer decode step.
_NO_CU = torch.empty(0, dtype=torch.int32)
_NO_SINKS = torch.empty(0, dtype=torch.float32)


# Decode and verify runs with at most this many new rows go through the decode kernel; prompt
# rows and longer runs go to the prompt kernel (AMX prefill where it runs). The decode kernel
# walks a run's KV once for all its rows; its maths per row is a decode's (no matmul), so long
# runs are better served by the others, and SDPA's per-sequence host work dominated short verify
# runs (benchmarks/offline_cpu.py, 16 requests with ngram speculation: 139.9 -> 193.7-239.1 tok/s).
MAX_KERNEL_ROWS = 16


def _split(meta: AttentionMetadata) -> tuple[list[int], list[int], torch.Tensor, torch.Tensor]:
    """-> (decode/verify sequences for the decode kernel, the rest, each as int32 indices);
    found on the step's first layer and kept on its metadata for the others. A sequence whose
    new rows start inside its prompt is a prompt sequence at any length: its rows must not
    depend on how the prompt was split (chunking, prefix-cache hits)."""
    got = meta.derived.get("cpu_split")
    if got is None:
        cu, lens, prompts = meta.cu_seqlens_q_host, meta.seq_lens_host, meta.prompt_lens_host
        short, long = [], []
        for s in range(meta.num_seqs):
            n = cu[s + 1] - cu[s]
            in_prompt = prompts is not None and lens[s] - n < prompts[s]
            (long if in_prompt or n > MAX_KERNEL_ROWS else short).append(s)
        got = meta.derived["cpu_split"] = (short, long, torch.tensor(short, dtype=torch.int32),
                                           torch.tensor(long, dtype=torch.int32))
    return got


def decode_only(meta: AttentionMetadata) -> bool:
    """Every sequence of the step goes to the decode kernel (the C++ decoder stack's steps)."""
    return meta.max_q_len <= MAX_KERNEL_ROWS and not _split(meta)[1]


def _write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
              meta: AttentionMetadata) -> None:
    """The kernel module's one-call K/V write where dtypes and row layouts allow (always, for
    the engine's own tensors), else the torch reference's two index_copy_."""
    d = k.shape[-1]
    if (k.dtype == v.dtype == k_cache.dtype and k.stride(-1) == v.stride(-1) == 1
            and k.stride(-2) == v.stride(-2) == d and meta.slot_mapping.dtype == torch.int64):
        kernel().write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    else:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping, meta)


class CpuAttentionBackend:
    """amx_prefill / prompt_rows: prompt rows on the AMX prefill kernel where it runs, else the
    row-invariant prompt kernel (the "cpu" backend); False keeps them on the torch reference's
    SDPA (the "cpu-sdpa" backend, for A/Bs and CPUs where a kernel misbehaves)."""
    name = "cpu"
    amx_prefill = True
    prompt_rows = True

    def __init__(self) -> None:
        if kernel() is None:
            raise ValueError(f"attention backend {self.name!r} needs its C++ kernel, which did not "
                             f"build: {kernel.error}")

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                p: LayerAttnParams, sinks: torch.Tensor | None = None) -> torch.Tensor:
        _write_kv(k, v, k_cache, v_cache, meta)
        if q.shape[-1] % LANES:  # the kernel works in 16-lane slices of the head
            return paged_attention_ref(q, k_cache, v_cache, meta, p, sinks)
        short, long, short_idx, long_idx = _split(meta)
        if not long:  # decodes and verify runs only: all to the decode kernel
            return paged_decode(q, k_cache, v_cache, meta.block_table, meta.seq_lens, p, sinks,
                                meta.cu_seqlens_q)
        amx = self.amx_prefill and prefill_fits(q, k_cache, p, sinks)
        if amx and not short:  # prompt rows only
            return paged_prefill(q, k_cache, v_cache, meta.block_table, meta.seq_lens,
                                 meta.cu_seqlens_q, p)
        # Each kernel writes its own sequences' rows of one output, reading q in place.
        out = torch.empty_like(q)
        q = q.contiguous()
        if short:
            paged_decode(q, k_cache, v_cache, meta.block_table, meta.seq_lens, p, sinks,
                         meta.cu_seqlens_q, short_idx, out)
        if amx:
            paged_prefill(q, k_cache, v_cache, meta.block_table, meta.seq_lens, meta.cu_seqlens_q,
                          p, long_idx, out)
        elif self.prompt_rows and prompt_kernel() is not None:
            paged_prompt(q, k_cache, v_cache, meta.block_table, meta.seq_lens, meta.cu_seqlens_q,
                         p, sinks, long_idx, out)
        else:
            attend_seqs(q, k_cache, v_cache, meta, p, sinks, out, long)
        return out


class CpuSdpaPrefillBackend(CpuAttentionBackend):
    name = "cpu-sdpa"
    amx_prefill = False
    prompt_rows = False
