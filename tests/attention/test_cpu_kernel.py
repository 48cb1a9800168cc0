"""The C++ CPU decode kernel (read KV in place) against the torch backend, on fresh random inputs.

The kernel computes in fp32 like the reference's decode path, so fp32 agrees to 1e-5 relative;
bf16/fp16 differ by the output's one rounding (within 1e-2 relative)."""
from __future__ import annotations

import random

import pytest
import torch

from flatserve.attention import cpu_backend
from flatserve.attention.base import LayerAttnParams
from flatserve.attention.torch_backend import TorchAttentionBackend, paged_attention_ref
from tests.attention.cases import make_case, rel_err
from tests.conftest import require_kernel



@pytest.fixture(autouse=True)
def _at_every_level(cpu_isa: str) -> None:
    """Every test at every ISA level this CPU runs (conftest.cpu_isa), its build required."""
    require_kernel(cpu_backend.kernel)


def _ragged(n: int, lo: int, hi: int) -> list[int]:
    return [random.randint(lo, hi) for _ in range(n)]


def check_decode(seq_lens: list[int], hq: int = 8, hkv: int = 2, d: int = 64, bs: int = 16,
                 dtype: torch.dtype = torch.float32, window: int | None = None,
                 softcap: float | None = None, sinks: bool = False) -> None:
    q, kc, vc, meta = make_case([1] * len(seq_lens), seq_lens, hq, hkv, d, bs, dtype, device="cpu")
    p = LayerAttnParams(d ** -0.5, window, softcap)
    sk = torch.randn(hq) if sinks else None
    out = cpu_backend.paged_decode(q, kc, vc, meta.block_table, meta.seq_lens, p, sk)
    ref = paged_attention_ref(q.float(), kc.float(), vc.float(), meta, p, sk)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    err = rel_err(out, ref)
    assert out.dtype == dtype and err < tol, f"rel err {err:.2e} >= {tol}"


@pytest.mark.parametrize("num_seqs,max_ctx", [(1, 1), (1, 5000), (9, 700), (64, 300)])
def test_decode_ragged(num_seqs: int, max_ctx: int) -> None:
    check_decode(_ragged(num_seqs, 1, max_ctx))


@pytest.mark.parametrize("hq,hkv", [(4, 4), (8, 2), (32, 4), (16, 2), (4, 1), (16, 8), (6, 2), (28, 4)])
def test_gqa_ratios_and_mqa(hq: int, hkv: int) -> None:
    check_decode(_ragged(6, 1, 900), hq=hq, hkv=hkv)


@pytest.mark.parametrize("window", [1, 16, 100, 5000])
def test_sliding_window(window: int) -> None:
    check_decode(_ragged(8, 1, 1500), window=window)


def test_softcap_and_sinks() -> None:
    check_decode(_ragged(5, 1, 800), softcap=30.0)
    check_decode(_ragged(5, 1, 800), sinks=True, window=200)


@pytest.mark.parametrize("d,bs,dtype", [(64, 16, torch.bfloat16), (128, 32, torch.float32),
                                        (256, 16, torch.bfloat16), (128, 16, torch.float16),
                                        (48, 16, torch.bfloat16)])  # 48: not 32-wide bf16 pairs
def test_head_sizes_block_sizes_dtypes(d: int, bs: int, dtype: torch.dtype) -> None:
    check_decode(_ragged(7, 1, 1200), d=d, bs=bs, dtype=dtype)


# bf16 decodes with g <= 8 query heads per KV head take the AMX scores (two 16-key blocks per
# call, odd block counts and windows that start mid-pair included); g = 16 keeps the AVX512-BF16
# dot products. Head 256 is Gemma's; 64 a smaller one.
@pytest.mark.parametrize("hq,hkv,d,window,softcap,sinks", [
    (4, 1, 256, None, None, False), (4, 1, 256, 100, None, True), (8, 1, 64, 37, 30.0, False),
    (16, 2, 128, 512, None, False), (32, 2, 64, 300, None, True)])
def test_bf16_decode_scores_paths(hq: int, hkv: int, d: int, window: int | None,
                                  softcap: float | None, sinks: bool) -> None:
    check_decode(_ragged(9, 1, 1500), hq=hq, hkv=hkv, d=d, dtype=torch.bfloat16, window=window,
                 softcap=softcap, sinks=sinks)


MAX_ROWS = cpu_backend.MAX_KERNEL_ROWS


@pytest.mark.parametrize("hq,hkv,d,dtype,window,softcap,sinks", [
    (8, 2, 64, torch.float32, None, None, False),
    (6, 1, 64, torch.float32, 20, None, True),  # head chunks of 4 + 2; window inside the run
    (8, 2, 64, torch.float32, 4, None, False),  # a window shorter than the run itself
    (4, 1, 256, torch.bfloat16, 100, None, False),  # Gemma's local layers
    (16, 8, 128, torch.bfloat16, None, 30.0, True),
])
def test_runs_of_rows(hq: int, hkv: int, d: int, dtype: torch.dtype, window: int | None,
                      softcap: float | None, sinks: bool) -> None:
    """Runs of 1..MAX_KERNEL_ROWS rows per sequence (draft-verify), each row causal over its
    sequence's keys up to its own position, against the torch reference."""
    q_lens = [random.randint(1, MAX_ROWS) for _ in range(7)] + [1, MAX_ROWS]
    seq_lens = [random.randint(n, 900) for n in q_lens]
    q, kc, vc, meta = make_case(q_lens, seq_lens, hq, hkv, d, 16, dtype, device="cpu")
    p = LayerAttnParams(d ** -0.5, window, softcap)
    sk = torch.randn(hq) if sinks else None
    out = cpu_backend.paged_decode(q, kc, vc, meta.block_table, meta.seq_lens, p, sk, meta.cu_seqlens_q)
    ref = paged_attention_ref(q.float(), kc.float(), vc.float(), meta, p, sk)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    err = rel_err(out, ref)
    assert out.dtype == dtype and err < tol, f"rel err {err:.2e} >= {tol}"


@pytest.mark.parametrize("hq,hkv,dtype,window", [
    (2, 2, torch.float32, None),  # g = 1: runs packed 8 rows to a pass
    (4, 2, torch.float32, None),  # g = 2 (Phi-3, Qwen3-0.6B's ratio)
    (4, 2, torch.bfloat16, 24),
    (8, 2, torch.float32, None),  # g = 4 (Gemma 3 270M's ratio)
    (8, 2, torch.bfloat16, None),
    (6, 2, torch.float32, 30),  # g = 3: never packed
])
def test_a_verify_row_has_the_bits_of_the_same_row_decoded_alone(hq: int, hkv: int,
                                                                 dtype: torch.dtype, window) -> None:
    """Greedy output with draft verification equals greedy output without it only if a run's
    row r gives the bits of the decode at its position: rows packed together (8 / g to a pass)
    and rows alone must sum in one order. At 2,3 rows per run the packing changes with the run
    length and how the block's keys split between rows."""
    d = 48
    p = LayerAttnParams(d ** -0.5, window, None)
    for _ in range(6):
        q_lens = [random.randint(2, MAX_ROWS) for _ in range(3)]
        seq_lens = [random.randint(n, 300) for n in q_lens]
        q, kc, vc, meta = make_case(q_lens, seq_lens, hq, hkv, d, 16, dtype, device="cpu")
        runs = cpu_backend.paged_decode(q, kc, vc, meta.block_table, meta.seq_lens, p, None,
                                        meta.cu_seqlens_q)
        for s, (n, L) in enumerate(zip(q_lens, seq_lens)):
            first = meta.cu_seqlens_q_host[s]
            for r in range(n):  # row r alone: a decode at position L - n + r
                one = cpu_backend.paged_decode(
                    q[first + r:first + r + 1], kc, vc, meta.block_table[s:s + 1],
                    torch.tensor([L - n + r + 1], dtype=torch.int32), p, None)
                assert torch.equal(one, runs[first + r:first + r + 1]), \
                    f"row {r} of a {n}-row run at length {L} differs from its decode"


@pytest.mark.parametrize("block_size,g", [(16, 4), (32, 4), (32, 8), (16, 2)])
def test_verify_runs_bf16_amx_scores(block_size: int, g: int) -> None:
    """bf16 verify runs of 2..16 / g rows, whose scores go through AMX tiles where the CPU has
    them (n x g <= 16 query vectors, 16-key tiles of a block), against the float64 reference;
    a whole-tile block and a two-tile block, 16 and 8 vectors."""
    q_lens = [16 // g] * 5 + [2, 16 // g, 1]
    seq_lens = [random.randint(n, 700) for n in q_lens]
    q, kc, vc, meta = make_case(q_lens, seq_lens, g * 2, 2, 256, block_size, torch.bfloat16,
                                device="cpu")
    p = LayerAttnParams(256 ** -0.5, None, None)
    out = cpu_backend.paged_decode(q, kc, vc, meta.block_table, meta.seq_lens, p, None, meta.cu_seqlens_q)
    ref = paged_attention_ref(q.double(), kc.double(), vc.double(), meta, p, None)
    err = rel_err(out, ref)
    assert err < 1e-2, f"rel err {err:.2e}"


def test_runs_bad_metadata_is_a_clear_error() -> None:
    q, kc, vc, meta = make_case([3, 2], [10, 5], 4, 1, 64, 16, torch.float32, device="cpu")
    p = LayerAttnParams(0.125)
    with pytest.raises(RuntimeError, match="span"):
        cpu_backend.paged_decode(q, kc, vc, meta.block_table, meta.seq_lens, p, None,
                                 torch.tensor([0, 3, 4], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="1..seq_len rows"):
        cpu_backend.paged_decode(q, kc, vc, meta.block_table, torch.tensor([10, 1], dtype=torch.int32),
                                 p, None, meta.cu_seqlens_q)


@pytest.mark.parametrize("q_lens", [
    [1, 37, 1, 1, 4, 1, 120],  # decodes, a verify run, prefill chunks
    [4, 4, 1, 2, 4, 8, 4],  # verify runs and decodes only: every row through the kernel
    [MAX_ROWS, MAX_ROWS + 1, 1],  # either side of the kernel's row limit
])
@pytest.mark.parametrize("window,d", [(None, 64), (64, 64), (None, 40)])  # 40: not 16-lane slices
def test_backend_mixed_batch_equals_torch_backend(q_lens: list[int], window: int | None, d: int) -> None:
    """Decodes, prefill chunks and verify runs in one call: rows of sequences with at most
    MAX_KERNEL_ROWS new tokens go to the kernel, each at its own position, the torch loop takes
    the rest, and the KV write happens once, as in the torch backend. A head size the kernel
    cannot slice goes wholly to the torch loop."""
    seq_lens = [random.randint(n, 600) for n in q_lens]
    q, kc, vc, meta = make_case(q_lens, seq_lens, 8, 2, d, 16, torch.float32, device="cpu")
    k, v = torch.randn(q.shape[0], 2, d), torch.randn(q.shape[0], 2, d)
    p = LayerAttnParams(d ** -0.5, window)
    kc2, vc2 = kc.clone(), vc.clone()
    out = cpu_backend.CpuAttentionBackend().forward(q, k, v, kc, vc, meta, p)
    ref = TorchAttentionBackend().forward(q, k, v, kc2, vc2, meta, p)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype,T", [(torch.bfloat16, 16), (torch.float32, 700)])
def test_write_kv_matches_torch(dtype: torch.dtype, T: int) -> None:
    """The one-call K/V write equals the torch reference's on the views the model passes (K and
    V as strided slices of one qkv output), with skipped (< 0) slots, into pools with earlier
    contents; an out-of-range slot is an error, not a stray write."""
    from flatserve.attention.torch_backend import write_kv

    hkv, d, nb, bs = 2, 64, 64, 16
    qkv = torch.randn(T, (4 + 2 * hkv) * d).to(dtype)
    k = qkv[:, 4 * d:(4 + hkv) * d].view(T, hkv, d)
    v = qkv[:, (4 + hkv) * d:].view(T, hkv, d)
    slots = torch.randperm(nb * bs)[:T]
    slots[torch.rand(T) < 0.2] = -1
    pools = [torch.randn(nb, bs, hkv, d).to(dtype) for _ in range(2)]
    kc, vc = pools[0].clone(), pools[1].clone()
    cpu_backend.kernel().write_kv(k, v, kc, vc, slots)
    kr, vr = pools[0].clone(), pools[1].clone()
    write_kv(k, v, kr, vr, slots)
    assert torch.equal(kc, kr) and torch.equal(vc, vr)
    assert not torch.equal(kc, pools[0])  # something was written
    bad = slots.clone()
    bad[0] = nb * bs
    with pytest.raises(RuntimeError, match="slot out of range"):
        cpu_backend.kernel().write_kv(k, v, kc, vc, bad)
    assert torch.equal(kc, kr)  # checked before any write


def test_decode_writes_only_its_sequences() -> None:
    from tests.attention.test_cpu_prefill import check_writes_only_their_sequences

    check_writes_only_their_sequences("decode")
