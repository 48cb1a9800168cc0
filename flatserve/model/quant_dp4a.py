"""Integer-dot GEMV for the planar q4_0 / q8_0 weights (quant_planar.py) at 1-2 rows: the
activations quantized to integer codes per block of 32 (llama.cpp's mmvq), the products by PTX
`dp4a` (8-bit codes) or `dp2a` (16-bit codes), one fp32 multiply-add per block and column.

Why it exists, and why it is off (quant_planar.INT_X = 0): the premise was that `_fma_kernel`
(every weight an fp32 through LOP3 + FADD, then an FFMA: ~4.9 SASS instructions a weight) is
issue-bound; here a word of codes meets a word of x's codes in one instruction, and the loop is
1.4 (dp4a) / 1.9 (dp2a) instructions a weight (q4_0, local sm_90 builds). On an H100 it was no
faster: q4_0 one row, best of 27 tiles, 1.05-1.14x (8 bits) and 1.16-1.32x (16 bits) the FMA
kernel's time per linear; b1 decode step 4.13 / 4.85 ms against 3.99. Nsight Compute on gate_up
puts both kernels at the L1/TEX unit's limit (84-90% of it, DRAM 40-43%, SM compute 43% FMA / 12%
here): the loads a step, not the arithmetic, bound them (docs/performance-gpu.md, raw
docs/benchmarks/raw/gpu_h100_q4_0_dp4a/).

x's codes, per row and block of 32 values (QMAX = 127 for 8 bits, 32767 for 16):
    d = amax / QMAX, q = rint(fp32(x * fp32(QMAX / amax))) (both divisions IEEE), |q| <= QMAX,
so |x - q d| <= d / 2 (+ |x| 2^-22 for QMAX / amax's rounding). Packed in the codes' order (no
shuffle): q4_0's `v & 0x0F0F0F0F` holds values w, 8 + w, 16 + w, 24 + w of the block in its bytes
(word w; `(v >> 4) & ...` the same for 4 + w) and q8_0's word w holds values 8s + w, so x word j
(0..7) is bytes q[j], q[8 + j], q[16 + j], q[24 + j] (8 bits); for 16 bits, halves (q[j], q[8 + j])
in word j and (q[16 + j], q[24 + j]) in word 8 + j (dp2a.lo takes a word's bytes 0-1, .hi 2-3).
q4_0's zero point: sum (c - 8) q = sum c q - 8 sum q, the second term kept per block.

Where x is quantized: each program quantizes its own K range (all rows) into a scratch buffer in
global memory before its loop (a few values a thread; every program of a K split writes the same
bytes to the same place, so whichever write lands the values are the same), then a barrier; the
loop reads them in the weights' register layout (L1 / L2 hits), one step ahead. A separate
kernel would add a launch per linear (128 a Llama-3-8B step); quantizing in the loop, every step,
would cost each thread a block's 32 values a step for 1-2 columns' products.

8-bit codes err ~258x more than 16-bit ones; the CPU path keeps 16 bits (quant.py: 8-bit
activations gave 95.9% teacher-forced top-1 on the default GGUF, under issue #30's 99%).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flatserve.model.quant_planar import _finish_split, _locks


@triton.jit
def _rint(y, ASM: tl.constexpr):
    """Round to nearest even, as int32 (|y| < 2^22). ASM: cvt.rni (the product y cannot fuse into
    it); else y + 1.5 * 2^23, whose units are 1, as bits (the caller turns FMA fusion off on
    CUDA, where y = a * b + 1.5 * 2^23 would round once instead of twice)."""
    if ASM:
        return tl.inline_asm_elementwise("cvt.rni.s32.f32 $0, $1;", "=r,f", [y], dtype=tl.int32,
                                         is_pure=True, pack=1)
    else:
        return (y + 12582912.0).to(tl.int32, bitcast=True) - 0x4B400000


@triton.jit
def _lane(v, i: tl.constexpr, BITS: tl.constexpr, SIGNED: tl.constexpr):
    """Lane i of BITS bits of int32 v, sign- or zero-extended."""
    if SIGNED:
        return (v << (32 - BITS - BITS * i)) >> (32 - BITS)
    else:
        return (v >> (BITS * i)) & ((1 << BITS) - 1)


@triton.jit
def _asm3(ins: tl.constexpr, a, b, c):
    return tl.inline_asm_elementwise(ins, "=r,r,r,r", [a, b, c], dtype=tl.int32, is_pure=True, pack=1)


@triton.jit
def _dp(a, b, c, OP: tl.constexpr, ASM: tl.constexpr):
    """c + a dot product of a's and b's lanes (int32 words, broadcast to one shape).
    OP 0: dp4a.u32.s32 (a 4 unsigned bytes: q4_0's nibbles; b 4 signed bytes: x's codes);
    OP 1: dp4a.s32.s32 (q8_0); OP 2 / 3: dp2a.lo / .hi.s32.u32 (a 2 signed halves: x's codes;
    b's bytes 0-1 / 2-3 unsigned); OP 4 / 5: the same with signed bytes. ASM False: the same
    sums in plain integer ops (the Triton interpreter has no inline asm)."""
    a, b = tl.broadcast(a, b)
    c = tl.zeros_like(a) + c
    if ASM:
        if OP == 0:
            return _asm3("dp4a.u32.s32 $0, $1, $2, $3;", a, b, c)
        elif OP == 1:
            return _asm3("dp4a.s32.s32 $0, $1, $2, $3;", a, b, c)
        elif OP == 2:
            return _asm3("dp2a.lo.s32.u32 $0, $1, $2, $3;", a, b, c)
        elif OP == 3:
            return _asm3("dp2a.hi.s32.u32 $0, $1, $2, $3;", a, b, c)
        elif OP == 4:
            return _asm3("dp2a.lo.s32.s32 $0, $1, $2, $3;", a, b, c)
        else:
            return _asm3("dp2a.hi.s32.s32 $0, $1, $2, $3;", a, b, c)
    elif OP <= 1:
        return c + _lane(a, 0, 8, OP == 1) * _lane(b, 0, 8, True) \
            + _lane(a, 1, 8, OP == 1) * _lane(b, 1, 8, True) \
            + _lane(a, 2, 8, OP == 1) * _lane(b, 2, 8, True) \
            + _lane(a, 3, 8, OP == 1) * _lane(b, 3, 8, True)
    else:
        hi: tl.constexpr = 2 * (OP % 2)
        return c + _lane(a, 0, 16, True) * _lane(b, hi, 8, OP >= 4) \
            + _lane(a, 1, 16, True) * _lane(b, hi + 1, 8, OP >= 4)


@triton.jit
def _quant_x(x_ptr, stride_xm, xq_ptr, xd_ptr, xs_ptr, nblk, first, end, ROWS: tl.constexpr,
             XBITS: tl.constexpr, ASM: tl.constexpr, QB: tl.constexpr):
    """x's blocks [first, end) of each row -> codes xq [ROWS, nblk, WX] int32 (module docstring's
    order), scales xd [ROWS, nblk] fp32, -8 * sum(q) xs [ROWS, nblk] int32."""
    QMAX: tl.constexpr = 127.0 if XBITS == 8 else 32767.0
    WX: tl.constexpr = 8 if XBITS == 8 else 16
    h = tl.arange(0, 4)[None, :, None]
    j = tl.arange(0, 8)[None, None, :]  # [QB, 4, 8]: value 8h + j
    for r in tl.static_range(ROWS):
        for b0 in range(first, end, QB):
            blk = b0 + tl.arange(0, QB)
            ok = blk < end
            xv = tl.load(x_ptr + r * stride_xm + blk[:, None, None] * 32 + h * 8 + j,
                         mask=ok[:, None, None], other=0.0).to(tl.float32)
            amax = tl.max(tl.max(tl.abs(xv), axis=2), axis=1)  # [QB]
            inv = tl.where(amax > 0, tl.div_rn(tl.full(amax.shape, QMAX, tl.float32), amax), 0.0)
            q = _rint(xv * inv[:, None, None], ASM)
            if XBITS == 8:  # disjoint bit fields: the sum is their OR
                words = tl.sum((q & 0xFF) << (8 * h), axis=1)  # [QB, 8]
            else:  # [QB, 2 (word 8p + j), 2 (half), 8]
                hw = tl.reshape((q & 0xFFFF) << (16 * (h % 2)), (QB, 2, 2, 8))
                words = tl.reshape(tl.sum(hw, axis=2), (QB, 16))
            at = r * nblk + blk
            tl.store(xq_ptr + at[:, None] * WX + tl.arange(0, WX)[None, :], words, mask=ok[:, None])
            tl.store(xd_ptr + at, tl.div_rn(amax, tl.full(amax.shape, QMAX, tl.float32)), mask=ok)
            tl.store(xs_ptr + at, -8 * tl.sum(tl.sum(q, axis=2), axis=1), mask=ok)


@triton.jit
def _xload(xq_ptr, xd_ptr, xs_ptr, nblk, kb0, b, bs, wi, zn, r: tl.constexpr, FMT: tl.constexpr,
           XBITS: tl.constexpr):
    """Row r's x for blocks kb0 + b: the code words of the step's dp ops as
    [BN, KB, W] (pointers broadcast over the columns, a stride of 0: the codes' layout, one load
    a thread), unused ones w0 again (no load); its scales [1, KB, 1] fp32 and q4_0's -8 sum(q)
    [1, KB, 1] (q8_0: the scales again)."""
    WX: tl.constexpr = 8 if XBITS == 8 else 16
    xw = xq_ptr + (r * nblk + kb0 + b) * WX + wi + zn
    xb = r * nblk + kb0 + bs
    w0 = tl.load(xw)
    w1 = w0
    w2 = w0
    w3 = w0
    if FMT == 1:
        w1 = tl.load(xw + 4)
        if XBITS == 16:
            w2 = tl.load(xw + 8)
            w3 = tl.load(xw + 12)
    elif XBITS == 16:
        w1 = tl.load(xw + 8)
    xd = tl.load(xd_ptr + xb)
    xs = xd
    if FMT == 1:
        xs = tl.load(xs_ptr + xb)
    return w0, w1, w2, w3, xd, xs


@triton.jit
def _dp_row(lo, hi, v, d, w0, w1, w2, w3, xd, xs, acc, FMT: tl.constexpr, XBITS: tl.constexpr,
            ASM: tl.constexpr):
    """acc [BN, KB, 1] += one row's step: q4_0 lo / hi the nibbles (v & 0x0F0F0F0F: values w, 8 + w,
    16 + w, 24 + w of the block; (v >> 4) & ...: 4 + w, ...), q8_0 the words v; x's words w0..w3
    (_xload), d the weights' scales [BN, KB, 1] fp32. The sum over a block's W words stays in
    each thread (the codes' 16-byte layout)."""
    if FMT == 1:
        if XBITS == 8:
            s = _dp(lo, w0, 0, 0, ASM)
            s = _dp(hi, w1, s, 0, ASM)
        else:
            s = _dp(w0, lo, 0, 2, ASM)
            s = _dp(w2, lo, s, 3, ASM)
            s = _dp(w1, hi, s, 2, ASM)
            s = _dp(w3, hi, s, 3, ASM)
        isum = tl.sum(s, axis=2, keep_dims=True) + xs
    else:
        if XBITS == 8:
            s = _dp(v, w0, 0, 1, ASM)
        else:
            s = _dp(w0, v, 0, 4, ASM)
            s = _dp(w1, v, s, 5, ASM)
        isum = tl.sum(s, axis=2, keep_dims=True)
    # q4_0: |isum| <= 32 * 15 * QMAX + 8 * 32 * QMAX < 2^24, exact in fp32; q8_0 at 16 bits one
    # rounding
    return acc + isum.to(tl.float32) * (d * xd)


@triton.jit(do_not_specialize=["s_step"])
def _dp_kernel(x_ptr, xq_ptr, xd_ptr, xs_ptr, c_ptr, s_ptr, part_ptr, out_ptr, lock_ptr, N, nblk,
               stride_xm, stride_om, blocks_per_split, s_step, FMT: tl.constexpr, ROWS: tl.constexpr,
               XBITS: tl.constexpr, ASM: tl.constexpr, BLOCK_N: tl.constexpr, KB: tl.constexpr,
               SPLITS: tl.constexpr, FUSED: tl.constexpr, QB: tl.constexpr):
    """out[:ROWS, cols] = x @ W^T over this program's share of K (as quant_planar._fma_kernel:
    partials to part, summed in split order by the last program of a column tile). The first
    step's codes load before x's quantization, so their latency overlaps it; then the next
    step's codes and x's words one step ahead in registers (x's on demand left an L2 round trip
    in every step)."""
    pid_n, pid_s = tl.program_id(0), tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = rn < N
    W: tl.constexpr = 4 if FMT == 1 else 8
    b = tl.arange(0, KB)[None, :, None]
    wi = tl.arange(0, W)[None, None, :]
    bs = b * s_step  # (s_step = 1, not specialised: [., KB, 1] loads keep the codes' layout, as in
    # _fma_kernel, no vector layout of their own and no shared-memory conversion a step)
    zn = (rn * 0)[:, None, None]
    row = tl.minimum(rn, N - 1).to(tl.int64)[:, None, None] * nblk
    crow = c_ptr + row * W + (b * W + wi)  # [BN, KB, W]
    srow = s_ptr + row + bs
    first = pid_s * blocks_per_split
    end = first + blocks_per_split
    v_n = tl.load(crow + first * W)
    d_n = tl.load(srow + first)
    _quant_x(x_ptr, stride_xm, xq_ptr, xd_ptr, xs_ptr, nblk, first, end, ROWS, XBITS, ASM, QB)
    tl.debug_barrier()  # the program's x codes stored before any thread reads them
    a0, a1, a2, a3, ad, as_ = _xload(xq_ptr, xd_ptr, xs_ptr, nblk, first, b, bs, wi, zn, 0, FMT, XBITS)
    c0, c1, c2, c3, cd, cs = a0, a1, a2, a3, ad, as_
    if ROWS == 2:
        c0, c1, c2, c3, cd, cs = _xload(xq_ptr, xd_ptr, xs_ptr, nblk, first, b, bs, wi, zn, 1, FMT, XBITS)
    acc0 = tl.zeros((BLOCK_N, KB, 1), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, KB, 1), dtype=tl.float32)
    for kb0 in range(first, end, KB):
        v, d = v_n, d_n.to(tl.float32)
        e0, e1, e2, e3, ed, es = a0, a1, a2, a3, ad, as_
        f0, f1, f2, f3, fd, fs = c0, c1, c2, c3, cd, cs
        # the last step loads its own blocks again (no masks: a masked load zeroes its registers
        # first, ~20 more instructions a step)
        nxt = tl.minimum(kb0 + KB, end - KB)
        v_n = tl.load(crow + nxt * W)
        d_n = tl.load(srow + nxt)
        a0, a1, a2, a3, ad, as_ = _xload(xq_ptr, xd_ptr, xs_ptr, nblk, nxt, b, bs, wi, zn, 0, FMT, XBITS)
        if ROWS == 2:
            c0, c1, c2, c3, cd, cs = _xload(xq_ptr, xd_ptr, xs_ptr, nblk, nxt, b, bs, wi, zn, 1, FMT, XBITS)
        lo = v & 0x0F0F0F0F
        hi = (v >> 4) & 0x0F0F0F0F
        acc0 = _dp_row(lo, hi, v, d, e0, e1, e2, e3, ed, es, acc0, FMT, XBITS, ASM)
        if ROWS == 2:
            acc1 = _dp_row(lo, hi, v, d, f0, f1, f2, f3, fd, fs, acc1, FMT, XBITS, ASM)
    for r in tl.static_range(ROWS):
        acc = tl.sum(tl.sum(acc0 if r == 0 else acc1, axis=2), axis=1)
        if SPLITS == 1:
            tl.store(out_ptr + r * stride_om + rn, acc.to(out_ptr.dtype.element_ty), mask=mask_n)
        else:
            tl.store(part_ptr + (pid_s * ROWS + r) * N + rn, acc, mask=mask_n)
    if SPLITS > 1 and FUSED:
        _finish_split(part_ptr, out_ptr, lock_ptr, pid_n, ROWS, N, stride_om, SPLITS, ROWS, BLOCK_N)


def gemv(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, nblk: int, code: int,
         out: torch.Tensor, xbits: int, tiles: tuple[int, int, int, int, int] | None = None,
         asm: bool | None = None, fused: bool = True) -> None:
    """out [M, N] = x [M, K] @ W^T for M <= 2, W's planar codes int32 and scales fp16 (quant_planar
    ._views), x's codes of xbits (8: dp4a, 16: dp2a). `asm` False: the products and rounding in
    plain integer ops (default: inline PTX on CUDA; the interpreter has none)."""
    M, N = x.shape[0], out.shape[1]
    assert M <= 2 and xbits in (8, 16)
    asm = x.is_cuda if asm is None else asm
    bn, kb, splits, warps, stages = tiles or _tiles(x.device, N, nblk, M, code)
    per = nblk // splits
    assert per * splits == nblk and per % kb == 0, (nblk, kb, splits)
    wx = 8 if xbits == 8 else 16
    scratch = torch.empty(M * nblk * (wx + 2), dtype=torch.int32, device=x.device)
    xq = scratch[:M * nblk * wx]
    xd = scratch[M * nblk * wx:M * nblk * (wx + 1)].view(torch.float32)
    xs = scratch[M * nblk * (wx + 1):]
    part = out if splits == 1 else torch.empty(splits, M, N, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(N, bn), splits)
    locks = _locks(x.device) if fused and splits > 1 else None
    fused = locks is not None and grid[0] <= locks.numel()
    extra = {"enable_fp_fusion": False} if x.is_cuda and not asm else {}  # _rint's reason
    _dp_kernel[grid](x, xq, xd, xs, codes, scales, part, out, locks if fused else part, N, nblk,
                     x.stride(0), out.stride(0), per, 1, FMT=code, ROWS=M, XBITS=xbits, ASM=asm,
                     BLOCK_N=bn, KB=kb, SPLITS=splits, FUSED=fused,
                     QB=min(64, triton.next_power_of_2(per)), num_warps=warps,
                     **extra)
    if splits > 1 and not fused:
        from flatserve.model.quant_triton import _split_sum_kernel

        _split_sum_kernel[(triton.cdiv(M * N, 1024),)](part, out, M * N, N, out.stride(0),
                                                        SPLITS=splits, BLOCK=1024)


def _tiles(device: torch.device, n: int, nblk: int, rows: int, code: int) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, KB, splits, warps, stages; stages unused): near the best of benchmarks/dev/
    quant_gemm_gpu.py --dp --tiles on an H100 (2026-11-27, q4_0, Llama-3-8B's linears and LM
    head, 8- and 16-bit codes, 27 tiles at one row and 8 at two): 128 columns and 4 blocks a step
    (the LM head at 8 bits and one row: 8 blocks, 222 against 230 us); one row on 4 warps, two
    on 8; K split in at least 2 (two rows: 4), up to 8, until there are >= 2 programs per SM."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2
    bn, warps, least = (128, 4, 2) if rows == 1 else (128, 8, 4)
    kb = next(k for k in (4, 2, 1) if nblk % k == 0)
    tiles, splits = triton.cdiv(n, bn), 1
    while (splits < least or tiles * splits < 2 * sms) and splits < 8 and nblk % (2 * splits * kb) == 0:
        splits *= 2
    return bn, kb, splits, warps, 1
