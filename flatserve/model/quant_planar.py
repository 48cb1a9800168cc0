"""q4_0 / q8_0 weights on CUDA in planes: the GPU copy of a segment's GGUF blocks that the CUDA
linears read (quant_triton.py reads the other formats' blocks as stored).

Why: an 18-byte q4_0 block (34-byte q8_0) is only 2-byte aligned, so a kernel reading the blocks
as stored makes 2-byte loads, and q4_0's nibbles pair values i and i + 16. At one row the GEMV on
stored blocks read its bytes at 0.2-0.35x the copy rate on an H100 (docs/performance-gpu.md).

Layout (same bytes as the blocks, one uint8 tensor of the blocks' shape [N, row_bytes], so byte
counts and the module's buffers stay as they were):

    codes   [N, K / 32, W] int32 words at byte 0     q4_0: W = 4, nibble s (bits 4s) of word w
                                                     is value 4s + w of the block
                                                     q8_0: W = 8, byte s of word w is value 8s + w
    scales  [N, K / 32] fp16 after them

so a block's codes are one (q4_0) or two (q8_0) 16-byte loads, and the values at one nibble
(byte) position s of the block's words are W consecutive values: the activations they multiply
are one W-wide load, in the codes' own register layout (no shuffle through shared memory).
`repack` makes the copy once at load (QuantLinear.load_quant, on the GPU, a segment at a time:
the peak holds one segment twice), `to_blocks` gives the stored blocks back (the embedding's
row lookups, the torch reference).

Kernels, each checked against the torch reference (tests/model/test_quant_triton.py, in the
Triton interpreter on a CPU and compiled on CUDA):
- one row of bf16 activations, q4_0: the CUDA C++ GEMV of cuda_gemv.py (`_fma_kernel`'s
  nibble trick and fp32 FMAs, 1.4-1.5x faster per linear on an H100, or tensor-core products for
  the large linears; tests/model/test_cuda_gemv.py), where it built; else, and up to FMA_ROWS rows:
  `_fma_kernel`, fp32 FMAs; codes to floats by masking each nibble in place into the mantissa
  of a power of 2 chosen per nibble position, so one FADD gives q - 8 exactly (no scaling of
  x, no zero-point sum), the scales loaded in the codes' register layout
  (integer-dot and x-in-registers versions were slower on an H100: docs/performance-gpu.md);
- from 3 rows to 128 (256 for weights of >= 2^25 values but on an H200; `use_gemm`):
  `_gemm_kernel`, a GEMM tiled over rows and columns (16-256 x 64-128), the weights dequantized in
  registers (the reference's bits: d * (q - 8) in fp32, rounded to x's dtype) into tensor-core
  products, no dense copy; (`_dot_kernel`, the tensor-core GEMV it replaced at 3-32 rows, stays
  for the benchmark's A/B, GEMM = False);
- above: `_dequant_kernel` to x's dtype, then cuBLAS.
The K axis is split across programs and the partial sums added in a fixed order (in the FMA
kernel by the last program of each column tile, _finish_split; else quant_triton's
_split_sum_kernel), so a row's bits do not depend on the timing.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flatserve import device as dev
from flatserve.model import cuda_gemv
from flatserve.model.qformats import Format

FORMATS = {"q8_0": 0, "q4_0": 1}  # name -> kernel code
_CB = {0: 32, 1: 16}  # code bytes per block
FMA_ROWS = 2
GEMV_ROWS = 32
GEMM = True  # False: qgemm's paths before _gemm_kernel (the benchmark's A/B)
_CHUNK = 4096  # rows repacked at a time (bounds the temporaries)


def supported(fmt: Format) -> bool:
    return fmt.name in FORMATS


def _split(p: torch.Tensor, fmt: Format) -> tuple[torch.Tensor, torch.Tensor]:
    """Planar uint8 [N, row_bytes] -> (codes uint8 [N, nblk, CB], scales fp16 [N, nblk])."""
    n, nblk = p.shape[0], p.shape[1] // fmt.type_size
    cb = _CB[FORMATS[fmt.name]]
    flat = p.view(-1)
    return (flat[:n * nblk * cb].view(n, nblk, cb),
            flat[n * nblk * cb:].view(torch.float16).view(n, nblk))


@torch.no_grad()
def repack(q: torch.Tensor, fmt: Format) -> torch.Tensor:
    """GGUF blocks uint8 [N, row_bytes] -> a new tensor of the same shape in planes."""
    assert q.dim() == 2 and q.dtype == torch.uint8 and supported(fmt)
    n, nblk = q.shape[0], q.shape[1] // fmt.type_size
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    _locks(q.device)  # made now, outside any graph capture
    if fmt.name == "q4_0":
        cuda_gemv.prepare(q.device)  # the one-row CUDA C++ GEMV, built and loaded now likewise
    codes, scales = _split(out, fmt)
    for r in range(0, n, _CHUNK):
        b = q[r:r + _CHUNK].reshape(-1, nblk, fmt.type_size)
        scales[r:r + _CHUNK] = b[..., :2].contiguous().view(torch.float16).view(b.shape[0], nblk)
        qs = b[..., 2:]
        if fmt.name == "q4_0":  # stored byte i: value i (low nibble), i + 16 (high)
            vals = torch.cat([qs & 15, qs >> 4], -1).view(-1, nblk, 4, 8)  # [.., h, 8]: value 8h + j
            # code byte 4w + h: value 8h + w (low nibble), 8h + 4 + w (high)
            qs = (vals[..., :4] | (vals[..., 4:] << 4)).transpose(-1, -2).reshape(-1, nblk, 16)
        else:  # code byte 4w + s: value 8s + w
            qs = qs.reshape(-1, nblk, 4, 8).transpose(-1, -2).reshape(-1, nblk, 32)
        codes[r:r + _CHUNK] = qs
    return out


@torch.no_grad()
def to_blocks(p: torch.Tensor, fmt: Format, rows: torch.Tensor | None = None) -> torch.Tensor:
    """The GGUF blocks of planar `p` (rows `rows`, default all): uint8 [rows, row_bytes]."""
    codes, scales = _split(p, fmt)
    if rows is not None:
        codes, scales = codes[rows], scales[rows]
    lead = codes.shape[:-1]
    if fmt.name == "q4_0":  # (index tensors would be host-to-device copies: the embedding's rows
        # are read inside CUDA graphs)
        c = codes.reshape(*lead, 4, 4).transpose(-1, -2)  # [.., h, w]
        vals = torch.cat([c & 15, c >> 4], -1).reshape(*lead, 32)  # K order
        codes = vals[..., :16] | (vals[..., 16:] << 4)
    else:
        codes = codes.reshape(*lead, 8, 4).transpose(-1, -2).reshape(*lead, 32)
    d = scales.contiguous().view(torch.uint8).view(*scales.shape, 2)
    return torch.cat([d, codes], -1).reshape(codes.shape[0], -1)


@triton.jit
def _field(v, mask: tl.constexpr, magic, off: tl.constexpr):
    """(v & mask) in the mantissa of a power of 2 (magic = its bits), less off: with the field
    at bits 4s (8s), magic = 2^(23 - 4s) (2^(23 - 8s)) makes the field's units 1, and off =
    that power + the zero point gives q - zero exactly (ints below 2^24). magic is a register
    (computed from a kernel argument), not a constant: LOP3 takes one immediate, the mask (with
    both constant, ptxas moved a mask into a register before each use)."""
    return ((v & mask) | magic).to(tl.float32, bitcast=True) - off


@triton.jit
def _fma_step(v, d, x_ptr, stride_xm, kb0, xoff, m0, m1, m2, m3, acc0, acc1, acc2, acc3,
              FMT: tl.constexpr, ROWS: tl.constexpr):
    """One step of _fma_kernel: codes v [BN, KB, W], scales d [BN, KB, 1] fp32 (the codes'
    layout) into the rows' accumulators; m0..m3 the bits of 2^23, 2^19, 2^15, 2^11
    (_field). Each weight is q - zero in fp32 from one LOP3 and one FADD, then one FFMA with x:
    no scaling of x by 16^-s and no zero-point sum (which cost ~60 of the 382 instructions of a
    step of 64 weights a thread, sm_90 SASS)."""
    if FMT == 0:
        v = v ^ -2139062144  # 0x80808080: int8 q -> q + 128 in each byte
    lo = v
    hi = (v.to(tl.uint32, bitcast=True) >> 16).to(tl.int32, bitcast=True)  # logical: one SHF
    if FMT == 1:
        f0 = _field(lo, 0xF, m0, 8388616.0)
        f1 = _field(lo, 0xF0, m1, 524296.0)
        f2 = _field(lo, 0xF00, m2, 32776.0)
        f3 = _field(lo, 0xF000, m3, 2056.0)
        g0 = _field(hi, 0xF, m0, 8388616.0)
        g1 = _field(hi, 0xF0, m1, 524296.0)
        g2 = _field(hi, 0xF00, m2, 32776.0)
        g3 = _field(hi, 0xF000, m3, 2056.0)
    else:
        f0 = _field(lo, 0xFF, m0, 8388736.0)
        f1 = _field(lo, 0xFF00, m2, 32896.0)
        g0 = _field(hi, 0xFF, m0, 8388736.0)
        g1 = _field(hi, 0xFF00, m2, 32896.0)
    for r in tl.static_range(ROWS):
        xr = x_ptr + r * stride_xm + kb0 * 32 + xoff
        if FMT == 1:
            t = f0 * tl.load(xr).to(tl.float32) + f1 * tl.load(xr + 4).to(tl.float32) \
                + f2 * tl.load(xr + 8).to(tl.float32) + f3 * tl.load(xr + 12).to(tl.float32) \
                + g0 * tl.load(xr + 16).to(tl.float32) + g1 * tl.load(xr + 20).to(tl.float32) \
                + g2 * tl.load(xr + 24).to(tl.float32) + g3 * tl.load(xr + 28).to(tl.float32)
        else:
            t = f0 * tl.load(xr).to(tl.float32) + f1 * tl.load(xr + 8).to(tl.float32) \
                + g0 * tl.load(xr + 16).to(tl.float32) + g1 * tl.load(xr + 24).to(tl.float32)
        # q4_0: the block's W partial sums stay apart until the end (one FFMA each, no shuffle);
        # q8_0 (a block over two threads, whose scale layout differs): summed first, as [BN, KB,
        # 1] (kept in [BN, KB, 8], its accumulators and a conversion of t took 168 registers
        # at 2 rows)
        if FMT == 0:
            t = tl.sum(t, axis=2, keep_dims=True)
        if r == 0:
            acc0 += t * d
        elif r == 1:
            acc1 += t * d
        elif r == 2:
            acc2 += t * d
        else:
            acc3 += t * d
    return acc0, acc1, acc2, acc3


@triton.jit(do_not_specialize=["s_step"])
def _fma_kernel(x_ptr, c_ptr, s_ptr, part_ptr, out_ptr, lock_ptr, N, nblk, stride_xm, stride_om,
                blocks_per_split, magic, s_step, FMT: tl.constexpr, ROWS: tl.constexpr,
                BLOCK_N: tl.constexpr, KB: tl.constexpr, STAGES: tl.constexpr,
                SPLITS: tl.constexpr, FUSED: tl.constexpr):
    """out[:ROWS, cols] = x @ W^T, this program's share of K (blocks_per_split blocks, KB a step;
    with SPLITS > 1 its fp32 partial to part[split], summed by _finish_split or the host's
    _split_sum_kernel).

    q4_0: nibble s of word w is value 4s + w; the word's low half gives s = 0..3 as q - 8
    (_field, no shift), its high half s = 4..7, and x_s = x[4s + w], w = 0..3, is loaded as
    a [1, KB, 4] tile in the codes' own layout (no layout conversion). q8_0 likewise with bytes
    (q + 128 through an xor; value 8s + w).
    The scales load as [BN, KB, 1] in the codes' layout too: s_step (= 1, not specialised) hides
    their contiguity from Triton's coalescing, which otherwise gave them a vector layout of their
    own and a shared-memory conversion (two barriers) every step (SASS, sm_90, Triton 3.9).
    STAGES 0: the codes two steps ahead loaded into registers during this step (ptxas issues the
    loads at the loop's end: one step ahead left their latency exposed); 1: one step ahead;
    else Triton's pipeliner, STAGES steps in flight through shared memory (cp.async)."""
    pid_n, pid_s = tl.program_id(0), tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = rn < N
    W: tl.constexpr = 4 if FMT == 1 else 8  # int32 code words per block
    b = tl.arange(0, KB)[None, :, None]
    wi = tl.arange(0, W)[None, None, :]
    row = tl.minimum(rn, N - 1).to(tl.int64)[:, None, None] * nblk
    crow = c_ptr + row * W + (b * W + wi)  # [BN, KB, W]
    srow = s_ptr + row + b * s_step  # [BN, KB, 1]
    m1, m2, m3 = magic - 0x2000000, magic - 0x4000000, magic - 0x6000000  # 2^19, 2^15, 2^11
    xoff = b * 32 + wi  # [1, KB, W]: x_s at xoff + s W
    # [BN, KB, W] accumulators (q8_0: [BN, KB, 1]), summed once at the end
    AW: tl.constexpr = W if FMT == 1 else 1
    acc0 = tl.zeros((BLOCK_N, KB, AW), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_N, KB, AW), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_N, KB, AW), dtype=tl.float32)
    acc3 = tl.zeros((BLOCK_N, KB, AW), dtype=tl.float32)
    first = pid_s * blocks_per_split
    end = first + blocks_per_split
    if STAGES <= 1:
        AHEAD: tl.constexpr = 2 if STAGES == 0 else 1
        v_next = tl.load(crow + first * W)
        d_next = tl.load(srow + first)
        if AHEAD == 2:
            more = first + KB + b < end  # [1, KB, 1]: all true or all false
            v_far = tl.load(crow + (first + KB) * W, mask=more, other=0)
            d_far = tl.load(srow + first + KB, mask=more, other=0.0)
        for kb0 in range(first, end, KB):
            v, d = v_next, d_next.to(tl.float32)
            more = kb0 + AHEAD * KB + b < end
            if AHEAD == 2:
                v_next, d_next = v_far, d_far
                v_far = tl.load(crow + (kb0 + 2 * KB) * W, mask=more, other=0)
                d_far = tl.load(srow + kb0 + 2 * KB, mask=more, other=0.0)
            else:
                v_next = tl.load(crow + (kb0 + KB) * W, mask=more, other=0)
                d_next = tl.load(srow + kb0 + KB, mask=more, other=0.0)
            acc0, acc1, acc2, acc3 = _fma_step(v, d, x_ptr, stride_xm, kb0, xoff, magic, m1, m2, m3,
                                               acc0, acc1, acc2, acc3, FMT, ROWS)
    else:
        for kb0 in tl.range(first, end, KB, num_stages=STAGES):
            v = tl.load(crow + kb0 * W)
            d = tl.load(srow + kb0).to(tl.float32)
            acc0, acc1, acc2, acc3 = _fma_step(v, d, x_ptr, stride_xm, kb0, xoff, magic, m1, m2, m3,
                                               acc0, acc1, acc2, acc3, FMT, ROWS)
    for r in tl.static_range(ROWS):
        a = acc0 if r == 0 else (acc1 if r == 1 else (acc2 if r == 2 else acc3))
        acc = tl.sum(tl.sum(a, axis=2), axis=1)
        if SPLITS == 1:
            tl.store(out_ptr + r * stride_om + rn, acc.to(out_ptr.dtype.element_ty), mask=mask_n)
        else:
            tl.store(part_ptr + (pid_s * ROWS + r) * N + rn, acc, mask=mask_n)
    if SPLITS > 1 and FUSED:
        _finish_split(part_ptr, out_ptr, lock_ptr, pid_n, ROWS, N, stride_om, SPLITS, ROWS, BLOCK_N)


@triton.jit
def _finish_split(part_ptr, out_ptr, lock_ptr, pid_n, M, N, stride_om, SPLITS: tl.constexpr,
                  BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's partial is in part [SPLITS, M, N]; the last of its column tile's SPLITS
    programs to arrive (a counter per tile, lock_ptr, back to 0 after) adds the partials in
    split order, as _split_sum_kernel does (the same bits whichever program is last), and
    writes out: one launch a linear instead of two."""
    tl.debug_barrier()  # every thread's partial stored before the counter moves
    n_done = tl.atomic_add(lock_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
    if n_done == SPLITS - 1:
        rm = tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask = (rm < M)[:, None] & (rn < N)[None, :]
        p = part_ptr + rm[:, None] * N + rn[None, :]
        acc = tl.load(p, mask=mask, other=0.0, cache_modifier=".cg")
        for i in tl.static_range(1, SPLITS):
            acc += tl.load(p + i * M * N, mask=mask, other=0.0, cache_modifier=".cg")
        tl.store(out_ptr + rm[:, None] * stride_om + rn[None, :], acc.to(out_ptr.dtype.element_ty),
                 mask=mask)
        tl.atomic_xchg(lock_ptr + pid_n, 0)


@triton.jit
def _values(v, FMT: tl.constexpr):
    """Code words v [R, W] -> [R, 32 / W, W] fp32 q - zero: element (s, w) is nibble (byte) s
    of word w, value 4s + w (8s + w), so a reshape to [R, 32] is the block in K order."""
    if FMT == 1:
        q = (v[:, None, :] >> (4 * tl.arange(0, 8))[None, :, None]) & 0xF
        w = (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388616.0
    else:
        q = ((v[:, None, :] >> (8 * tl.arange(0, 4))[None, :, None]) & 0xFF) ^ 0x80
        w = (q | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0
    return w


@triton.jit
def _weights(c_ptr, s_ptr, rnc, nblk, kb, FMT: tl.constexpr, BLOCK_N: tl.constexpr):
    """Block kb of rows rnc [BN] -> [BN, 32] fp32 in K order, d * (q - zero) (the reference's
    bits)."""
    W: tl.constexpr = 4 if FMT == 1 else 8
    v = tl.load(c_ptr + (rnc.to(tl.int64) * nblk)[:, None] * W + (kb * W + tl.arange(0, W))[None, :])
    d = tl.load(s_ptr + rnc.to(tl.int64) * nblk + kb).to(tl.float32)
    return d[:, None] * tl.reshape(_values(v, FMT), (BLOCK_N, 32))


@triton.jit
def _dot_kernel(x_ptr, c_ptr, s_ptr, part_ptr, out_ptr, lock_ptr, M, N, nblk, stride_xm, stride_om,
                blocks_per_split, FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                KB: tl.constexpr, SPLITS: tl.constexpr, FUSED: tl.constexpr):
    """out[:M, cols] = x @ W^T over this split's K range on the tensor cores (partials as
    _fma_kernel): the weights the dot's left operand [BLOCK_N, 32] per block, x^T [32, BLOCK_M]
    the right."""
    pid_n, pid_s = tl.program_id(0), tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rnc = tl.minimum(rn, N - 1)
    rm = tl.arange(0, BLOCK_M)
    mask_m = rm < M
    j = tl.arange(0, 32)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    first = pid_s * blocks_per_split
    for kb0 in range(first, first + blocks_per_split, KB):
        for i in tl.static_range(KB):
            xt = tl.load(x_ptr + rm[None, :] * stride_xm + (kb0 + i) * 32 + j[:, None],
                         mask=mask_m[None, :], other=0.0)  # [32, BM]
            w = _weights(c_ptr, s_ptr, rnc, nblk, kb0 + i, FMT, BLOCK_N).to(xt.dtype)
            acc += tl.dot(w, xt, input_precision="ieee", out_dtype=tl.float32)
    _store_tile(acc, out_ptr, part_ptr, pid_s, rm, rn, mask_m, M, N, stride_om, SPLITS)
    if SPLITS > 1 and FUSED:
        _finish_split(part_ptr, out_ptr, lock_ptr, pid_n, M, N, stride_om, SPLITS, BLOCK_M, BLOCK_N)


@triton.jit
def _gemm_kernel(x_ptr, c_ptr, s_ptr, part_ptr, out_ptr, M, N, nblk, stride_xm, stride_om,
                 blocks_per_split, FMT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 KB: tl.constexpr, SPLITS: tl.constexpr, STAGES: tl.constexpr):
    """out^T [BLOCK_N, BLOCK_M] tile = W [cols, K] @ x [rows, K]^T on the tensor cores (wgmma on
    Hopper), the weights dequantized in registers (the reference's bits, _values) as the dot's
    left operand, KB blocks a step, STAGES steps in flight (Triton's pipeliner: cp.async into
    shared memory); with SPLITS > 1 this split's fp32 partial to part (summed in split order by
    _split_sum_kernel). (One dot per nibble position, K = 4 KB deep, with x gathered in the codes'
    order instead of the reshape: no faster at any tile of the sweep, 2026-11-27.)"""
    pid, pid_s = tl.program_id(0), tl.program_id(1)
    grid_m = tl.cdiv(M, BLOCK_M)
    pid_m, pid_n = pid % grid_m, pid // grid_m  # the row tiles of a column tile run together:
    # its weights come from HBM once, x (a row tile, <= 7 MB) from L2
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rnc = tl.minimum(rn, N - 1).to(tl.int64)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = rm < M
    W: tl.constexpr = 4 if FMT == 1 else 8
    cptr = c_ptr + (rnc * nblk * W)[:, None] + tl.arange(0, KB * W)[None, :]  # [BN, KB W] words
    sptr = s_ptr + (rnc * nblk)[:, None] + tl.arange(0, KB)[None, :]  # [BN, KB]
    xptr = x_ptr + (rm * stride_xm)[None, :] + tl.arange(0, KB * 32)[:, None]  # x^T [BK, BM]
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    first = pid_s * blocks_per_split
    for kb0 in tl.range(first, first + blocks_per_split, KB, num_stages=STAGES):
        v = tl.load(cptr + kb0 * W)
        d = tl.load(sptr + kb0).to(tl.float32)
        xt = tl.load(xptr + kb0 * 32, mask=mask_m[None, :], other=0.0)
        w = tl.reshape(_values(tl.reshape(v, (BLOCK_N * KB, W)), FMT), (BLOCK_N, KB, 32))
        w = tl.reshape(w * d[:, :, None], (BLOCK_N, KB * 32)).to(xt.dtype)
        acc = tl.dot(w, xt, acc, input_precision="ieee", out_dtype=tl.float32)
    _store_tile(acc, out_ptr, part_ptr, pid_s, rm, rn, mask_m, M, N, stride_om, SPLITS)


@triton.jit
def _store_tile(acc, out_ptr, part_ptr, pid_s, rm, rn, mask_m, M, N, stride_om, SPLITS: tl.constexpr):
    """acc^T [BLOCK_N, BLOCK_M] (rows rm, columns rn) -> out in its dtype, or with SPLITS > 1
    split pid_s's fp32 partial -> part [SPLITS, M, N]."""
    mask = mask_m[None, :] & (rn < N)[:, None]
    if SPLITS == 1:
        tl.store(out_ptr + rm[None, :] * stride_om + rn[:, None], acc.to(out_ptr.dtype.element_ty),
                 mask=mask)
    else:
        tl.store(part_ptr + (pid_s * M + rm[None, :]) * N + rn[:, None], acc, mask=mask)


@triton.jit
def _dequant_kernel(c_ptr, s_ptr, out_ptr, N, K, nblk, FMT: tl.constexpr,
                    BLOCK_N: tl.constexpr, KB: tl.constexpr):
    """out [N, K] (x's dtype) = d * (q - zero) (the reference's bits), [BLOCK_N, KB blocks] a
    program: the codes in one [BN, KB, W] load, each block's 32 values one contiguous store."""
    pid_n, pid_k = tl.program_id(0), tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rnc = tl.minimum(rn, N - 1)
    W: tl.constexpr = 4 if FMT == 1 else 8
    b = pid_k * KB + tl.arange(0, KB)
    wi = tl.arange(0, W)[None, None, :]
    v = tl.load(c_ptr + (rnc.to(tl.int64) * nblk)[:, None, None] * W + (b[None, :, None] * W + wi))
    d = tl.load(s_ptr + rnc[:, None].to(tl.int64) * nblk + b[None, :]).to(tl.float32)[:, :, None]
    w = tl.reshape(_values(tl.reshape(v, (BLOCK_N * KB, W)), FMT), (BLOCK_N, KB, 32)) * d  # K order
    o = out_ptr + rn[:, None, None].to(tl.int64) * K + (b[:, None] * 32 + tl.arange(0, 32)[None, :])[None]
    tl.store(o, w.to(out_ptr.dtype.element_ty), mask=(rn < N)[:, None, None])


_LOCKS: dict[torch.device, torch.Tensor] = {}
FUSED_SUM = True  # False: the split partials summed by a second launch (the benchmark's A/B)


def _locks(device: torch.device) -> torch.Tensor | None:
    """The per-column-tile counters of _finish_split (zeros between launches), one buffer per
    device, made outside graph capture (repack at load makes it). Launches on one stream at a
    time share it."""
    t = _LOCKS.get(device)
    if t is None and not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        t = _LOCKS[device] = torch.zeros(1 << 16, dtype=torch.int32, device=device)
    return t


def _views(p: torch.Tensor, fmt: Format) -> tuple[torch.Tensor, torch.Tensor, int]:
    codes, scales = _split(p, fmt)
    return codes.view(torch.int32), scales, codes.shape[1]


def qgemm(x: torch.Tensor, p: torch.Tensor, fmt: Format, out: torch.Tensor,
          tiles: tuple[int, int, int, int, int] | None = None) -> None:
    """out [M, N] = x [M, K] @ W^T, W planar uint8 [N, row_bytes] (repack). `tiles` (BLOCK_N,
    KB, splits, warps, stages) overrides the decode-sized paths' choice and keeps them from the
    fused GEMM (benchmarks/dev/quant_gemm_gpu.py --planar --tiles)."""
    (M, K), N = x.shape, p.shape[0]
    assert x.stride(1) == 1 and out.stride(1) == 1 and p.is_contiguous() and K % 32 == 0
    assert p.shape[1] == fmt.row_bytes(K) and out.shape == (M, N)
    codes, scales, nblk = _views(p, fmt)
    code = FORMATS[fmt.name]
    if GEMM and tiles is None and use_gemm(M, N, K, x.device):
        return gemm(x, p, fmt, out)
    if M > GEMV_ROWS:
        dense = torch.empty(N, K, dtype=x.dtype, device=x.device)
        kb = next(k for k in (8, 4, 2, 1) if nblk % k == 0)
        _dequant_kernel[(triton.cdiv(N, 64), nblk // kb)](codes, scales, dense, N, K, nblk, FMT=code,
                                                         BLOCK_N=64, KB=kb)
        torch.mm(x, dense.t(), out=out) if out.is_contiguous() else out.copy_(x @ dense.t())
        return
    fma = M <= FMA_ROWS
    if M == 1 and code == 1 and tiles is None and cuda_gemv.gemv(x, codes, scales, out, N, nblk):
        return
    bn, kb, splits, warps, stages = tiles or _tiles(x.device, N, nblk, M, code)
    per = nblk // splits
    assert per * splits == nblk and per % kb == 0, (nblk, kb, splits)
    part = out if splits == 1 else torch.empty(splits, M, N, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(N, bn), splits)
    # In-kernel split sums for the FMA kernel only: at 16 rows the last program's sum of 16
    # partial tiles cost more than the second launch (o 25.1 against 21.0 us, H100, 2026-11-27)
    locks = _locks(x.device) if FUSED_SUM and fma and splits > 1 else None
    fused = locks is not None and grid[0] <= locks.numel()
    locks = locks if fused else part
    if fma:
        _fma_kernel[grid](x, codes, scales, part, out, locks, N, nblk, x.stride(0), out.stride(0), per,
                          0x4B000000, 1, FMT=code, ROWS=M, BLOCK_N=bn, KB=kb, STAGES=stages,
                          SPLITS=splits, FUSED=fused, num_warps=warps)
    else:
        _dot_kernel[grid](x, codes, scales, part, out, locks, M, N, nblk, x.stride(0), out.stride(0), per,
                          FMT=code, BLOCK_M=max(16, triton.next_power_of_2(M)), BLOCK_N=bn, KB=kb,
                          SPLITS=splits, FUSED=fused, num_warps=warps, num_stages=stages)
    if splits > 1 and not fused:
        from flatserve.model.quant_triton import _split_sum_kernel

        _split_sum_kernel[(triton.cdiv(M * N, 1024),)](part, out, M * N, N, out.stride(0),
                                                        SPLITS=splits, BLOCK=1024)


def use_gemm(m: int, n: int, k: int, device: torch.device | None = None) -> bool:
    """Whether qgemm takes _gemm_kernel for m rows of an n x k weight: from 3 rows (below, the FMA
    GEMV) to 128, and to 256 for weights of >= 2^25 values but on an H200. Its time per call
    against the paths before it (benchmarks/dev/quant_gemm_gpu.py --planar / --gemm, q4_0,
    Llama-3-8B's linears, H100, 2026-11-27; raw docs/benchmarks/raw/gpu_h100_q4_0_fused_gemm/):
    4-32 rows o / gate_up / down 0.75-0.91x the tensor-core GEMV's, qkv 1.06-1.12x; 64-128 rows
    0.48-0.92x dequantize + cuBLAS's; 256 rows gate_up and down 0.83-0.92x, qkv and o 1.09-1.12x;
    512 rows 1.4-2.0x (the best tile: x re-read from L2 for every 64-128 weight rows, the
    dequantization not hidden). An H200's HBM3e makes the dense copy cheaper: there 128 rows for
    every weight took the offline run (offline_gpu.py --shape llama-3-8b --load-format dummy
    --quantization q4_0, 2026-11-29) from 6,321 / 6,364 to 6,536 tok/s and its 256-row decode step
    from 18.3 to 17.6 ms."""
    if m <= 128:
        return m > FMA_ROWS
    # 129-256 rows of a large weight only: the device is asked only then (qgemm runs per linear)
    return m <= 256 and n * k >= 1 << 25 and not (device is not None and dev.cuda_hbm3e(device))


def gemm(x: torch.Tensor, p: torch.Tensor, fmt: Format, out: torch.Tensor,
         tiles: tuple[int, ...] | None = None) -> None:
    """out [M, N] = x @ W^T by _gemm_kernel (no dense copy of W). `tiles` (BLOCK_M, BLOCK_N, KB,
    splits, warps, stages) overrides _gemm_tiles (benchmarks/dev/quant_gemm_gpu.py --gemm)."""
    (M, K), N = x.shape, p.shape[0]
    codes, scales, nblk = _views(p, fmt)
    bm, bn, kb, splits, warps, stages = tiles or _gemm_tiles(x.device, M, N, nblk)
    per = nblk // splits
    assert per * splits == nblk and per % kb == 0, (nblk, kb, splits)
    part = out if splits == 1 else torch.empty(splits, M, N, dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(M, bm) * triton.cdiv(N, bn), splits)
    _gemm_kernel[grid](x, codes, scales, part, out, M, N, nblk, x.stride(0), out.stride(0), per,
                       FMT=FORMATS[fmt.name], BLOCK_M=bm, BLOCK_N=bn, KB=kb, SPLITS=splits,
                       STAGES=stages, num_warps=warps)
    if splits > 1:
        from flatserve.model.quant_triton import _split_sum_kernel

        _split_sum_kernel[(triton.cdiv(M * N, 1024),)](part, out, M * N, N, out.stride(0),
                                                        SPLITS=splits, BLOCK=1024)


def _gemm_tiles(device: torch.device, m: int, n: int, nblk: int, bm: int | None = None,
                bn: int | None = None, kb: int | None = None) -> tuple[int, ...]:
    """(BLOCK_M, BLOCK_N, KB, splits, warps, stages) for _gemm_kernel: near the best of
    benchmarks/dev/quant_gemm_gpu.py --gemm per row count on an H100 (2026-11-27, Llama-3-8B's
    four shapes, q4_0; 24-112 tiles tried a row count): a row tile of the next power of 2 of m
    (16-256 rows); 64 weight rows a program (128 and 8 warps at 33-64 rows; 128 for K >= 8192 up
    to 32 rows); 4 blocks a step (2 at 16 rows for K < 8192, and at 256 rows); 3 stages. K split
    (in powers of 2) until the tiles fill every SM once."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2
    bm = bm or min(256, max(16, triton.next_power_of_2(m)))
    wide = bm == 64 or (bm <= 32 and nblk >= 256)
    bn = bn or (128 if wide else 64)
    warps = 8 if bm == 64 else 4
    kb = kb or (2 if bm >= 256 or (bm == 16 and not wide) else 4)
    kb = next(k for k in (kb, 2, 1) if nblk % k == 0)
    tiles, splits = triton.cdiv(m, bm) * triton.cdiv(n, bn), 1
    while tiles * splits < sms and nblk % (2 * splits * kb) == 0:
        splits *= 2
    return bm, bn, kb, splits, warps, 3


def _tiles(device: torch.device, n: int, nblk: int, rows: int, code: int = 1) -> tuple[int, int, int, int, int]:
    """(BLOCK_N, KB, splits, warps, stages), near the best of benchmarks/dev/quant_gemm_gpu.py
    --planar --tiles on an H100 (Llama-3-8B's four shapes). The FMA kernel (2026-11-27, after its
    scales moved into the codes' layout, q4_0, one row, 60 tiles): the next step prefetched into
    registers (stages 1; 2 steps ahead and Triton's cp.async pipeliner were slower), 8 blocks a
    step for K >= 8192 (down 25.6 us against 27.3 at 4), 128 columns on 8 warps for N <= 8192
    (qkv 14.0 / o 10.7 us against 14.5 / 11.3 at 64 on 4 warps), else 64 on 4 warps; K split in
    2 to 8 until >= 2.5 programs per SM (gate_up: 2); q8_0 (32-byte blocks) 64 columns and 4
    blocks a step. At two rows 64 columns, 4 blocks a step, 4 warps, K split at least in 4
    (q4_0 qkv / gate_up / down 17.9 / 65.0 / 33.9 us against 20.9 / 67.4 / 38.1 with the one-row
    tiles); q8_0 there through the pipeliner (stages 3: 21.3 / 16.9 / 77.6 / 42.4 us against
    HEAD's 20.6 / 15.4 / 74.3 / 45.9; registers one step ahead 22.3 / 16.0 / 85.1 / 43.1).
    The tensor-core kernel 128 columns, 2 blocks a step, 3 stages; K split at
    least in 4, and further until there are >= 2.5 programs per SM."""
    # The Triton interpreter (tests): a 2-SM device, so K still splits.
    sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 2
    if rows == 1:
        kb = 8 if code == 1 and nblk >= 256 else 4
        bn = 128 if code == 1 and kb == 4 and n <= 8192 else 64
        warps, stages, least, most = bn // 16, 1, 2, 8
    elif rows <= FMA_ROWS:
        bn, kb, warps, stages, least, most = 64, 4, 4, 1 if code == 1 else 3, 4, 64
    else:
        bn, kb, stages, least, most, warps = 128, 2, 3, 4, 64, 4
    kb = next(k for k in (kb, 4, 2, 1) if nblk % k == 0)
    tiles, splits = triton.cdiv(n, bn), 1
    while (splits < least or tiles * splits * 2 < 5 * sms) and splits < most \
            and nblk % (2 * splits * kb) == 0:
        splits *= 2
    return bn, kb, splits, warps, stages
