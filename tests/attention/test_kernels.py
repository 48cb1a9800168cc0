"""Triton kernels against the torch backend (the reference), on fresh random inputs. CUDA only."""
from __future__ import annotations

import random

import pytest
import torch

from flatserve.attention.base import LayerAttnParams
from flatserve.attention.torch_backend import paged_attention_ref, write_kv
from tests.attention.cases import make_case, rel_err

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="Triton kernels need CUDA")


def check(q_lens, seq_lens, hq=32, hkv=8, d=128, bs=16, dtype=torch.float32, window=None,
          softcap=None, sinks=False, segments=None, use_map=False) -> float:
    from flatserve.attention.kernels.unified_attention import build_seq_map, tile_config, unified_attention

    q, kc, vc, meta = make_case(q_lens, seq_lens, hq, hkv, d, bs, dtype)
    p = LayerAttnParams(d ** -0.5, window, softcap)
    sk = torch.randn(hq, device="cuda") if sinks else None
    out = torch.full_like(q, float("nan"))  # poisoned: every element must be written
    seq_map = None
    if use_map:
        bq = tile_config(meta, hq // hkv, d)[0] // (hq // hkv)
        seq_map = torch.tensor(build_seq_map(meta, bq), dtype=torch.int32, device="cuda")
    unified_attention(q, kc, vc, meta, p, sk, out=out, segments=segments, seq_map=seq_map)
    ref = paged_attention_ref(q.float(), kc.float(), vc.float(), meta, p, sk)
    err = rel_err(out, ref)
    tol = 1e-4 if dtype == torch.float32 else 1e-2
    assert err < tol, f"rel err {err:.2e} >= {tol}"
    return err


def _ragged(n: int, lo: int, hi: int) -> list[int]:
    return [random.randint(lo, hi) for _ in range(n)]


@pytest.mark.parametrize("num_seqs,max_ctx", [(1, 1), (1, 16384), (7, 3000), (64, 2048), (256, 700),
                                              (1024, 300)])
def test_decode(num_seqs: int, max_ctx: int) -> None:
    lens = _ragged(num_seqs, 1, max_ctx)
    check([1] * num_seqs, lens)


@pytest.mark.parametrize("segments", [2, 4, 16])
def test_decode_split_kv(segments: int) -> None:
    check([1] * 4, _ragged(4, 1, 9000), segments=segments)
    check([1] * 3, _ragged(3, 1, 9000), segments=segments, sinks=True, window=700)


def test_host_built_sequence_map() -> None:
    check([1] * 20 + [512, 77, 3], _ragged(20, 1, 2000) + [4096, 600, 3], use_map=True)
    check([1] * 64, _ragged(64, 1, 3000), use_map=True)


def test_prefill_and_chunks_and_mixed() -> None:
    check([300], [300])  # pure prefill
    check([1, 64, 65, 63, 127, 129], [1, 64, 65, 63, 127, 129])  # ragged tails around tiles
    check([200, 33], [1200, 500])  # chunks continuing a context
    check([1] * 20 + [512, 77], _ragged(20, 1, 2000) + [4096, 600])  # mixed


@pytest.mark.parametrize("k", range(1, 8))
def test_verify_runs(k: int) -> None:
    n = 12
    check([k + 1] * n, _ragged(n, k + 1, 3000))


@pytest.mark.parametrize("hq,hkv", [(8, 8), (16, 4), (32, 4), (64, 8), (8, 1)])
def test_gqa_ratios_and_mqa(hq: int, hkv: int) -> None:
    check([1] * 5 + [90], _ragged(5, 1, 1500) + [400], hq=hq, hkv=hkv)


@pytest.mark.parametrize("window", [16, 100, 5000])
def test_sliding_window(window: int) -> None:
    check([1] * 6 + [300, 40], _ragged(6, 1, 2500) + [300, 900], window=window)


def test_softcap_and_sinks() -> None:
    check([1] * 4 + [150], _ragged(4, 1, 800) + [700], softcap=30.0)
    check([1] * 4 + [150], _ragged(4, 1, 800) + [700], sinks=True)


def test_softcap_with_window() -> None:
    """Gemma 2's local layers: soft-capping and a window in one call."""
    check([1] * 4 + [150, 70], _ragged(4, 1, 800) + [700, 70], hq=8, hkv=4, d=256, softcap=2.0,
          window=64)


@pytest.mark.parametrize("d", [64, 80, 96, 128, 256])  # 80, 96: padded to 128 in the kernel
@pytest.mark.parametrize("bs", [16, 32])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_head_sizes_block_sizes_dtypes(d: int, bs: int, dtype: torch.dtype) -> None:
    check([1] * 8 + [130, 17], _ragged(8, 1, 1000) + [130, 300], hq=8, hkv=2, d=d, bs=bs, dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_store_kv_skips_negative_slots(dtype: torch.dtype) -> None:
    from flatserve.attention.kernels.store_kv import store_kv

    T, H, D, nb, bs = 300, 8, 128, 64, 16
    k = torch.randn(T, H, D, device="cuda").to(dtype)
    v = torch.randn(T, H, D, device="cuda").to(dtype)
    slots = torch.randperm(nb * bs, device="cuda")[:T]
    slots[::7] = -1
    kc, vc = torch.randn(nb, bs, H, D, device="cuda").to(dtype), torch.randn(nb, bs, H, D, device="cuda").to(dtype)
    kr, vr = kc.clone(), vc.clone()
    store_kv(k, v, kc, vc, slots)
    write_kv(k, v, kr, vr, slots)
    assert torch.equal(kc, kr) and torch.equal(vc, vr)
