"""The AMX bf16 linears (`cpu_gemm="amx"`, flatserve/model/amx.py): the layer against a float64
reference element by element for every row-count path (1 x 4 tiles up to 32 rows, 2 x 2 above,
partial 16-row blocks), bias, strided input, and the packing's fallback to oneDNN."""
from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from flatserve.model import amx, onednn

needs_amx = pytest.mark.usefixtures("amx_kernel")  # the amx level; skips where the CPU has none


@needs_amx
@pytest.mark.parametrize("rows", [0, 1, 4, 8, 9, 16, 17, 32, 150])  # the kernel sees 2 x rows
def test_amx_linear_matches_float64_reference(rows: int) -> None:
    N = 64 * random.randint(1, 24)
    K = 32 * random.choice([1, 3, 20, 64])
    w = (torch.randn(N, K) * torch.rand(N, 1) * 3).bfloat16()
    bias = torch.randn(N).bfloat16() if rows % 2 else None  # both kernels, with and without
    wide = torch.randn(2, rows, K + 32).bfloat16()
    x = wide[..., 16:16 + K]  # [2, rows, K], rows strided: the kernel must not assume contiguity
    got = amx.AMXLinear(w, bias)(x)
    assert got.shape == (2, rows, N) and got.dtype == torch.bfloat16
    if rows == 0:
        return
    ref = x.double() @ w.double().t() + (0 if bias is None else bias.double())
    # One bf16 rounding of an fp32 sum: at most half a bf16 ulp (2^-8 relative) plus fp32
    # accumulation error, far below it at these K.
    slack = (x.double().abs() @ w.double().abs().t()) * 1e-5
    assert ((got.double() - ref).abs() <= ref.abs() * 2.0 ** -8 + slack).all()
    plain = nn.functional.linear(x, w, bias).double()
    assert (got.double() - ref).norm() <= 1.5 * (plain - ref).norm() + 1e-6


@needs_amx
@pytest.mark.parametrize("rows,groups", [(40, 7), (150, 7), (24, 5)])
def test_amx_linear_column_blocks_and_row_slabs(rows: int, groups: int) -> None:
    """K = 2,048 puts 3 column groups in each ~768 KB weight block, so 7 groups split into
    blocks with a remainder on each thread; 80 and 300 rows run in slabs of one row pair with
    a partial last block, 48 rows in one slab of 4 blocks (2 x 2 path, kernel sees 2 x rows)."""
    N, K = 64 * groups, 2048
    w = torch.randn(N, K).bfloat16()
    x = torch.randn(2, rows, K).bfloat16()
    got = amx.AMXLinear(w, None)(x).double()
    ref = x.double() @ w.double().t()
    slack = (x.double().abs() @ w.double().abs().t()) * 1e-5
    assert ((got - ref).abs() <= ref.abs() * 2.0 ** -8 + slack).all()


@needs_amx
@pytest.mark.parametrize("act", [0, 2])
def test_row_split_gives_the_column_split_bits(act: int) -> None:
    """From 512 rows a thread each thread takes whole rows instead of whole column groups; every
    output still sums the same tile products in the same order, so the bits must equal those of
    the same rows sent in column-split calls of at most 64 rows (2 threads, 1,100 rows: a
    partial last pair)."""
    N, K = 64 * 5, 640
    lin = amx.AMXLinear(torch.randn(N, K).bfloat16(), None)
    if act:
        assert lin.make_gated("gelu_pytorch_tanh")
    x = torch.randn(1100, K).bfloat16()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got = lin(x)
        want = torch.cat([lin(x[i:i + 64]) for i in range(0, x.shape[0], 64)])
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(got, want)


@needs_amx
@pytest.mark.parametrize("rows", [1, 5, 16, 17, 32, 33, 70])
def test_plain_kernel_matches_the_packed_one(rows: int) -> None:
    """The plain-layout kernel (a tied LM head reads the embedding rows in place) against the
    packed kernel, bit for bit (same tile products in the same order, one rounding), and the
    float64 bound; 1 x 4 tiles up to 16 rows, 2 x 2 over 32-token pairs above, bias on odd rows."""
    N = 64 * random.randint(1, 40)
    K = 32 * random.choice([1, 5, 20, 32, 64])
    w = (torch.randn(N, K) * 2).bfloat16()
    bias = torch.randn(N).bfloat16() if rows % 2 else None
    x = torch.randn(rows, K).bfloat16()
    plain = amx.AMXLinear(w, bias, plain=True)
    assert plain.weight.data_ptr() == w.data_ptr()  # no copy
    got = plain(x)
    assert torch.equal(got, amx.AMXLinear(w, bias)(x))
    ref = x.double() @ w.double().t() + (0 if bias is None else bias.double())
    slack = (x.double().abs() @ w.double().abs().t()) * 1e-5
    assert ((got.double() - ref).abs() <= ref.abs() * 2.0 ** -8 + slack).all()


@needs_amx
def test_amx_pack_falls_back_to_onednn_and_shares_a_tied_head() -> None:
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = nn.Module()
            self.model.embed_tokens = nn.Embedding(1024, 64, dtype=torch.bfloat16)
            self.model.proj = nn.Linear(64, 128, dtype=torch.bfloat16)
            self.model.odd = nn.Linear(64, 100, dtype=torch.bfloat16)  # 100 % 64 != 0
            self.lm_head = nn.Linear(64, 1024, bias=False, dtype=torch.bfloat16)
            self.lm_head.weight = self.model.embed_tokens.weight

    m = M()
    x = torch.randn(3, 64).bfloat16()
    before = [m.model.proj(x), m.model.odd(x), m.lm_head(x)]
    assert amx.pack_linears(m) == 0  # the tied head reads the embedding's rows: no copy
    assert isinstance(m.lm_head, amx.AMXLinear) and isinstance(m.model.proj, amx.AMXLinear)
    assert m.lm_head.plain and not m.model.proj.plain
    assert m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr()
    assert isinstance(m.model.odd, onednn.OneDNNLinear)
    assert m.model.embed_tokens.weight.shape == (1024, 64)  # the lookup keeps its plain rows
    for a, b in zip(before, [m.model.proj(x), m.model.odd(x), m.lm_head(x)]):
        torch.testing.assert_close(b, a, atol=0.02, rtol=0.02)


@needs_amx
@pytest.mark.parametrize("rows", [1, 7, 16, 17, 32, 33, 100, 1100])  # 1100: rows split (2 threads)
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
def test_gated_gemm_equals_linear_then_act_and_mul(rows: int, act: str) -> None:
    """A gate_up projection with the activation in its epilogue gives the bits of the packed
    linear followed by the fused act_and_mul (same roundings), on fresh random weights; a
    linear with a bias or an activation the epilogue lacks is not taken."""
    from flatserve.ops import cpu_ops

    if not cpu_ops.available():
        pytest.skip(f"fused C++ ops did not build: {cpu_ops.module.error}")
    i = 32 * random.randint(1, 40)
    K = 32 * random.choice([1, 5, 20, 64])
    w = (torch.randn(2 * i, K) * torch.rand(2 * i, 1) * 2).bfloat16()
    x = torch.randn(rows, K).bfloat16() * 2
    lin = amx.AMXLinear(w, None)
    want = cpu_ops.act_and_mul(lin(x), act)  # [rows, i]
    assert lin.make_gated(act) and lin.out_features == i
    got = lin(x)
    assert got.shape == (rows, i) and torch.equal(got, want)
    assert not lin.make_gated(act)  # once only
    assert not amx.AMXLinear(w, torch.randn(2 * i).bfloat16()).make_gated(act)
    assert not amx.AMXLinear(torch.randn(64, K).bfloat16(), None).make_gated("relu")
