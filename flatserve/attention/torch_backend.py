"""Torch-native paged varlen attention: the CPU/MPS path and the reference for every kernel.

One call serves any mix of prefill chunks, decodes and verify runs. Work is per sequence over
that sequence's own context: nothing is padded to the batch's longest sequence.
"""
from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F

from flatserve.attention.base import LayerAttnParams
from flatserve.attention.metadata import AttentionMetadata


def write_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor, meta: AttentionMetadata | None = None) -> None:
    """k, v [T, Hkv, D] -> caches [num_blocks, block_size, Hkv, D] at slot_mapping[T] (< 0 skipped).
    With the step's metadata, whether any slot is skipped is found once per step, not per layer
    (a compare, a reduction and a host sync: ~0.5 ms of an 18-layer CPU decode step)."""
    kf = k_cache.view(-1, *k_cache.shape[2:])  # [num_blocks*block_size, Hkv, D]
    vf = v_cache.view(-1, *v_cache.shape[2:])
    skips = None if meta is None else meta.derived.get("slot_skips")
    if skips is None:
        skips = not bool((slot_mapping >= 0).all())
        if meta is not None:
            meta.derived["slot_skips"] = skips
    if skips:
        keep = slot_mapping >= 0
        slot_mapping, k, v = slot_mapping[keep], k[keep], v[keep]
    kf.index_copy_(0, slot_mapping, k.to(kf.dtype))
    vf.index_copy_(0, slot_mapping, v.to(vf.dtype))


def attend_one(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, k_start: int,
               p: LayerAttnParams, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [n, Hq, D] at positions q_start.., k/v [L, Hkv, D] at positions k_start.. -> [n, Hq, D]."""
    n, hq, d = q.shape
    L, hkv, _ = k.shape
    w = p.sliding_window
    if p.softcap is None and sinks is None and n * (hq // hkv) > 16:
        if w is not None and n > w:
            # Rows in blocks of the window: each block reads at most 2w keys instead of all
            # n, and a first block at position 0 is plain causal (no mask, upper half skipped).
            out = torch.empty_like(q)
            for a in range(0, n, w):
                b = min(n, a + w)
                ks = max(k_start, q_start + a - w + 1)
                out[a:b] = attend_one(q[a:b], k[ks - k_start:q_start + b - k_start],
                                      v[ks - k_start:q_start + b - k_start], q_start + a, ks, p)
            return out
        return _attend_sdpa(q, k, v, q_start, k_start, p)
    if n > MATH_ROWS:  # the maths path holds [Hkv, n*g, L] fp32 scores: bound them by rows
        out = torch.empty_like(q)  # (a GPT-OSS 8k-token prefill chunk: 17 GB in one piece)
        for a in range(0, n, MATH_ROWS):
            b = min(n, a + MATH_ROWS)
            ks = k_start if w is None else max(k_start, q_start + a - w + 1)
            end = q_start + b - k_start  # keys up to the block's last row
            out[a:b] = _attend_math(q[a:b], k[ks - k_start:end], v[ks - k_start:end],
                                    q_start + a, ks, p, sinks)
        return out
    return _attend_math(q, k, v, q_start, k_start, p, sinks)


MATH_ROWS = 256  # query rows per maths-path block (softcap, sinks)


def _visible(n: int, L: int, q_start: int, k_start: int, window: int | None,
             device: torch.device) -> torch.Tensor:
    """[n, L] bool: key j visible to query i (causal, and inside the window if any)."""
    q_pos = torch.arange(q_start, q_start + n, device=device)[:, None]  # [n, 1]
    k_pos = torch.arange(k_start, k_start + L, device=device)[None, :]  # [1, L]
    mask = k_pos <= q_pos
    if window is not None:
        mask = mask & (k_pos > q_pos - window)
    return mask


def _attend_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, k_start: int,
                 p: LayerAttnParams) -> torch.Tensor:
    """Prefill chunks and long verify runs through SDPA on [1, H, rows, D] views (CPU SDPA takes
    its flash kernel only for 4-D inputs; on 3-D ones it fell back to the math path, 7x slower
    for a 1,500-token bf16 Gemma prefill). A chunk whose keys are exactly its own positions is
    plain causal: no mask, and the flash kernel skips the blocks above the diagonal (1,006 bf16
    Gemma tokens: 4.2 ms against 7.5 with a mask; 2,048: 13 against 41). GQA through
    enable_gqa, not by repeating K/V."""
    n, hq, _ = q.shape
    L, hkv, _ = k.shape
    q4, k4, v4 = q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None]
    causal = k_start == q_start and L == n and (p.sliding_window is None or n <= p.sliding_window)
    mask = None
    if not causal and (k_start + L - 1 > q_start or (
            p.sliding_window is not None and k_start <= q_start + n - 1 - p.sliding_window)):
        mask = _visible(n, L, q_start, k_start, p.sliding_window, q.device)  # [n, L]
    out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask, is_causal=causal,
                                         scale=p.scale, enable_gqa=hq != hkv)  # [1, Hq, n, D]
    return out[0].transpose(0, 1)  # [n, Hq, D]


def _attend_math(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_start: int, k_start: int,
                 p: LayerAttnParams, sinks: torch.Tensor | None) -> torch.Tensor:
    """Decode-sized query groups, softcap and sinks: fp32 maths (CPU bf16 matmuls this small
    ran 1.5x slower than converting, 271 vs 181 ms per 16-request Gemma step). GQA is folded,
    not repeated: the g = Hq/Hkv query heads of a KV head become g*n query rows against that
    head's keys (CPU SDPA with enable_gqa ran ~5x slower, 1.0 vs 0.19 ms for a 750-token bf16
    decode on the dev box)."""
    n, hq, d = q.shape
    L, hkv, _ = k.shape
    g = hq // hkv
    qh = q.view(n, hkv, g, d).permute(1, 0, 2, 3).reshape(hkv, n * g, d)  # rows: (token, head in group)
    kh, vh = k.transpose(0, 1), v.transpose(0, 1)  # [Hkv, L, D]
    ct = torch.promote_types(q.dtype, torch.float32)  # float64 stays float64 (tests)
    s = (qh.to(ct) @ kh.to(ct).transpose(1, 2)) * p.scale  # [Hkv, n*g, L]
    if p.softcap is not None:
        s = torch.tanh(s / p.softcap) * p.softcap
    # A decode token over keys its window fully covers needs no mask (the common case).
    if n > 1 or k_start + L - 1 > q_start or (
            p.sliding_window is not None and k_start <= q_start - p.sliding_window):
        mask = _visible(n, L, q_start, k_start, p.sliding_window, q.device)
        s = s.masked_fill(~mask.repeat_interleave(g, dim=0), float("-inf"))
    if sinks is not None:  # a per-head logit that takes softmax mass but has no value
        sk = sinks.to(ct).view(1, hkv, g).expand(n, hkv, g).permute(1, 0, 2).reshape(hkv, n * g, 1)
        s = torch.cat([s, sk], dim=-1)
    w = torch.softmax(s, dim=-1)[..., :L]
    out = (w @ vh.to(ct)).to(q.dtype)
    return out.view(hkv, n, g, d).permute(1, 0, 2, 3).reshape(n, hq, d)


class TorchAttentionBackend:
    name = "torch"

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                p: LayerAttnParams, sinks: torch.Tensor | None = None) -> torch.Tensor:
        write_kv(k, v, k_cache, v_cache, meta.slot_mapping, meta)
        return paged_attention_ref(q, k_cache, v_cache, meta, p, sinks)


def paged_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                        meta: AttentionMetadata, p: LayerAttnParams,
                        sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, Hq, D] over the paged caches -> [T, Hq, D]; a loop over sequences, not padding."""
    out = torch.empty_like(q)
    attend_seqs(q, k_cache, v_cache, meta, p, sinks, out, range(meta.num_seqs))
    return out


def attend_seqs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, p: LayerAttnParams, sinks: torch.Tensor | None,
                out: torch.Tensor, seqs: Iterable[int]) -> None:
    """Fill out[rows of each sequence in seqs] with its attention over its own paged KV."""
    bs = k_cache.shape[1]
    cu, lens = meta.cu_seqlens_q_host, meta.seq_lens_host
    for s in seqs:
        qs, qe, L = cu[s], cu[s + 1], lens[s]
        if qe == qs:
            continue
        q_start = L - (qe - qs)
        # Keys older than the window are never read (they stay in the pool: see the note).
        k_start = 0 if p.sliding_window is None else max(0, q_start - p.sliding_window + 1)
        b0, b1 = k_start // bs, -(-L // bs)
        blocks = meta.block_table[s, b0:b1]
        kk = k_cache[blocks].flatten(0, 1)[k_start - b0 * bs:L - b0 * bs]  # [L', Hkv, D]
        vv = v_cache[blocks].flatten(0, 1)[k_start - b0 * bs:L - b0 * bs]
        out[qs:qe] = attend_one(q[qs:qe], kk, vv, q_start, k_start, p, sinks)
