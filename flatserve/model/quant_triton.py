"""CUDA path of the quantized linears: one Triton kernel that dequantizes 32-value blocks (q8_0,
q4_0, q5_0, q4_g) in registers and multiplies them on the tensor cores; decode batches (GEMV
sized: BLOCK_M 16) and prompt chunks (BLOCK_M 64) take the same kernel with other tiles.

The K formats (q4_k, q5_k, q6_k: 256-value super-blocks) are not here yet: on CUDA they run
QuantLinear.reference. Checked against that reference with TRITON_INTERPRET=1 on the CPU
(tests/model/test_quant_triton.py) and on a GPU where one is present.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flatserve.model.qformats import Format

# format name -> (kernel code, value offset, bytes per block)
KERNEL_FORMATS = {"q8_0": 0, "q4_0": 1, "q5_0": 2, "q4_g": 3}


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
    for kb in range(0, K // 32):
        blk = w_ptr + rn[:, None].to(tl.int64) * row_bytes + kb * TYPE_SIZE  # [BN, 1]
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
        w = d * q  # [BN, 32] fp32: the reference's bits
        x = tl.load(x_ptr + rm[:, None] * stride_xm + kb * 32 + j[None, :], mask=mask_m[:, None],
                    other=0.0)  # [BM, 32]
        acc += tl.dot(x, tl.trans(w.to(x.dtype)), input_precision="ieee", out_dtype=tl.float32)
    tl.store(y_ptr + rm[:, None] * stride_ym + rn[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


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
