"""CUDA path of the quantized linears on blocks as stored: Triton kernels that dequantize 32
values at a time in registers and multiply them on the tensor cores. (q4_0 and q8_0 segments
loaded on CUDA are repacked at load and run on quant_planar.py instead; these kernels serve the
other formats, and q4_0 / q8_0 blocks moved to CUDA after loading.)

- decode-sized calls (up to GEMV_ROWS rows): narrow column tiles and the K axis split across
  programs (summed in a fixed order by `_split_sum_kernel`, so a row's bits do not depend on
  the timing), so that a 4096-column linear still fills every SM. Up to FMA_ROWS rows of q4_0 /
  q8_0: `_gemv_fma_kernel`, codes turned into floats by bit tricks (an integer-to-float
  conversion runs at 1/8 of the FMA rate on an H100) and multiplied on the FMA units; else
  `_qgemv_kernel`, 16- or 32-row tensor-core tiles;
- larger calls: the weight is dequantized to the activations' dtype (`_dequant_kernel`, one
  pass) and cuBLAS multiplies. A fused 64-row-tile kernel was slower than that at every row
  count from 1 to 512 but gate_up's 32-64 (benchmarks/dev/quant_gemm_gpu.py --sweep, H100,
  2026-11-26): it ran at 0.10-0.14x cuBLAS at 2,048 rows.

Every path dequantizes w to fp32 and rounds it to x's dtype before the multiply, as the torch
reference (QuantLinear.reference) does. Formats: the 32-value blocks (q8_0, q4_0, q5_0, q4_g)
and llama.cpp's K formats (q4_k, q5_k, q6_k: 256-value super-blocks, read 32 values at a time
with their sub-block's scale and min; layouts as flatserve/model/qformats.py and
ops/csrc/quant_gemm_cpu.cpp read them). Checked against the torch reference with
TRITON_INTERPRET=1 on the CPU (tests/model/test_quant_triton.py) and on a GPU where one is present.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flatserve.model.qformats import Format

# format name -> (kernel code, value offset, bytes per block)
KERNEL_FORMATS = {"q8_0": 0, "q4_0": 1, "q5_0": 2, "q4_g": 3, "q4_k": 4, "q5_k": 5, "q6_k": 6}


@triton.jit
def _f16_at(p):  # two little-endian bytes at p -> fp32
    lo = tl.load(p).to(tl.int32)
    hi = tl.load(p + 1).to(tl.int32)
    return ((hi << 8) | lo).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _k_chunk(blk, c, j, mask_n, FMT: tl.constexpr):
    """Values 32 c .. 32 c + 31 of super-blocks at blk [BN, 1] -> [BN, 32] fp32, as the torch
    reference computes them: (d * scale) * q, less dmin * min for q4_k / q5_k."""
    m = mask_n[:, None]
    if FMT == 6:  # q6_k: ql[128] | qh[64] | int8 scales[16] | d; halves of 128 values
        h, p = c // 4, c % 4
        ql = tl.load(blk + 64 * h + (p % 2) * 32 + j[None, :], mask=m, other=0).to(tl.int32)
        qh = tl.load(blk + 128 + 32 * h + j[None, :], mask=m, other=0).to(tl.int32)
        q = (((ql >> ((p // 2) * 4)) & 0xF) | (((qh >> (2 * p)) & 3) << 4)) - 32
        sc = tl.load(blk + 192 + 2 * c + j[None, :] // 16, mask=m, other=0).to(tl.int8).to(tl.float32)
        return (_f16_at(blk + 208) * sc) * q.to(tl.float32)
    # q4_k / q5_k: d | dmin | 12 bytes of 6-bit scales and mins | (q5_k: qh[32]) | qs[128]
    a = tl.load(blk + 4 + c % 4, mask=m, other=0).to(tl.int32)  # s[c % 4]
    b = tl.load(blk + 8 + c % 4, mask=m, other=0).to(tl.int32)  # s[4 + c % 4]
    e = tl.load(blk + 12 + c % 4, mask=m, other=0).to(tl.int32)  # s[8 + c % 4]
    lo = c < 4
    sc = tl.where(lo, a & 63, (e & 0xF) | ((a >> 6) << 4)).to(tl.float32)
    mn = tl.where(lo, b & 63, (e >> 4) | ((b >> 6) << 4)).to(tl.float32)
    qoff = 16 if FMT == 4 else 48
    q = (tl.load(blk + qoff + 32 * (c // 2) + j[None, :], mask=m, other=0).to(tl.int32)
         >> ((c % 2) * 4)) & 0xF
    if FMT == 5:  # bit c of qh[l]: bit 4 of value l of sub-block c
        q = q | (((tl.load(blk + 16 + j[None, :], mask=m, other=0).to(tl.int32) >> c) & 1) << 4)
    return (_f16_at(blk) * sc) * q.to(tl.float32) - _f16_at(blk + 2) * mn


@triton.jit
def _block32(blk, j, mask_n, FMT: tl.constexpr):
    """One 32-value block at blk [BN, 1] -> [BN, 32] fp32 (the reference's bits)."""
    d = _f16_at(blk)  # [BN, 1]
    if FMT == 0:  # q8_0: d | int8[32]
        q = tl.load(blk + 2 + j[None, :], mask=mask_n[:, None], other=0).to(tl.int8).to(tl.float32)
    else:
        off = 2 if FMT == 1 else (6 if FMT == 2 else 3)
        byte = tl.load(blk + off + (j[None, :] % 16), mask=mask_n[:, None], other=0).to(tl.int32)
        q = (byte >> ((j[None, :] // 16) * 4)) & 0xF
        if FMT == 1:
            q = q - 8
        elif FMT == 2:  # bit j of the u32 after d is bit 4 of value j
            hb = tl.load(blk + 2 + j[None, :] // 8, mask=mask_n[:, None], other=0).to(tl.int32)
            q = (q | (((hb >> (j[None, :] % 8)) & 1) << 4)) - 16
        else:  # q4_g: d | zero | nibbles
            q = q - tl.load(blk + 2, mask=mask_n[:, None], other=0).to(tl.int32)
        q = q.to(tl.float32)
    return d * q


@triton.jit
def _weights32(row, kb, j, mask_n, FMT: tl.constexpr, TYPE_SIZE: tl.constexpr):
    """Values 32 kb .. 32 kb + 31 of the rows at `row` [BN, 1] -> [BN, 32] fp32."""
    if FMT >= 4:
        return _k_chunk(row + (kb // 8) * TYPE_SIZE, kb % 8, j, mask_n, FMT)
    return _block32(row + kb * TYPE_SIZE, j, mask_n, FMT)


@triton.jit
def _qgemv_kernel(x_ptr, w_ptr, y_ptr, M, N, K, row_bytes, stride_xm, stride_ys, stride_ym,
                  blocks_per_split, FMT: tl.constexpr, TYPE_SIZE: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KB: tl.constexpr):
    """y[split, :M, cols] = x[:, this split's K range] @ W[cols, same range]^T, KB blocks of 32
    values an iteration (unrolled: more loads in flight)."""
    pid_n, pid_s = tl.program_id(0), tl.program_id(1)
    rm = tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    j = tl.arange(0, 32)
    mask_m, mask_n = rm < M, rn < N
    row = w_ptr + tl.where(mask_n, rn, 0)[:, None].to(tl.int64) * row_bytes  # [BN, 1]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    first = pid_s * blocks_per_split
    h = tl.arange(0, 16)
    for kb0 in range(first, first + blocks_per_split, KB):
        for i in tl.static_range(KB):
            xrow = x_ptr + rm[:, None] * stride_xm + (kb0 + i) * 32
            if FMT == 1:  # q4_0: each byte once (values l and l + 16), two 16-deep products
                blk = row + (kb0 + i) * TYPE_SIZE
                byte = tl.load(blk + 2 + h[None, :], mask=mask_n[:, None], other=0).to(tl.int32)
                d = _f16_at(blk)
                x = tl.load(xrow + h[None, :], mask=mask_m[:, None], other=0.0)
                w = (d * ((byte & 15) - 8).to(tl.float32)).to(x.dtype)
                acc += tl.dot(x, tl.trans(w), input_precision="ieee", out_dtype=tl.float32)
                x = tl.load(xrow + 16 + h[None, :], mask=mask_m[:, None], other=0.0)
                w = (d * ((byte >> 4) - 8).to(tl.float32)).to(x.dtype)
                acc += tl.dot(x, tl.trans(w), input_precision="ieee", out_dtype=tl.float32)
            else:
                w = _weights32(row, kb0 + i, j, mask_n, FMT, TYPE_SIZE)
                x = tl.load(xrow + j[None, :], mask=mask_m[:, None], other=0.0)  # [BM, 32]
                acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision="ieee", out_dtype=tl.float32)
    tl.store(y_ptr + pid_s * stride_ys + rm[:, None] * stride_ym + rn[None, :],
             acc.to(y_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _nibble_f32(v, shift: tl.constexpr, MASK: tl.constexpr, XOR: tl.constexpr, BIAS: tl.constexpr):
    """Bits [shift, shift + log2(MASK + 1)) of int32 v as fp32 less BIAS, by placing them in the
    mantissa of 2^23 (one logic op and one subtraction; exact)."""
    return ((v >> shift) & MASK ^ XOR).to(tl.float32, bitcast=True) - BIAS


@triton.jit
def _gemv_fma_kernel(x_ptr, w_ptr, y_ptr, N, row_words, stride_xm, stride_ys, stride_ym,
                     blocks_per_split, FMT: tl.constexpr, ROWS: tl.constexpr,
                     BLOCK_N: tl.constexpr, KB: tl.constexpr):
    """q4_0 (FMT 1) / q8_0 (FMT 0), ROWS <= 4 rows of x. The blocks read as int16 words (18- and
    34-byte blocks are only 2-byte aligned): q4_0's word i holds values 2i, 2i + 16, 2i + 1,
    2i + 17 in its four nibbles; q8_0's holds values 2i, 2i + 1 as int8."""
    pid_n, pid_s = tl.program_id(0), tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = rn < N
    WORDS: tl.constexpr = 8 if FMT == 1 else 16  # code words per block, after the fp16 scale
    row = w_ptr + tl.where(mask_n, rn, 0)[:, None, None].to(tl.int64) * row_words  # [BN, 1, 1]
    b = tl.arange(0, KB)[None, :, None]  # [1, KB, 1]
    wi = tl.arange(0, WORDS)[None, None, :]  # [1, 1, WORDS]
    acc0 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N,), dtype=tl.float32)
    first = pid_s * blocks_per_split
    for kb0 in range(first, first + blocks_per_split, KB):
        blk = row + (kb0 + b) * (WORDS + 1)  # [BN, KB, 1]
        d = tl.reshape(tl.load(blk).to(tl.float16, bitcast=True).to(tl.float32), (BLOCK_N, KB))
        v = tl.load(blk + 1 + wi).to(tl.int32)  # [BN, KB, WORDS], sign-extended
        if FMT == 1:  # 2^23 + nibble, less 2^23 + 8
            f0 = _nibble_f32(v, 0, 15, 0x4B000000, 8388616.0)
            f1 = _nibble_f32(v, 4, 15, 0x4B000000, 8388616.0)
            f2 = _nibble_f32(v, 8, 15, 0x4B000000, 8388616.0)
            f3 = _nibble_f32(v, 12, 15, 0x4B000000, 8388616.0)
        else:  # 2^23 + (int8 + 128), less 2^23 + 128
            f0 = _nibble_f32(v, 0, 255, 0x4B000080, 8388736.0)
            f2 = _nibble_f32(v, 8, 255, 0x4B000080, 8388736.0)
        # Activations loaded contiguously, even and odd values split in registers (3-10% per
        # GEMV on an H100 over four strided gathers, benchmarks/dev/quant_gemm_gpu.py, 2026-11-26).
        xc = x_ptr + (kb0 + b) * 32 + tl.arange(0, 2 * WORDS)[None, None, :]  # [1, KB, 2 WORDS]
        for r in tl.static_range(ROWS):
            xe, xo = tl.split(tl.reshape(tl.load(xc + r * stride_xm).to(tl.float32), (1, KB, WORDS, 2)))
            if FMT == 1:
                he, ho = tl.split(tl.reshape(tl.load(xc + r * stride_xm + 16).to(tl.float32),
                                             (1, KB, WORDS, 2)))
                t = f0 * xe + f1 * he + f2 * xo + f3 * ho
            else:
                t = f0 * xe + f2 * xo
            s = tl.sum(tl.sum(t, axis=2) * d, axis=1)  # [BN]
            if r == 0:
                acc0 += s
            elif r == 1:
                acc1 += s
            elif r == 2:
                acc2 += s
            else:
                acc3 += s
    y = y_ptr + pid_s * stride_ys + rn
    for r in tl.static_range(ROWS):
        acc = acc0 if r == 0 else (acc1 if r == 1 else (acc2 if r == 2 else acc3))
        tl.store(y + r * stride_ym, acc.to(y_ptr.dtype.element_ty), mask=mask_n)


@triton.jit
def _split_sum_kernel(p_ptr, y_ptr, MN, N, stride_ym, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    """y[m, n] = sum over s, in order, of p[s, m, n] (fp32 partials)."""
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = i < MN
    acc = tl.load(p_ptr + i, mask=mask, other=0.0)
    for s in tl.static_range(1, SPLITS):
        acc += tl.load(p_ptr + s * MN + i, mask=mask, other=0.0)
    tl.store(y_ptr + (i // N) * stride_ym + i % N, acc.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _dequant_kernel(w_ptr, out_ptr, N, K, row_bytes, FMT: tl.constexpr, TYPE_SIZE: tl.constexpr,
                    BLOCK_N: tl.constexpr, KB: tl.constexpr):
    """out [N, K] (x's dtype) = the weight's values, KB blocks of 32 per program."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    j = tl.arange(0, 32)
    mask_n = rn < N
    row = w_ptr + tl.where(mask_n, rn, 0)[:, None].to(tl.int64) * row_bytes
    for i in tl.static_range(KB):
        kb = pid_k * KB + i
        w = _weights32(row, kb, j, mask_n, FMT, TYPE_SIZE)
        tl.store(out_ptr + rn[:, None].to(tl.int64) * K + kb * 32 + j[None, :],
                 w.to(out_ptr.dtype.element_ty), mask=mask_n[:, None])


def supported(fmt: Format) -> bool:
    return fmt.name in KERNEL_FORMATS


GEMV_ROWS = 32  # up to here the split-K GEMV; past it dequantize, then cuBLAS
FMA_ROWS = 2  # q4_0 / q8_0 calls up to here: the FMA kernel (no tensor cores, no conversions)


def _blocks_per_step(nblk: int) -> int:
    return next(kb for kb in (8, 4, 2, 1) if nblk % kb == 0)


def qgemm(x: torch.Tensor, w: torch.Tensor, fmt: Format, out: torch.Tensor,
          tiles: tuple[int, int, int, int] | None = None) -> None:
    """out [M, N] = x [M, K] @ W^T, W uint8 [N, row_bytes] in `fmt`; x and out on one device.
    `tiles` (BLOCK_N, KB, splits, warps) overrides the decode-sized path's choice (the sweep)."""
    M, K = x.shape
    N = w.shape[0]
    assert x.stride(1) == 1 and out.stride(1) == 1 and w.is_contiguous() and K % 32 == 0
    assert w.shape[1] == fmt.row_bytes(K) and out.shape == (M, N)
    if M > GEMV_ROWS:
        dequant_mm(x, w, fmt, out)
    else:
        gemv(x, w, fmt, out, tiles)


def dequant_mm(x: torch.Tensor, w: torch.Tensor, fmt: Format, out: torch.Tensor) -> None:
    """Prompt-sized calls: W to x's dtype in one pass, then cuBLAS."""
    (M, K), N = x.shape, w.shape[0]
    dense = torch.empty(N, K, dtype=x.dtype, device=x.device)
    kb = _blocks_per_step(K // 32)
    _dequant_kernel[(triton.cdiv(N, 32), K // 32 // kb)](
        w, dense, N, K, w.shape[1], FMT=KERNEL_FORMATS[fmt.name], TYPE_SIZE=fmt.type_size,
        BLOCK_N=32, KB=kb)
    torch.mm(x, dense.t(), out=out) if out.is_contiguous() else out.copy_(x @ dense.t())


def gemv(x: torch.Tensor, w: torch.Tensor, fmt: Format, out: torch.Tensor,
         tiles: tuple[int, int, int, int] | None = None) -> None:
    """Decode-sized calls (M <= GEMV_ROWS): the split-K kernels."""
    (M, K), N = x.shape, w.shape[0]
    code, nblk = KERNEL_FORMATS[fmt.name], K // 32
    fma = M <= FMA_ROWS and code <= 1
    bn, kb, splits, warps = tiles or _gemv_tiles(x.device, N, nblk, fma)
    per = nblk // splits
    assert per * splits == nblk and per % kb == 0, (nblk, kb, splits)
    part = out if splits == 1 else torch.empty(splits, M, N, dtype=torch.float32, device=x.device)
    ys = part.stride(0) if splits > 1 else 0
    if fma:
        _gemv_fma_kernel[(triton.cdiv(N, bn), splits)](
            x, w.view(torch.int16), part, N, w.shape[1] // 2, x.stride(0), ys, part.stride(-2), per,
            FMT=code, ROWS=M, BLOCK_N=bn, KB=kb, num_warps=warps)
    else:
        _qgemv_kernel[(triton.cdiv(N, bn), splits)](
            x, w, part, M, N, K, w.shape[1], x.stride(0), ys, part.stride(-2), per,
            FMT=code, TYPE_SIZE=fmt.type_size, BLOCK_M=max(16, triton.next_power_of_2(M)), BLOCK_N=bn,
            KB=kb, num_warps=warps)
    if splits > 1:
        _split_sum_kernel[(triton.cdiv(M * N, 1024),)](part, out, M * N, N, out.stride(0),
                                                        SPLITS=splits, BLOCK=1024)


def _gemv_tiles(device: torch.device, n: int, nblk: int, fma: bool = False) -> tuple[int, int, int, int]:
    """(BLOCK_N, KB, splits, warps): 64-column tiles (the FMA kernel: 32), the K axis split until
    there are >= 6 programs per SM (a 4096 x 4096 linear: 64 tiles x 16 splits on an H100's 132
    SMs; the FMA kernel at least 4 splits), near the best of benchmarks/dev/quant_gemm_gpu.py
    --sweep on an H100 (2026-11-26) for Llama-3-8B's shapes."""
    # The Triton interpreter (tests): a 2-SM device, so K still splits.
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2
    bn, kb = (32, 2) if fma else (64, 4)
    kb = next(k for k in (kb, 2, 1) if nblk % k == 0)
    tiles, splits = triton.cdiv(n, bn), 1
    while (tiles * splits < 6 * sms or (fma and splits < 4)) and nblk % (2 * splits * kb) == 0:
        splits *= 2
    return bn, kb, splits, 4
