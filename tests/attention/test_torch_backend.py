"""The torch backend (CPU; the reference the kernels are tested against) vs a dense float64
computation, on a paged cache with shuffled blocks: decodes, prefill chunks, windows, softcap, sinks."""
from __future__ import annotations

import random

import pytest
import torch

from flatserve.attention.base import LayerAttnParams
from flatserve.attention.metadata import AttentionMetadata
from flatserve.attention.torch_backend import paged_attention_ref


def _dense(q, k, v, q_start, p: LayerAttnParams, sinks):
    """q [n, Hq, D] at positions q_start.., k/v [L, Hkv, D] at 0.. -> [n, Hq, D], float64."""
    n, hq, _ = q.shape
    L, hkv, _ = k.shape
    g = hq // hkv
    kr, vr = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)  # [L, Hq, D]
    s = torch.einsum("nhd,lhd->hnl", q, kr) * p.scale
    if p.softcap is not None:
        s = torch.tanh(s / p.softcap) * p.softcap
    qp = torch.arange(q_start, q_start + n)[:, None]
    kp = torch.arange(L)[None, :]
    ok = kp <= qp
    if p.sliding_window is not None:
        ok &= kp > qp - p.sliding_window
    s = s.masked_fill(~ok, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.double()[:, None, None].expand(hq, n, 1)], -1)
    w = s.softmax(-1)[..., :L]
    return torch.einsum("hnl,lhd->nhd", w, vr)


@pytest.mark.parametrize("window,softcap,use_sinks", [(None, None, False), (48, None, False),
                                                      (48, 30.0, True), (200, None, False)])
def test_paged_ref_matches_dense_float64(window, softcap, use_sinks) -> None:
    rng = random.Random()
    hq, hkv, d, bs, nb = 8, 2, 32, 16, 400
    p = LayerAttnParams(scale=d ** -0.5, sliding_window=window, softcap=softcap)
    kc = torch.randn(nb, bs, hkv, d, dtype=torch.float64)
    vc = torch.randn(nb, bs, hkv, d, dtype=torch.float64)
    sinks = torch.randn(hq, dtype=torch.float64) if use_sinks else None
    # Many decodes (several with equal key counts, so they form groups) plus prefill chunks.
    q_lens = [1] * 12 + [rng.randint(2, 40) for _ in range(3)]
    seq_lens = [rng.choice([100, 100, 130, 7]) if n == 1 else rng.randint(n, 150) for n in q_lens]
    # A whole prompt from position 0 (plain causal) and a long chunk continuing a context, both
    # longer than the 48-token window (its rows go in window-sized blocks).
    fresh, cont = rng.randint(60, 150), rng.randint(60, 100)
    q_lens += [fresh, cont]
    seq_lens += [fresh, cont + rng.randint(1, 50)]
    free = list(range(1, nb))
    rng.shuffle(free)
    width = max(-(-L // bs) for L in seq_lens)
    table = torch.zeros(len(q_lens), width, dtype=torch.int32)
    for i, L in enumerate(seq_lens):
        for j in range(-(-L // bs)):
            table[i, j] = free.pop()
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    q = torch.randn(cu[-1], hq, d, dtype=torch.float64)
    meta = AttentionMetadata(torch.tensor(cu, dtype=torch.int32), torch.tensor(seq_lens, dtype=torch.int32),
                             table, torch.zeros(cu[-1], dtype=torch.int64), max(q_lens), max(seq_lens),
                             cu, seq_lens)
    out = paged_attention_ref(q, kc, vc, meta, p, sinks)
    for i, (n, L) in enumerate(zip(q_lens, seq_lens)):
        blocks = table[i, :-(-L // bs)].long()
        k, v = kc[blocks].flatten(0, 1)[:L], vc[blocks].flatten(0, 1)[:L]
        ref = _dense(q[cu[i]:cu[i + 1]], k, v, L - n, p, sinks)
        # Every path computes in float64 for float64 inputs (SDPA, and the maths path's
        # promote_types), so the only differences are summation orders.
        torch.testing.assert_close(out[cu[i]:cu[i + 1]], ref, rtol=1e-9, atol=1e-9)


def test_write_kv_skips_negative_slots_and_caches_the_check_per_step() -> None:
    from flatserve.attention.torch_backend import write_kv
    from tests.attention.cases import make_case

    _, kc, vc, meta = make_case([5, 3], [9, 3], 4, 2, 16, 4, torch.float32, device="cpu")
    k, v = torch.randn(8, 2, 16), torch.randn(8, 2, 16)
    for skip in ([], [1, 6]):
        slots = meta.slot_mapping.clone()
        slots[skip] = -1
        meta.slot_mapping, meta.derived = slots, {}
        kc2, vc2 = kc.clone(), vc.clone()
        write_kv(k, v, kc2, vc2, slots, meta)
        assert meta.derived["slot_skips"] == bool(skip)
        want_k, want_v = kc.clone().view(-1, 2, 16), vc.clone().view(-1, 2, 16)
        keep = slots >= 0
        want_k[slots[keep]], want_v[slots[keep]] = k[keep], v[keep]
        assert torch.equal(kc2.view(-1, 2, 16), want_k) and torch.equal(vc2.view(-1, 2, 16), want_v)
        kc3, vc3 = kc.clone(), vc.clone()
        write_kv(k, v, kc3, vc3, slots)  # no metadata: checked on the spot, same result
        assert torch.equal(kc3, kc2) and torch.equal(vc3, vc2)
