"""One launch per layer for any batch: paged varlen attention in Triton.

Grid (q_blocks, kv_heads[, segments]). A program owns BLOCK_Q query tokens of one sequence and
all NUM_QPK query heads that share one KV head (GQA packing: each KV tile is read once for the
group), so its tile has BLOCK_M = BLOCK_Q * NUM_QPK rows for `tl.dot`. The program finds its
sequence by binary search over `cu_seqlens_q` through the block-unit transform
`cu_seqlens_q[i] // BLOCK_Q + i`; the grid is sized `T // BLOCK_Q + S` (an over-estimate that
needs no host sync) and surplus programs exit. With SEGMENTS > 1 (decode with too few programs
to fill the GPU) the KV range is split and a second kernel merges the partial (max, sum, acc).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from flatserve.attention.base import LayerAttnParams
from flatserve.attention.metadata import AttentionMetadata
from flatserve.ops import pdl


@triton.jit
def _find_seq(cu_ptr, target, num_seqs, BLOCK_Q: tl.constexpr):
    lo = 0
    hi = num_seqs
    while lo < hi:  # largest i with cu[i] // BLOCK_Q + i <= target
        mid = (lo + hi + 1) // 2
        v = tl.load(cu_ptr + mid) // BLOCK_Q + mid
        if v <= target:
            lo = mid
        else:
            hi = mid - 1
    return lo


@triton.jit
def _kv_tile(j, s, kvh, seq_len, d, d_ok, bt_ptr, kc_ptr, vc_ptr, stride_cb, stride_cs, stride_ch,
             stride_bt, BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, MASK: tl.constexpr):
    """KV tile j of sequence s, head kvh: (key indices n [TILE], K^T [HEAD_P, TILE],
    V [TILE, HEAD_P]). MASK=False: the tile lies wholly below seq_len."""
    n = j * TILE + tl.arange(0, TILE)
    n_ok = n < seq_len
    if MASK:
        blk = tl.load(bt_ptr + s * stride_bt + n // BLOCK_SIZE, mask=n_ok, other=0).to(tl.int64)
    else:
        blk = tl.load(bt_ptr + s * stride_bt + n // BLOCK_SIZE).to(tl.int64)
    off = blk * stride_cb + (n % BLOCK_SIZE) * stride_cs + kvh * stride_ch
    if MASK:
        kt = tl.load(kc_ptr + off[None, :] + d[:, None], mask=d_ok[:, None] & n_ok[None, :],
                     other=0.0)  # [HEAD_P, TILE]
        v = tl.load(vc_ptr + off[:, None] + d[None, :], mask=n_ok[:, None] & d_ok[None, :],
                    other=0.0)  # [TILE, HEAD_P]
    else:
        kt = tl.load(kc_ptr + off[None, :] + d[:, None], mask=d_ok[:, None], other=0.0)
        v = tl.load(vc_ptr + off[:, None] + d[None, :], mask=d_ok[None, :], other=0.0)
    return n, kt, v


@triton.jit
def _online(n, kt, v, q, M, L, acc, q_pos, row_ok, seq_len, scale, softcap, window,
            USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr, IEEE: tl.constexpr,
            MASK: tl.constexpr):
    """One KV tile of online softmax. MASK=False: every key is visible to every row."""
    # Scores live in log2 units (x log2 e) so the softmax uses exp2, one multiply fewer per score.
    if IEEE:
        sc = tl.dot(q, kt, input_precision="ieee")
    else:
        sc = tl.dot(q.to(kt.dtype), kt)  # [BLOCK_M, TILE]
    if USE_SOFTCAP:  # softcap * tanh(sc * scale / softcap), then to log2 units
        sc = softcap * (2.0 * tl.sigmoid(2.0 * sc * scale / softcap) - 1.0) * 1.4426950408889634
    else:
        sc = sc * (scale * 1.4426950408889634)
    if MASK:
        ok = (n[None, :] <= q_pos[:, None]) & (n < seq_len)[None, :] & row_ok[:, None]
        if USE_WINDOW:
            ok = ok & (n[None, :] > q_pos[:, None] - window)
        sc = tl.where(ok, sc, float("-inf"))
    m_new = tl.maximum(M, tl.max(sc, 1))
    if MASK:
        m_new = tl.where(m_new > float("-inf"), m_new, 0.0)  # a row with nothing visible yet
    p = tl.exp2(sc - m_new[:, None])
    alpha = tl.exp2(M - m_new)
    L = L * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if IEEE:
        acc += tl.dot(p, v, input_precision="ieee")
    else:
        acc += tl.dot(p.to(v.dtype), v)
    return m_new, L, acc


@triton.jit
def _tile(j, q, M, L, acc, s, kvh, q_pos, row_ok, seq_len, d, d_ok, bt_ptr, kc_ptr, vc_ptr,
          scale, softcap, window, stride_cb, stride_cs, stride_ch, stride_bt,
          BLOCK_SIZE: tl.constexpr, TILE: tl.constexpr, USE_SOFTCAP: tl.constexpr,
          USE_WINDOW: tl.constexpr, IEEE: tl.constexpr, MASK: tl.constexpr):
    """One KV tile of online softmax: the load, then the update."""
    n, kt, v = _kv_tile(j, s, kvh, seq_len, d, d_ok, bt_ptr, kc_ptr, vc_ptr, stride_cb, stride_cs,
                        stride_ch, stride_bt, BLOCK_SIZE, TILE, MASK)
    return _online(n, kt, v, q, M, L, acc, q_pos, row_ok, seq_len, scale, softcap, window,
                   USE_SOFTCAP, USE_WINDOW, IEEE, MASK)


@triton.jit
def _attn_kernel(out_ptr, part_acc_ptr, part_ml_ptr, q_ptr, kc_ptr, vc_ptr, sinks_ptr, bt_ptr,
                 seq_lens_ptr, cu_ptr, map_ptr, scale, softcap, window, num_seqs,
                 stride_qt, stride_qh, stride_ot, stride_oh,
                 stride_cb, stride_cs, stride_ch, stride_bt,
                 NUM_QPK: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD: tl.constexpr,
                 HEAD_P: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
                 TILE: tl.constexpr, SEGMENTS: tl.constexpr, USE_SOFTCAP: tl.constexpr,
                 USE_WINDOW: tl.constexpr, USE_SINKS: tl.constexpr, IEEE: tl.constexpr,
                 USE_MAP: tl.constexpr, PDL: tl.constexpr):
    # The batch's metadata (cu_seqlens, seq_lens, the map) is read before the PDL wait: no kernel
    # of the step writes it (host copies before the first kernel, which is not a PDL launch), so
    # its loads are off the critical path between the rope kernel and this one.
    qb = tl.program_id(0)
    kvh = tl.program_id(1)
    seg = tl.program_id(2)
    if USE_MAP:  # host-built q-block -> sequence map (the measured alternative)
        s = tl.load(map_ptr + qb)
        if s < 0:
            pdl.sync(PDL)
            return
    else:
        s = _find_seq(cu_ptr, qb, num_seqs, BLOCK_Q)
    q_start = tl.load(cu_ptr + s)
    q_len = tl.load(cu_ptr + s + 1) - q_start
    qb_local = qb - (q_start // BLOCK_Q + s)
    seq_len = tl.load(seq_lens_ptr + s)
    pdl.sync(PDL)  # every program, the surplus ones too (pdl.py's rule)
    if qb_local * BLOCK_Q >= q_len:
        return  # surplus program of the over-provisioned grid
    ctx = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    qi = qb_local * BLOCK_Q + rows // NUM_QPK  # query index inside the sequence  [BLOCK_M]
    head = kvh * NUM_QPK + rows % NUM_QPK  # query head  [BLOCK_M]
    row_ok = qi < q_len
    d = tl.arange(0, HEAD_P)
    d_ok = d < HEAD
    tok = q_start + qi
    q = tl.load(q_ptr + tok[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                mask=row_ok[:, None] & d_ok[None, :], other=0.0)  # [BLOCK_M, HEAD_P]
    q_pos = ctx + qi  # absolute positions  [BLOCK_M]

    M = tl.full([BLOCK_M], float("-inf"), tl.float32)
    if USE_SINKS:
        if seg == 0:  # the sink's logit enters once, with weight 1 and no value
            M = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634  # log2 units
    L = tl.full([BLOCK_M], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_P], tl.float32)

    first_pos = ctx + qb_local * BLOCK_Q
    last_pos = ctx + tl.minimum(q_len, (qb_local + 1) * BLOCK_Q) - 1
    hi_tile = last_pos // TILE + 1
    lo_tile = 0
    # Tiles wholly visible to every row of this program (below the causal diagonal, inside the
    # window) need no mask: only the diagonal tiles pay for it (FA-2's split).
    full_end = (first_pos + 1) // TILE
    if USE_WINDOW:
        lo_tile = tl.maximum(0, first_pos - window + 1) // TILE
        full_end = lo_tile  # window edges move per row: mask every tile (Gemma's local layers)
    per_seg = tl.cdiv(hi_tile - lo_tile, SEGMENTS)
    t0 = lo_tile + seg * per_seg
    t1 = tl.minimum(t0 + per_seg, hi_tile)
    mid = tl.maximum(t0, tl.minimum(full_end, t1))
    for j in range(t0, mid):
        M, L, acc = _tile(j, q, M, L, acc, s, kvh, q_pos, row_ok, seq_len, d, d_ok, bt_ptr,
                          kc_ptr, vc_ptr, scale, softcap, window, stride_cb, stride_cs, stride_ch,
                          stride_bt, BLOCK_SIZE, TILE, USE_SOFTCAP, USE_WINDOW, IEEE, False)
    for j in range(mid, t1):
        M, L, acc = _tile(j, q, M, L, acc, s, kvh, q_pos, row_ok, seq_len, d, d_ok, bt_ptr,
                          kc_ptr, vc_ptr, scale, softcap, window, stride_cb, stride_cs, stride_ch,
                          stride_bt, BLOCK_SIZE, TILE, USE_SOFTCAP, USE_WINDOW, IEEE, True)

    if SEGMENTS == 1:
        o = acc / L[:, None]
        tl.store(out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:  # partials [T, Hq, SEGMENTS, HEAD_P] and (M, L) [T, Hq, SEGMENTS, 2], merged below
        th = (tok * (NUM_QPK * tl.num_programs(1)) + head) * SEGMENTS + seg
        tl.store(part_acc_ptr + th[:, None] * HEAD_P + d[None, :], acc, mask=row_ok[:, None])
        tl.store(part_ml_ptr + th * 2, M, mask=row_ok)
        tl.store(part_ml_ptr + th * 2 + 1, L, mask=row_ok)


@triton.jit
def _merge_kernel(out_ptr, part_acc_ptr, part_ml_ptr, stride_ot, stride_oh, num_heads,
                  HEAD: tl.constexpr, HEAD_P: tl.constexpr, SEGMENTS: tl.constexpr, PDL: tl.constexpr):
    pdl.sync(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    sg = tl.arange(0, SEGMENTS)
    base = (t * num_heads + h) * SEGMENTS
    m = tl.load(part_ml_ptr + (base + sg) * 2)
    l = tl.load(part_ml_ptr + (base + sg) * 2 + 1)
    mx = tl.max(m, 0)
    w = tl.exp2(m - mx)  # log2 units; empty segments carry m = -inf -> weight 0
    d = tl.arange(0, HEAD_P)
    acc = tl.load(part_acc_ptr + (base + sg)[:, None] * HEAD_P + d[None, :])
    o = tl.sum(acc * w[:, None], 0) / tl.sum(l * w, 0)
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, o.to(out_ptr.dtype.element_ty), mask=d < HEAD)


# Tiles for D <= 128: (BLOCK_M rows, KV TILE, warps, stages). Override for sweeps.
PREFILL_CFG = tuple(int(x) for x in os.environ.get("FLATSERVE_PREFILL_CFG", "64,64,4,2").split(","))
DECODE_CFG = tuple(int(x) for x in os.environ.get("FLATSERVE_DECODE_CFG", "16,64,4,2").split(","))
# Register cap for decode launches (0: the compiler's choice); programs per SM can be bound by
# registers before shared memory. Env override for sweeps.
DECODE_MAXNREG = int(os.environ.get("FLATSERVE_DECODE_MAXNREG", "0"))


def tile_config(meta: AttentionMetadata, qpk: int, D: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, TILE, warps, stages) from the batch's shape: host ints only, no device reads."""
    if meta.is_decode_only:
        block_m, tile, warps, stages = DECODE_CFG if D <= 128 else (16, 32, 4, 2)
        return max(block_m, triton.next_power_of_2(qpk)), tile, warps, stages
    block_m, tile, warps, stages = PREFILL_CFG if D <= 128 else (64, 32, 8, 2)
    return max(block_m, triton.next_power_of_2(qpk)), tile, warps, stages


def build_seq_map(meta: AttentionMetadata, block_q: int) -> list[int]:
    """Host-built q-block -> sequence map over the same over-provisioned grid (-1 = surplus)."""
    cu = meta.cu_seqlens_q_host
    S = meta.num_seqs
    out = [-1] * (cu[-1] // block_q + S)
    for i in range(S):
        first = cu[i] // block_q + i
        for j in range(-(-(cu[i + 1] - cu[i]) // block_q)):
            out[first + j] = i
    return out


# Decode programs wanted per SM before the KV range is split (env override for sweeps).
SPLIT_TARGET = float(os.environ.get("FLATSERVE_SPLIT_TARGET", "2"))


def decode_bucket(num_seqs: int) -> int:
    """The decode graphs' batch bucket for num_seqs sequences (graphs.capture_sizes: 1, 2, 4, 8,
    then multiples of 8; a last bucket of max_num_seqs maps to its multiple of 8 here too)."""
    return 1 << (num_seqs - 1).bit_length() if num_seqs <= 8 else -(-num_seqs // 8) * 8


def choose_segments(meta: AttentionMetadata, num_kv_heads: int, num_sms: int) -> int:
    """Split KV only for decode-only batches that leave the GPU under-filled (host ints only),
    by the batch's graph bucket: an eager step and a graph replay of the same batch split alike,
    so their tokens are the same bits (tests/test_cuda_e2e.py)."""
    if not meta.is_decode_only:
        return 1
    return fill_segments(decode_bucket(meta.num_seqs), num_kv_heads, num_sms)


def fill_segments(num_seqs: int, num_kv_heads: int, num_sms: int) -> int:
    """KV segments (a power of 2, <= 16) for a decode grid of num_seqs x num_kv_heads programs
    to reach SPLIT_TARGET programs per SM. Each program takes its share of the tiles from its
    sequence's length on the device (a segment past the end merges with weight 0), so a decode
    graph can bake it in for any length (graphs.py): at one sequence of Llama-3-8B (8 KV heads,
    context ~531, H100) the unsplit kernel took 19.3 us a layer, 0.62 ms of a 4.6 ms q4_0 step."""
    programs = num_seqs * num_kv_heads
    want = SPLIT_TARGET * num_sms
    if programs >= want:
        return 1
    return min(16, triton.next_power_of_2(-(-int(want) // max(programs, 1))))


def unified_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                      meta: AttentionMetadata, p: LayerAttnParams,
                      sinks: torch.Tensor | None = None, out: torch.Tensor | None = None,
                      segments: int | None = None, seq_map: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, Hq, D] over caches [num_blocks, block_size, Hkv, D] -> [T, Hq, D]."""
    T, Hq, D = q.shape
    _, bs, Hkv, Dk = k_cache.shape
    assert Dk == D and Hq % Hkv == 0 and q.stride(-1) == 1 and k_cache.stride(-1) == 1
    assert k_cache.stride() == v_cache.stride() and meta.block_table.stride(-1) == 1
    out = torch.empty_like(q) if out is None else out
    qpk = Hq // Hkv
    # Decode-only: one query token per program (BLOCK_Q = 1 unless the group is small);
    # prefill/mixed: 64 rows per tile for tl.dot on the tensor cores.
    block_m, tile, warps, stages = tile_config(meta, qpk, D)
    block_q = block_m // qpk
    if segments is None:
        segments = choose_segments(meta, Hkv, torch.cuda.get_device_properties(q.device).multi_processor_count)
    grid = (T // block_q + meta.num_seqs, Hkv, segments)
    hp = triton.next_power_of_2(D)
    part_acc = part_ml = out  # unused placeholders when not segmented
    if segments > 1:
        part_acc = torch.empty(T, Hq, segments, hp, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(T, Hq, segments, 2, dtype=torch.float32, device=q.device)
    launch = pdl.launch(q.device, T)
    _attn_kernel[grid](
        out, part_acc, part_ml, q, k_cache, v_cache, sinks if sinks is not None else q,
        meta.block_table, meta.seq_lens, meta.cu_seqlens_q,
        seq_map if seq_map is not None else meta.seq_lens, p.scale, p.softcap or 1.0,
        p.sliding_window or 0, meta.num_seqs, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), meta.block_table.stride(0),
        NUM_QPK=qpk, BLOCK_SIZE=bs, HEAD=D, HEAD_P=hp, BLOCK_Q=block_q, BLOCK_M=block_m, TILE=tile,
        SEGMENTS=segments, USE_SOFTCAP=p.softcap is not None, USE_WINDOW=p.sliding_window is not None,
        USE_SINKS=sinks is not None, IEEE=q.dtype == torch.float32, USE_MAP=seq_map is not None,
        num_warps=warps, num_stages=stages, **launch,
        **({"maxnreg": DECODE_MAXNREG} if meta.is_decode_only and DECODE_MAXNREG else {}))
    if segments > 1:
        _merge_kernel[(T, Hq)](out, part_acc, part_ml, out.stride(0), out.stride(1), Hq,
                               HEAD=D, HEAD_P=hp, SEGMENTS=segments, **launch)
    return out
