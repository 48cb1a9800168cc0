"""The AVX2 bf16-weight linears (`cpu_gemm="avx2"`, flatserve/model/avx2.py): the packed and the
plain (tied LM head) kernels against a float64 reference element by element, for decode-sized
row counts (every micro-kernel height 1-6 and its remainders) and prompt-sized ones (several
96-row chunks), with and without bias, bf16 and fp32 activations, strided input; the packing's
round trip; and the engine's `--cpu-gemm avx2` against the torch linears."""
from __future__ import annotations

import pytest
import torch

from flatserve.model import avx2

needs_avx2 = pytest.mark.skipif(not avx2.available(torch.bfloat16),
                                reason="no AVX2 + FMA CPU or the AVX2 GEMM kernel did not build here")


def _check(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Error bound from the arithmetic: bf16 weights widen to fp32 exactly, each FMA rounds its
    sum once, so a K-term fp32 sum errs by at most gamma_K = K u / (1 - K u) (u = 2^-24) of the
    sum of |x_k w_k|; the bias joins in fp32 (one more rounding); bf16 output then rounds once
    more (half an ulp: 2^-8 relative)."""
    K = x.shape[-1]
    xd, wd = x.double(), w.double()
    ref = xd @ wd.t() + (0 if bias is None else bias.double())
    mag = xd.abs() @ wd.abs().t() + (0 if bias is None else bias.double().abs())
    u = 2.0 ** -24
    acc = (K + 1) * u / (1 - (K + 1) * u) * mag
    out = 2.0 ** -8 if got.dtype == torch.bfloat16 else u
    assert ((got.double() - ref).abs() <= (ref.abs() + acc) * out + acc).all()


@needs_avx2
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 5, 6, 7, 16, 17, 100, 250])
@pytest.mark.parametrize("plain", [False, True])
def test_avx2_linear_matches_float64_reference(rows: int, plain: bool) -> None:
    g = torch.Generator().manual_seed(rows * 2 + plain)
    N = 16 * int(torch.randint(1, 40, (1,), generator=g))
    K = int(torch.randint(1, 700, (1,), generator=g))  # any K: the plain kernel's 8-wide tail too
    w = (torch.randn(N, K, generator=g) * torch.rand(N, 1, generator=g) * 3).bfloat16()
    bias = torch.randn(N, generator=g).bfloat16() if rows % 2 else None
    wide = torch.randn(2, rows, K + 32, generator=g).bfloat16()
    x = wide[..., 16:16 + K]  # strided rows: the layer must not assume contiguity
    got = avx2.AVX2Linear(w, bias, plain=plain)(x)
    assert got.shape == (2, rows, N) and got.dtype == torch.bfloat16
    _check(got.reshape(-1, N), x.reshape(-1, K), w, bias)


@needs_avx2
def test_prompt_calls_of_other_shapes_in_turn_each_get_their_own_result() -> None:
    """Prompt-sized calls (>= 128 rows) reuse held buffers for W, x and the product (scratch in
    avx2_gemm_cpu.cpp): a larger call, then smaller ones of other shapes, then the first again,
    each against its own reference (a buffer sized or viewed from an earlier call fails here);
    the first inside inference mode, as an engine step runs (a buffer held as a tensor made there
    could not be written by the calls outside it)."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    # N, K, rows; 1,040 columns: two chunks of 512 and one of 16 (run_torch)
    shapes = [(1040, 300, 300), (48, 200, 130), (96, 64, 257), (1040, 300, 300)]
    layers = {}
    for N, K, rows in shapes:
        if (N, K) not in layers:
            w, b = torch.randn(N, K, generator=g).bfloat16(), torch.randn(N, generator=g).bfloat16()
            layers[N, K] = (w, b, avx2.AVX2Linear(w, b))
        w, b, layer = layers[N, K]
        x = torch.randn(rows, K, generator=g).bfloat16()
        with torch.inference_mode(len(layers) == 1 and rows == 300):
            got = layer(x)
        _check(got, x, w, b)


@needs_avx2
@pytest.mark.parametrize("plain", [False, True])
def test_avx2_linear_fp32_activations(plain: bool) -> None:
    g = torch.Generator().manual_seed(7)
    w = torch.randn(64, 2048, generator=g).bfloat16()
    x = torch.randn(9, 2048, generator=g)
    got = avx2.AVX2Linear(w, None, plain=plain)(x)
    assert got.dtype == torch.float32
    _check(got, x, w, None)


def test_pack_round_trip_and_lane_order() -> None:
    """Lane j of each k step holds columns j (low half) and j + 8 (high half)."""
    w = torch.arange(32 * 3, dtype=torch.float32).reshape(32, 3).bfloat16()
    p = avx2.pack(w)  # [2, 3, 16]
    assert p.shape == (2, 3, 16)
    assert torch.equal(p[1, 2, 2 * 5], w[16 + 5, 2]) and torch.equal(p[1, 2, 2 * 5 + 1], w[16 + 13, 2])
    assert torch.equal(avx2.unpack(p), w)


@needs_avx2
def test_tied_head_reads_the_embedding_in_place() -> None:
    from torch import nn

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = nn.Module()
            self.model.embed_tokens = nn.Embedding(64, 32, dtype=torch.bfloat16)
            self.proj = nn.Linear(32, 48, bias=True, dtype=torch.bfloat16)
            self.lm_head = nn.Linear(32, 64, bias=False, dtype=torch.bfloat16)
            self.lm_head.weight = self.model.embed_tokens.weight

    m = Tiny()
    assert avx2.pack_linears(m) == 0
    assert isinstance(m.proj, avx2.AVX2Linear) and not m.proj.plain
    assert m.lm_head.plain and m.lm_head.weight.data_ptr() == m.model.embed_tokens.weight.data_ptr()
    x = torch.randn(5, 32).bfloat16()
    _check(m.lm_head(x), x, m.model.embed_tokens.weight, None)


@needs_avx2
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("rows", [1, 16, 130])
def test_gated_epilogue_equals_gate_up_then_act_and_mul(act: str, rows: int, monkeypatch) -> None:
    """act(gate) * up in the GEMM's epilogue against the plain GEMM followed by the fused
    act_and_mul kernel (or torch's where that did not build): each rounds the same bf16 gate and
    up values; only the activation's own float maths may differ (FMA contraction), so at most
    one bf16 ulp of act, which act * up carries to at most 2 ulps of the output."""
    from flatserve.ops import cpu_ops

    g = torch.Generator().manual_seed(rows)
    inter, K = (528 if rows >= 128 else 96), 200  # 528: prompt calls widen 512 columns at a time
    w = (torch.randn(2 * inter, K, generator=g) / 8).bfloat16()
    x = torch.randn(rows, K, generator=g).bfloat16()
    plain = avx2.AVX2Linear(w, None)(x)  # [rows, 2I]
    if cpu_ops.available():
        # The fused op at the epilogue's own level: on an AVX-512 host its tanh differs by more.
        monkeypatch.setenv("FLATSERVE_CPU_ISA", "avx2")
        ref = cpu_ops.act_and_mul(plain, act)
    else:
        a, u = plain[:, :inter].float(), plain[:, inter:].float()
        f = torch.nn.functional
        ref = ((f.silu(a) if act == "silu" else f.gelu(a, approximate="tanh")).bfloat16().float() * u).bfloat16()
    lin = avx2.AVX2Linear(w, None)
    assert lin.make_gated(act) and lin.out_features == inter
    got = lin(x)
    assert got.shape == (rows, inter)
    ulp = 2.0 ** (torch.floor(torch.log2(ref.float().abs().clamp_min(1e-30))) - 7)
    assert ((got.float() - ref.float()).abs() <= 2 * ulp).all()
    assert (got == ref).float().mean() > 0.99
