"""One-row GEMV on the planar q4_0 / q8_0 weights (quant_planar.py) with x held in registers: a
program owns a fixed slice of K (KB blocks) and walks column tiles, so x is loaded once and every
step's L1 traffic is the weights' codes and scales alone.

Why: quant_planar's `_fma_kernel` walks K for a fixed column tile, so each step reloads x's
values for the step's blocks: per thread and block one 16-byte code load and eight loads of x
(one per nibble position, the codes' register layout). Nsight Compute put that kernel at the
L1/TEX unit's limit on gate_up at one row (84% busy, DRAM 43%; H100, 2026-11-27,
docs/benchmarks/raw/gpu_h100_q4_0_dp4a/call3_ncu_gate_up_m1.txt), and an integer-dot version with
a third of its instructions was no faster: the loads, not the arithmetic, bound it. llama.cpp's
mmvq keeps x in registers the same way.

The arithmetic per weight is `_fma_kernel`'s (quant_planar._field: q - zero exact in fp32 from one
LOP3 and one FADD, then one FFMA with x); a step's products are summed over its KB blocks once per
column tile. K is split into nblk / KB slices, each program's fp32 partials go to part
[slices, N], and the last program of a column group to finish (a counter per group) adds the
slices in slice order (the same bits whichever program is last), as quant_planar._finish_split.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flatserve.model.quant_planar import _field, _locks


@triton.jit
def _dot_q4(v, a0, a1, a2, a3, a4, a5, a6, a7, magic):
    """Codes v [BN, KB, 4] (q4_0 words: nibble s of word w is value 4s + w) . x's tiles a_s
    [1, KB, 4] (x[4s + w]) -> [BN, KB, 4] fp32 partial products, before the block scale."""
    m1, m2, m3 = magic - 0x2000000, magic - 0x4000000, magic - 0x6000000  # 2^19, 2^15, 2^11
    hi = (v.to(tl.uint32, bitcast=True) >> 16).to(tl.int32, bitcast=True)
    return _field(v, 0xF, magic, 8388616.0) * a0 + _field(v, 0xF0, m1, 524296.0) * a1 \
        + _field(v, 0xF00, m2, 32776.0) * a2 + _field(v, 0xF000, m3, 2056.0) * a3 \
        + _field(hi, 0xF, magic, 8388616.0) * a4 + _field(hi, 0xF0, m1, 524296.0) * a5 \
        + _field(hi, 0xF00, m2, 32776.0) * a6 + _field(hi, 0xF000, m3, 2056.0) * a7


@triton.jit
def _dot_q8(v, a0, a1, a2, a3, magic):
    """Codes v [BN, KB, 8] (q8_0 words: byte s of word w is value 8s + w) . x's tiles a_s
    [1, KB, 8] (x[8s + w]) -> [BN, KB, 8] fp32 partial products, before the block scale."""
    m2 = magic - 0x4000000  # 2^15
    v = v ^ -2139062144  # 0x80808080: int8 q -> q + 128 in each byte
    hi = (v.to(tl.uint32, bitcast=True) >> 16).to(tl.int32, bitcast=True)
    return _field(v, 0xFF, magic, 8388736.0) * a0 + _field(v, 0xFF00, m2, 32896.0) * a1 \
        + _field(hi, 0xFF, magic, 8388736.0) * a2 + _field(hi, 0xFF00, m2, 32896.0) * a3


@triton.jit(do_not_specialize=["s_step"])
def _xreg_kernel(x_ptr, c_ptr, s_ptr, part_ptr, out_ptr, lock_ptr, N, nblk, tiles_per_prog, magic,
                 s_step, FMT: tl.constexpr, BLOCK_N: tl.constexpr, KB: tl.constexpr,
                 SLICES: tl.constexpr):
    """part[slice, cols] = x[slice's K] . W[cols, slice's K] for this program's column tiles
    (tiles_per_prog of BLOCK_N columns), x's slice loaded before the loop; the next tile's codes
    and scales loaded one step ahead. SLICES == 1: straight to out."""
    pid_n, pid_s = tl.program_id(0), tl.program_id(1)
    W: tl.constexpr = 4 if FMT == 1 else 8  # int32 code words per block
    b = tl.arange(0, KB)[None, :, None]
    wi = tl.arange(0, W)[None, None, :]
    kb0 = pid_s * KB
    xr = x_ptr + (kb0 + b) * 32 + wi  # [1, KB, W]: x_s at xr + s W
    a0 = tl.load(xr).to(tl.float32)
    a1 = tl.load(xr + W).to(tl.float32)
    a2 = tl.load(xr + 2 * W).to(tl.float32)
    a3 = tl.load(xr + 3 * W).to(tl.float32)
    if FMT == 1:
        a4 = tl.load(xr + 16).to(tl.float32)
        a5 = tl.load(xr + 20).to(tl.float32)
        a6 = tl.load(xr + 24).to(tl.float32)
        a7 = tl.load(xr + 28).to(tl.float32)
    first = pid_n * tiles_per_prog * BLOCK_N
    end = tl.minimum(first + tiles_per_prog * BLOCK_N, N)
    cols = tl.arange(0, BLOCK_N)
    row = tl.minimum(first + cols, N - 1).to(tl.int64)[:, None, None] * nblk  # [BN, 1, 1]
    v_next = tl.load(c_ptr + (row + kb0 + b) * W + wi)
    d_next = tl.load(s_ptr + row + kb0 + b * s_step)
    for n0 in range(first, end, BLOCK_N):
        v, d = v_next, d_next.to(tl.float32)
        row = tl.minimum(n0 + BLOCK_N + cols, N - 1).to(tl.int64)[:, None, None] * nblk
        v_next = tl.load(c_ptr + (row + kb0 + b) * W + wi)  # past the end: the last row again
        d_next = tl.load(s_ptr + row + kb0 + b * s_step)
        if FMT == 1:
            t = _dot_q4(v, a0, a1, a2, a3, a4, a5, a6, a7, magic)
        else:
            t = _dot_q8(v, a0, a1, a2, a3, magic)
        acc = tl.sum(tl.sum(t * d, axis=2), axis=1)  # [BN]
        rn = n0 + cols
        if SLICES == 1:
            tl.store(out_ptr + rn, acc.to(out_ptr.dtype.element_ty), mask=rn < end)
        else:
            tl.store(part_ptr + pid_s * N + rn, acc, mask=rn < end)
    if SLICES > 1:
        tl.debug_barrier()  # every thread's partials stored before the counter moves
        n_done = tl.atomic_add(lock_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if n_done == SLICES - 1:  # the last slice of this column group: sum in slice order
            for n0 in range(first, end, BLOCK_N):
                rn = n0 + cols
                mask = rn < end
                s = tl.load(part_ptr + rn, mask=mask, other=0.0, cache_modifier=".cg")
                for i in tl.static_range(1, SLICES):
                    s += tl.load(part_ptr + i * N + rn, mask=mask, other=0.0, cache_modifier=".cg")
                tl.store(out_ptr + rn, s.to(out_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(lock_ptr + pid_n, 0)


def tiles(device: torch.device, n: int, nblk: int, bn: int = 64, kb: int = 8, per_sm: float = 2.5,
          warps: int = 4) -> tuple[int, int, int, int]:
    """-> (BLOCK_N, KB, column groups, warps): KB blocks a K slice (the largest of kb, 4, 2, 1 that
    divides nblk), bn columns a step, and column groups until the grid has >= per_sm programs
    per SM (each group at least one column tile)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2
    kb = next(k for k in (kb, 4, 2, 1) if nblk % k == 0)
    ntiles = triton.cdiv(n, bn)
    groups = min(ntiles, max(1, triton.cdiv(int(per_sm * sms), nblk // kb)))
    per = triton.cdiv(ntiles, groups)  # tiles a group
    return bn, kb, triton.cdiv(ntiles, per), warps


def gemv(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, nblk: int, code: int,
         out: torch.Tensor, tile: tuple[int, int, float, int] | None = None) -> None:
    """out [1, N] = x [1, K] @ W^T, W planar (codes int32 [N, nblk * W], scales fp16 [N, nblk];
    quant_planar._views). `tile` (BLOCK_N, KB, programs per SM, warps) overrides `tiles`'
    defaults (benchmarks/dev/quant_gemm_gpu.py --xreg)."""
    N = codes.shape[0]
    bn, kb, groups, warps = tiles(x.device, N, nblk, *(tile or ()))
    assert x.shape[0] == 1 and nblk % kb == 0, (x.shape, nblk, kb)
    slices = nblk // kb
    per = triton.cdiv(triton.cdiv(N, bn), groups)  # column tiles a program
    part = out if slices == 1 else torch.empty(slices, N, dtype=torch.float32, device=x.device)
    locks = _locks(x.device)
    assert locks is not None and groups <= locks.numel(), "quant_planar.repack makes the counters first"
    _xreg_kernel[(groups, slices)](x, codes, scales, part, out, locks, N, nblk, per, 0x4B000000, 1,
                                   FMT=code, BLOCK_N=bn, KB=kb, SLICES=slices, num_warps=warps)
