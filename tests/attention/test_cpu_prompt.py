"""The row-invariant C++ prompt kernel (csrc/paged_prompt_cpu.cpp), at every ISA level this CPU
runs, on fresh random inputs.

Parity: against the float64 torch reference; fp32 computes in fp32 throughout (1e-5 relative),
bf16/fp16 differ by the output's one rounding (1e-2). Invariance: a row's output bits do not
depend on which other rows share the call (the rest of its prompt, a chunk boundary, a
prefix-cache tail, other sequences).
"""
from __future__ import annotations

import random

import pytest
import torch

from flatserve.attention import cpu_backend
from flatserve.attention.base import LayerAttnParams
from flatserve.attention.metadata import AttentionMetadata
from flatserve.attention.torch_backend import paged_attention_ref
from tests.attention.cases import make_case, rel_err
from tests.conftest import require_kernel


@pytest.fixture(autouse=True)
def _at_every_level(cpu_isa: str) -> None:
    require_kernel(cpu_backend.prompt_kernel)


def _check(q_lens: list[int], seq_lens: list[int], hq: int = 8, hkv: int = 2, d: int = 64,
           bs: int = 16, dtype: torch.dtype = torch.float32, window: int | None = None,
           softcap: float | None = None, sinks: bool = False) -> None:
    q, kc, vc, meta = make_case(q_lens, seq_lens, hq, hkv, d, bs, dtype, device="cpu")
    p = LayerAttnParams(d ** -0.5, window, softcap)
    sk = torch.randn(hq) if sinks else None
    out = cpu_backend.paged_prompt(q, kc, vc, meta.block_table, meta.seq_lens, meta.cu_seqlens_q, p, sk)
    ref = paged_attention_ref(q.double(), kc.double(), vc.double(), meta, p, sk)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    err = rel_err(out, ref)
    assert out.dtype == dtype and err < tol, f"rel err {err:.2e} >= {tol}"


def _ragged(n: int, max_rows: int, max_past: int) -> tuple[list[int], list[int]]:
    q = [random.randint(1, max_rows) for _ in range(n)]
    return q, [r + random.randint(0, max_past) for r in q]


@pytest.mark.parametrize("n,max_rows,max_past", [(1, 1, 0), (1, 700, 0), (6, 90, 400), (3, 40, 3000)])
def test_ragged_prompts_and_chunks(n: int, max_rows: int, max_past: int) -> None:
    _check(*_ragged(n, max_rows, max_past))


@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 1), (32, 4), (6, 2), (28, 4), (40, 1)])
def test_gqa_ratios(hq: int, hkv: int) -> None:
    _check(*_ragged(4, 50, 200), hq=hq, hkv=hkv)


@pytest.mark.parametrize("window", [1, 16, 100, 5000])
def test_sliding_window(window: int) -> None:
    _check(*_ragged(5, 300, 600), window=window)


def test_softcap_and_sinks() -> None:
    _check(*_ragged(4, 80, 300), softcap=30.0)
    _check(*_ragged(4, 80, 300), sinks=True, window=64)


@pytest.mark.parametrize("d,bs,dtype", [(64, 16, torch.bfloat16), (128, 32, torch.float32),
                                        (256, 16, torch.bfloat16), (96, 16, torch.float16),
                                        (80, 16, torch.bfloat16), (48, 64, torch.float32)])
def test_head_sizes_block_sizes_dtypes(d: int, bs: int, dtype: torch.dtype) -> None:
    _check(*_ragged(4, 70, 500), d=d, bs=bs, dtype=dtype)


def _rows(L: int, a: int, b: int, q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor,
          table: torch.Tensor, p: LayerAttnParams, sinks: torch.Tensor | None,
          extra: list[tuple[torch.Tensor, int, torch.Tensor]]) -> torch.Tensor:
    """Rows a..b-1 of a prompt of length L (context: keys 0..b-1), called beside `extra`
    sequences (q rows, seq_len, table row) -> those rows' output."""
    qs = [q[a:b]] + [e[0] for e in extra]
    cu = [0]
    for x in qs:
        cu.append(cu[-1] + x.shape[0])
    tables = [table] + [e[2] for e in extra]
    width = max(t.numel() for t in tables)
    bt = torch.zeros(len(tables), width, dtype=torch.int32)
    for i, t in enumerate(tables):
        bt[i, :t.numel()] = t
    lens = torch.tensor([b] + [e[1] for e in extra], dtype=torch.int32)
    out = cpu_backend.paged_prompt(torch.cat(qs), kc, vc, bt, lens, torch.tensor(cu, dtype=torch.int32),
                                   p, sinks)
    return out[:b - a]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("window,softcap,sinks", [(None, None, False), (40, None, False), (None, 20.0, True)])
def test_a_row_has_the_same_bits_however_its_prompt_is_split(dtype, window, softcap, sinks) -> None:
    """Whole prompt, chunks, prefix-cache tails of 1..16 rows, with and without other sequences
    in the call: every row equal to the whole prompt's, bit for bit."""
    hq, hkv, d = 4, 1, 64
    L = random.randint(40, 300)
    q, kc, vc, meta = make_case([L], [L], hq, hkv, d, 16, dtype, device="cpu")
    table = meta.block_table[0]
    p = LayerAttnParams(d ** -0.5, window, softcap)
    sk = torch.randn(hq) if sinks else None
    whole = _rows(L, 0, L, q, kc, vc, table, p, sk, [])
    others = []  # sequences that share the cache (their blocks are the prompt's: same keys)
    for _ in range(3):
        n = random.randint(1, 40)
        others.append((torch.randn(n, hq, d).to(dtype), random.randint(n, L), table))
    for _ in range(12):
        b = random.randint(1, L)
        a = random.choice([max(0, b - random.randint(1, 16)), random.randint(0, b - 1)])
        extra = random.sample(others, random.randint(0, 3))
        got = _rows(L, a, b, q, kc, vc, table, p, sk, extra)
        assert torch.equal(got, whole[a:b]), f"rows {a}..{b} of {L} beside {len(extra)} others"


def test_backend_sends_prompt_tails_to_the_prompt_kernel() -> None:
    """A prompt tail of a few rows (a prefix-cache hit) beside a decode: the backend's prompt
    rows equal the whole prompt's bits, and the decode row the decode kernel's."""
    hq, hkv, d, L, tail = 4, 1, 64, 37, 5
    q, kc, vc, meta = make_case([L, 1], [L, 90], hq, hkv, d, 16, torch.bfloat16, device="cpu")
    p = LayerAttnParams(d ** -0.5)
    be = cpu_backend.CpuAttentionBackend()
    # The whole prompt through the backend too: on AMX machines its prompt rows take the AMX
    # prefill kernel (bf16, head 64), elsewhere the prompt kernel; the tail must match either.
    none = torch.empty(0, hkv, d, dtype=q.dtype)
    whole = be.forward(q[:L], none, none, kc, vc, AttentionMetadata(
        cu_seqlens_q=torch.tensor([0, L], dtype=torch.int32), seq_lens=meta.seq_lens[:1],
        block_table=meta.block_table[:1], slot_mapping=torch.zeros(0, dtype=torch.int64),
        max_q_len=L, max_seq_len=L, cu_seqlens_q_host=[0, L], seq_lens_host=[L],
        prompt_lens_host=[L]), p)

    def step(q_rows: torch.Tensor, q_lens: list[int], prompt_lens: list[int]) -> torch.Tensor:
        cu = [0, q_lens[0], q_lens[0] + q_lens[1]]
        m = AttentionMetadata(
            cu_seqlens_q=torch.tensor(cu, dtype=torch.int32), seq_lens=meta.seq_lens,
            block_table=meta.block_table, slot_mapping=torch.zeros(0, dtype=torch.int64),  # K/V already in
            max_q_len=max(q_lens), max_seq_len=90, cu_seqlens_q_host=cu, seq_lens_host=[L, 90],
            prompt_lens_host=prompt_lens)
        return be.forward(q_rows, none, none, kc, vc, m, p)

    out = step(torch.cat([q[L - tail:L], q[L:]]), [tail, 1], [L, 50])
    assert torch.equal(out[:tail], whole[L - tail:])
    dec = cpu_backend.paged_decode(q[L:], kc, vc, meta.block_table[1:], meta.seq_lens[1:], p)
    assert torch.equal(out[tail:], dec)
    m = AttentionMetadata(
        cu_seqlens_q=torch.tensor([0, tail, tail + 1], dtype=torch.int32), seq_lens=meta.seq_lens,
        block_table=meta.block_table, slot_mapping=torch.zeros(0, dtype=torch.int64),
        max_q_len=tail, max_seq_len=90, cu_seqlens_q_host=[0, tail, tail + 1],
        seq_lens_host=[L, 90], prompt_lens_host=[L, 50])
    assert not cpu_backend.decode_only(m)  # the C++ decoder stack leaves this step to Python
    m.prompt_lens_host, m.derived = [L - tail, 50], {}  # the same rows as a verify run: decode
    assert cpu_backend.decode_only(m)
