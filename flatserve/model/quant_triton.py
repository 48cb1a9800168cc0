"""CUDA path of the quantized linears: one Triton kernel that dequantizes 32 values at a time
in registers and multiplies them on the tensor cores; decode batches (GEMV sized: BLOCK_M 16)
and prompt chunks (BLOCK_M 64) take the same kernel with other tiles.

Formats: the 32-value blocks (q8_0, q4_0, q5_0, q4_g) and llama.cpp's K formats (q4_k, q5_k,
q6_k: 256-value super-blocks, read 32 values at a time with their sub-block's scale and min;
layouts as flatserve/model/qformats.py and ops/csrc/quant_gemm_cpu.cpp read them). Checked
against the torch reference with TRITON_INTERPRET=1 on the CPU (tests/model/test_quant_triton.py)
and on a GPU where one is present.
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
def _qgemm_kernel(x_ptr, w_ptr, y_ptr, M, N, K, row_bytes, stride_xm, stride_ym,
                  FMT: tl.constexpr, TYPE_SIZE: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    pid_m, pid_n = tl.program_id(0), tl.program_id(1)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN]
    j = tl.arange(0, 32)  # value within a block
    mask_m, mask_n = rm < M, rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # Columns past N read row 0 (never stored): every weight address stays inside the tensor.
    row = w_ptr + tl.where(mask_n, rn, 0)[:, None].to(tl.int64) * row_bytes  # [BN, 1]
    for kb in range(0, K // 32):
        if FMT >= 4:  # K formats: 32 values of a 256-value super-block
            w = _k_chunk(row + (kb // 8) * TYPE_SIZE, kb % 8, j, mask_n, FMT)
        else:
            w = _block32(row + kb * TYPE_SIZE, j, mask_n, FMT)
        x = tl.load(x_ptr + rm[:, None] * stride_xm + kb * 32 + j[None, :], mask=mask_m[:, None],
                    other=0.0)  # [BM, 32]
        acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision="ieee", out_dtype=tl.float32)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


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


def supported(fmt: Format) -> bool:
    return fmt.name in KERNEL_FORMATS


def qgemm(x: torch.Tensor, w: torch.Tensor, fmt: Format, out: torch.Tensor) -> None:
    """out [M, N] = x [M, K] @ W^T, W uint8 [N, row_bytes] in `fmt`; x and out on one device."""
    M, K = x.shape
    N = w.shape[0]
    assert x.stride(1) == 1 and out.stride(1) == 1 and w.is_contiguous() and K % 32 == 0
    assert w.shape[1] == fmt.row_bytes(K) and out.shape == (M, N)
    bm = 16 if M <= 16 else 64  # decode-sized calls: one row tile, many column tiles
    bn = 64
    grid = (triton.cdiv(M, bm), triton.cdiv(N, bn))
    _qgemm_kernel[grid](x, w, out, M, N, K, w.shape[1], x.stride(0), out.stride(0),
                        FMT=KERNEL_FORMATS[fmt.name], TYPE_SIZE=fmt.type_size, BLOCK_M=bm, BLOCK_N=bn)
