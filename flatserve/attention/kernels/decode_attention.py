"""Decode attention with the rope, the KV write and the split-KV merge in the same launch.

A decode-only step (one new token per sequence) runs three small kernels a layer on the unfused
path: rope + KV write (`triton_ops.qk_norm_rope`), attention, and the merge of the KV segments
(`unified_attention`). At one token each is a few microseconds of latency that moves no weight
bytes: ~13 us a layer in the PDL chain of an H200 Llama-3-8B q4_0 forward, 0.4 ms of 2.05
(docs/performance-gpu.md). Here one program per (sequence, KV head, segment):

  before the PDL wait  its sequence's metadata, cos / sin, and its first KV tile: the cache
                       holds earlier steps' keys there, which no kernel of this step writes
  after the wait       q's heads and the new k are normed and rotated in registers (the
                       rounding of the rope kernel); the new token's key and value enter the
                       tile that holds its position from registers, and the program whose range
                       holds it writes them to the cache for later steps
  the merge            each program stores its partial (max, sum, acc); the last of the
                       sequence's segments to finish (an atomic count, reset by that program)
                       merges them, as `_merge_kernel` does

The arithmetic is `unified_attention`'s (`_kv_tile`, `_online`; the merge as `_merge_kernel`'s)
and the rope's roundings are `qk_norm_rope`'s: the key written is the same bits, the output the
same up to the order of fp32 sums (tests/attention/test_decode_attention.py).

On by default where it fits (`ENABLED`; FLATSERVE_DECODE_ATTN_FUSED=0 keeps the three kernels):
faster on an H200 at batch 1 and 16 (docs/performance-gpu.md).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from flatserve.attention.base import LayerAttnParams
from flatserve.attention.kernels.unified_attention import (
    _kv_tile, _merge_kernel, _online, choose_segments, tile_config)
from flatserve.attention.metadata import AttentionMetadata
from flatserve.ops import pdl
from flatserve.ops.triton_ops import _head_norm, _round, rope_fits

# On an H200 (2026-11-29) it took the b1 q4_0 Llama-3-8B forward from 2.07-2.12 to 1.99-2.04 ms
# and a 16-row one from 7.18 to 6.98 ms. "0": the three kernels (rope + KV write, attention, merge).
ENABLED = os.environ.get("FLATSERVE_DECODE_ATTN_FUSED", "1") != "0"
IN_MERGE = os.environ.get("FLATSERVE_DECODE_ATTN_MERGE", "1") != "0"  # "0": the merge kernel after
CFG = os.environ.get("FLATSERVE_DECODE_ATTN_CFG", "")  # "warps,stages" (sweeps)
# Programs that can merge in-kernel: (sequence, KV head) pairs of a split step. A split needs
# fewer programs than SPLIT_TARGET x SMs (264 on an H100), so this never binds by default.
MAX_COUNTERS = 4096
_counters: dict[torch.device, torch.Tensor] = {}


@triton.jit
def _rows(x_ptr, rows, d, d_ok, partner):
    """Rows x_ptr + rows[:, None] + d of one token (rows < 0: masked), and the same rows at
    each dim's rotate-half partner -> two fp32 [R, HEAD_P]."""
    ok = d_ok[None, :] & (rows >= 0)[:, None]
    x = tl.load(x_ptr + rows[:, None] + d[None, :], mask=ok, other=0.0).to(tl.float32)
    xr = tl.load(x_ptr + rows[:, None] + partner[None, :], mask=ok, other=0.0).to(tl.float32)
    return x, xr


@triton.jit
def _rope(x, xr, d, d_ok, partner, sign, cos, sin, w_ptr, eps, dt: tl.constexpr, HEAD: tl.constexpr,
          ROT: tl.constexpr, NORM: tl.constexpr, OFFSET: tl.constexpr):
    """`_rows`' x normed (NORM) and rotated on its first ROT dims, rounded as
    `_qk_norm_rope_kernel` rounds -> fp32 [R, HEAD_P]."""
    if NORM:  # per-head RMSNorm over all HEAD dims, then the same weights on the partner dims
        inv = tl.rsqrt(tl.sum(x * x, 1) / HEAD + eps)[:, None]
        w = tl.load(w_ptr + d, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        wr = tl.load(w_ptr + partner, mask=d_ok, other=0.0).to(tl.float32)[None, :]
        x = _head_norm(x, inv, w, dt, OFFSET)
        xr = _head_norm(xr, inv, wr, dt, OFFSET)
    # x * cos + rotate_half(x) * sin: dim i < ROT/2 takes -x[i + ROT/2], the upper half +x[i - ROT/2]
    y = _round(_round(x * cos[None, :], dt) + _round(sign[None, :] * xr * sin[None, :], dt), dt)
    return tl.where((d < ROT)[None, :], y, x)


@triton.jit
def _with_new(n, kt, v, k_new, v_new, pos):
    """A KV tile with the new token's key and value (position pos) taken from registers: its
    cache slot holds a stale row until this kernel's own store, which other programs need not
    see yet."""
    return tl.where(n[None, :] == pos, k_new[:, None], kt), tl.where(n[:, None] == pos, v_new[None, :], v)


@triton.jit
def _update(n, kt, v, k_new, v_new, pos, q, M, L, acc, q_pos, row_ok, seq_len, scale, softcap, window,
            USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr, IEEE: tl.constexpr, MASK: tl.constexpr):
    """`_online` on a loaded KV tile, the new token's key and value put in (`_with_new`)."""
    kt, v = _with_new(n, kt, v, k_new, v_new, pos)
    return _online(n, kt, v, q, M, L, acc, q_pos, row_ok, seq_len, scale, softcap, window,
                   USE_SOFTCAP, USE_WINDOW, IEEE, MASK)


@triton.jit
def _merge_group(out_ptr, part_acc_ptr, part_ml_ptr, t, kvh, num_heads, stride_ot, stride_oh,
                 NUM_QPK: tl.constexpr, QPK_P: tl.constexpr, HEAD: tl.constexpr,
                 HEAD_P: tl.constexpr, SEGMENTS: tl.constexpr):
    """`_merge_kernel` for the NUM_QPK query heads of KV head kvh at once: one round of loads
    from L2 (".cg": other programs wrote them), not one per head."""
    hh = tl.arange(0, QPK_P)
    h_ok = hh < NUM_QPK
    h = kvh * NUM_QPK + hh
    idx = (t * num_heads + h)[:, None] * SEGMENTS + tl.arange(0, SEGMENTS)[None, :]  # [QPK_P, SEG]
    d = tl.arange(0, HEAD_P)
    m = tl.load(part_ml_ptr + idx * 2, mask=h_ok[:, None], other=0.0, cache_modifier=".cg")
    l = tl.load(part_ml_ptr + idx * 2 + 1, mask=h_ok[:, None], other=1.0, cache_modifier=".cg")
    acc = tl.load(part_acc_ptr + idx[:, :, None] * HEAD_P + d[None, None, :],
                  mask=h_ok[:, None, None], other=0.0, cache_modifier=".cg")  # [QPK_P, SEG, HEAD_P]
    w = tl.exp2(m - tl.max(m, 1)[:, None])  # log2 units; empty segments carry m = -inf -> weight 0
    o = tl.sum(acc * w[:, :, None], 1) / tl.sum(l * w, 1)[:, None]
    tl.store(out_ptr + t * stride_ot + h[:, None] * stride_oh + d[None, :],
             o.to(out_ptr.dtype.element_ty), mask=h_ok[:, None] & (d < HEAD)[None, :])


@triton.jit
def _decode_attn_kernel(out_ptr, part_acc_ptr, part_ml_ptr, cnt_ptr, q_ptr, k_ptr, v_ptr,
                        kc_ptr, vc_ptr, sinks_ptr, bt_ptr, seq_lens_ptr, slot_ptr, idx_ptr, cs_ptr,
                        qw_ptr, kw_ptr, sin_off, eps, scale, softcap, window,
                        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh,
                        stride_ot, stride_oh, stride_cb, stride_cs, stride_ch, stride_bt,
                        NUM_QPK: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD: tl.constexpr,
                        HEAD_P: tl.constexpr, BLOCK_M: tl.constexpr, TILE: tl.constexpr,
                        QPK_P: tl.constexpr, HALF: tl.constexpr, SEGMENTS: tl.constexpr,
                        NORM: tl.constexpr, OFFSET: tl.constexpr, USE_SOFTCAP: tl.constexpr,
                        USE_WINDOW: tl.constexpr, USE_SINKS: tl.constexpr, IEEE: tl.constexpr,
                        FUSE_MERGE: tl.constexpr, PDL: tl.constexpr):
    s = tl.program_id(0)  # the sequence, and its one token
    kvh = tl.program_id(1)
    seg = tl.program_id(2)
    dt = q_ptr.dtype.element_ty
    ROT: tl.constexpr = 2 * HALF
    seq_len = tl.load(seq_lens_ptr + s)
    pos = seq_len - 1  # the new token's position: its key is the last one
    slot = tl.load(slot_ptr + s).to(tl.int64)
    d = tl.arange(0, HEAD_P)
    d_ok = d < HEAD
    partner = tl.where(d < HALF, d + HALF, tl.where(d < ROT, d - HALF, d))
    sign = tl.where(d < HALF, -1.0, 1.0)
    row = tl.load(idx_ptr + s).to(tl.int64) * ROT  # table [2, P, ROT] fp32, both halves equal
    cos = _round(tl.load(cs_ptr + row + d, mask=d < ROT, other=0.0), dt)
    sin = _round(tl.load(cs_ptr + sin_off + row + d, mask=d < ROT, other=0.0), dt)
    hi_tile = pos // TILE + 1
    lo_tile = 0
    full_end = (pos + 1) // TILE  # tiles below it need no mask (unified_attention's split)
    if USE_WINDOW:
        lo_tile = tl.maximum(0, pos - window + 1) // TILE
        full_end = lo_tile
    per_seg = tl.cdiv(hi_tile - lo_tile, SEGMENTS)
    t0 = lo_tile + seg * per_seg
    t1 = tl.minimum(t0 + per_seg, hi_tile)
    # Earlier steps' keys, before the wait: loaded after it, the forward ran 2.27-2.32 against
    # 2.20-2.22 ms (H200 b1 q4_0, two pipeline stages then).
    n, kt, v = _kv_tile(t0, s, kvh, seq_len, d, d_ok, bt_ptr, kc_ptr, vc_ptr, stride_cb, stride_cs,
                        stride_ch, stride_bt, BLOCK_SIZE, TILE, True)
    pdl.sync(PDL)

    rows = tl.arange(0, BLOCK_M)
    row_ok = rows < NUM_QPK
    head = kvh * NUM_QPK + rows
    # Every load this step's kernels wrote, issued together: one round trip after the wait.
    qx, qxr = _rows(q_ptr, tl.where(row_ok, s.to(tl.int64) * stride_qt + head * stride_qh, -1), d,
                    d_ok, partner)  # [BLOCK_M, HEAD_P]
    kx, kxr = _rows(k_ptr, tl.zeros([1], tl.int64) + s.to(tl.int64) * stride_kt + kvh * stride_kh,
                    d, d_ok, partner)  # [1, HEAD_P]
    v_new = tl.load(v_ptr + s.to(tl.int64) * stride_vt + kvh * stride_vh + d, mask=d_ok).to(
        vc_ptr.dtype.element_ty)
    q = _rope(qx, qxr, d, d_ok, partner, sign, cos, sin, qw_ptr, eps, dt, HEAD, ROT, NORM,
              OFFSET).to(dt)
    k_new = tl.sum(_rope(kx, kxr, d, d_ok, partner, sign, cos, sin, kw_ptr, eps, dt, HEAD, ROT, NORM,
                         OFFSET), 0).to(dt).to(kc_ptr.dtype.element_ty)  # [HEAD_P]
    last = hi_tile - 1  # the tile that holds pos
    if (t0 <= last) & (last < t1) & (slot >= 0):  # this program's range holds the new key
        dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + kvh * stride_ch
        tl.store(kc_ptr + dst + d, k_new, mask=d_ok)
        tl.store(vc_ptr + dst + d, v_new, mask=d_ok)

    q_pos = tl.zeros([BLOCK_M], tl.int32) + pos
    M = tl.full([BLOCK_M], float("-inf"), tl.float32)
    if USE_SINKS:
        if seg == 0:  # the sink's logit enters once, with weight 1 and no value
            M = tl.load(sinks_ptr + head, mask=row_ok, other=0.0).to(tl.float32) * 1.4426950408889634
    L = tl.full([BLOCK_M], 1.0, tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_P], tl.float32)
    if t0 < t1:  # the preloaded first tile
        kt, v = _with_new(n, kt, v, k_new, v_new, pos)
        if t0 < full_end:
            M, L, acc = _online(n, kt, v, q, M, L, acc, q_pos, row_ok, seq_len, scale, softcap,
                                window, USE_SOFTCAP, USE_WINDOW, IEEE, False)
        else:
            M, L, acc = _online(n, kt, v, q, M, L, acc, q_pos, row_ok, seq_len, scale, softcap,
                                window, USE_SOFTCAP, USE_WINDOW, IEEE, True)
    mid = tl.maximum(t0 + 1, tl.minimum(full_end, t1))
    for j in range(t0 + 1, mid):
        n, kt, v = _kv_tile(j, s, kvh, seq_len, d, d_ok, bt_ptr, kc_ptr, vc_ptr, stride_cb,
                            stride_cs, stride_ch, stride_bt, BLOCK_SIZE, TILE, False)
        M, L, acc = _update(n, kt, v, k_new, v_new, pos, q, M, L, acc, q_pos, row_ok, seq_len, scale,
                            softcap, window, USE_SOFTCAP, USE_WINDOW, IEEE, False)
    for j in range(mid, t1):
        n, kt, v = _kv_tile(j, s, kvh, seq_len, d, d_ok, bt_ptr, kc_ptr, vc_ptr, stride_cb,
                            stride_cs, stride_ch, stride_bt, BLOCK_SIZE, TILE, True)
        M, L, acc = _update(n, kt, v, k_new, v_new, pos, q, M, L, acc, q_pos, row_ok, seq_len, scale,
                            softcap, window, USE_SOFTCAP, USE_WINDOW, IEEE, True)

    hq = NUM_QPK * tl.num_programs(1)
    if SEGMENTS == 1:
        o = acc / L[:, None]
        tl.store(out_ptr + s * stride_ot + head[:, None] * stride_oh + d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
    else:
        th = (s * hq + head) * SEGMENTS + seg
        tl.store(part_acc_ptr + th[:, None] * HEAD_P + d[None, :], acc, mask=row_ok[:, None])
        tl.store(part_ml_ptr + th * 2, M, mask=row_ok)
        tl.store(part_ml_ptr + th * 2 + 1, L, mask=row_ok)
    if (SEGMENTS > 1) & FUSE_MERGE:
        tl.debug_barrier()  # every thread's partial is stored before the count says so
        c = tl.atomic_add(cnt_ptr + s * tl.num_programs(1) + kvh, 1, sem="acq_rel", scope="gpu")
        if c == SEGMENTS - 1:  # the last segment: merge, and reset the count for the next launch
            tl.store(cnt_ptr + s * tl.num_programs(1) + kvh, 0)
            _merge_group(out_ptr, part_acc_ptr, part_ml_ptr, s, kvh, hq, stride_ot, stride_oh, NUM_QPK,
                         QPK_P, HEAD, HEAD_P, SEGMENTS)


def fits(meta: AttentionMetadata, head_dim: int, rotary_dim: int, num_kv_heads: int) -> bool:
    """Whether a decode step of this layer's shape can take the kernel (else the three run)."""
    return (meta.is_decode_only and rope_fits(head_dim, rotary_dim)[0]
            and len(meta.seq_lens_host) * num_kv_heads <= MAX_COUNTERS)


def use(meta: AttentionMetadata, head_dim: int, rotary_dim: int, num_kv_heads: int) -> bool:
    """`fits`, where it is on (ENABLED): the attention backend's `decode_fits`."""
    return ENABLED and fits(meta, head_dim, rotary_dim, num_kv_heads)


def _counts(device: torch.device) -> torch.Tensor:
    """The device's merge counts, zero between launches (each launch's last programs reset
    theirs). Made at the first call, which is a graph's eager warm-up, never inside a capture;
    kept for the process (captured graphs hold its address)."""
    c = _counters.get(device)
    if c is None:
        c = _counters[device] = torch.zeros(MAX_COUNTERS, dtype=torch.int32, device=device)
    return c


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, meta: AttentionMetadata, p: LayerAttnParams,
                     rope: tuple, sinks: torch.Tensor | None = None,
                     segments: int | None = None) -> torch.Tensor:
    """q [S, Hq, D], k, v [S, Hkv, D] (one token per sequence, before rope) -> [S, Hq, D], and
    k, v written to the caches [blocks, block_size, Hkv, D] at meta.slot_mapping. rope = (table
    rows [S], fp32 table [2, P, R], q_w, k_w (None: no q/k norm), eps, offset), as
    triton_ops.qk_norm_rope takes them. q and k are not changed (the unfused rope rotates them in
    place)."""
    S, Hq, D = q.shape
    Hkv, bs = k.shape[1], k_cache.shape[1]
    idx, table, q_w, k_w, eps, offset = rope
    R = table.shape[2]
    assert fits(meta, D, R, Hkv) and S == meta.num_seqs and table.dtype == torch.float32
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == k_cache.stride(-1) == 1
    assert k_cache.stride() == v_cache.stride() and meta.block_table.stride(-1) == 1
    out = torch.empty_like(q)
    if S == 0:
        return out
    qpk = Hq // Hkv
    block_m, tile, warps, stages = tile_config(meta, qpk, D)
    if segments is None:
        sms = torch.cuda.get_device_properties(q.device).multi_processor_count
        segments = choose_segments(meta, Hkv, sms)
    hp = triton.next_power_of_2(D)
    part_acc = part_ml = cnt = out  # unused placeholders when not segmented
    if segments > 1:
        part_acc = torch.empty(S, Hq, segments, hp, dtype=torch.float32, device=q.device)
        part_ml = torch.empty(S, Hq, segments, 2, dtype=torch.float32, device=q.device)
        cnt = _counts(q.device)
    # One pipeline stage: 2 stages doubled the program's shared memory (36 KB), and an H200 b1
    # q4_0 forward then ran 2.18-2.21 ms against 1.99-2.00 with 1 (2.07-2.12 unfused): the
    # programs must find room beside the GEMV before them to start early (PDL) and preload.
    # FP fusion off, as for qk_norm_rope: fp16 rope math contracted into 17 fma.rn.f16 (PTX for
    # sm_90, Triton 3.9), so the cached keys were not the rope kernel's (a CUDA test found it).
    warps, stages = (int(x) for x in CFG.split(",")) if CFG else (warps, 1)
    norm = q_w is not None
    launch = pdl.launch(q.device, S)
    _decode_attn_kernel[(S, Hkv, segments)](
        out, part_acc, part_ml, cnt, q, k, v, k_cache, v_cache, sinks if sinks is not None else q,
        meta.block_table, meta.seq_lens, meta.slot_mapping, idx, table,
        q_w if norm else q, k_w if norm else k, table.shape[1] * R, eps, p.scale, p.softcap or 1.0,
        p.sliding_window or 0,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        meta.block_table.stride(0),
        NUM_QPK=qpk, BLOCK_SIZE=bs, HEAD=D, HEAD_P=hp, BLOCK_M=block_m, TILE=tile,
        QPK_P=triton.next_power_of_2(qpk), HALF=R // 2,
        SEGMENTS=segments, NORM=norm, OFFSET=offset, USE_SOFTCAP=p.softcap is not None,
        USE_WINDOW=p.sliding_window is not None, USE_SINKS=sinks is not None,
        IEEE=q.dtype == torch.float32, FUSE_MERGE=IN_MERGE, num_warps=warps,
        num_stages=stages, enable_fp_fusion=False, **launch)
    if segments > 1 and not IN_MERGE:
        _merge_kernel[(S, Hq)](out, part_acc, part_ml, out.stride(0), out.stride(1), Hq,
                               HEAD=D, HEAD_P=hp, SEGMENTS=segments, **launch)
    return out
