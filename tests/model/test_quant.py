"""Quantized linears (flatserve/model/quant.py): the C++ kernel against the torch reference on
the same int16 activation codes (exact up to fp32 summation order), the reference against a float64
matmul of the dequantized weights, segments of mixed formats, the embedding lookup, and
`--quantization` through the engine."""
from __future__ import annotations

import random

import pytest
import torch

from flatserve import device as dev
from flatserve.model import quant
from flatserve.model.qformats import FORMATS, dequantize
from tests.model.test_qformats import random_blocks

needs_kernel = pytest.mark.skipif(quant.kernel() is None, reason="the C++ quant kernel did not build here")


def _lin(shards, k, seed, bias=False):
    lin = quant.QuantLinear(k, {s: (n, FORMATS[f]) for s, (n, f) in shards.items()}, bias)
    dense = []
    for i, (s, (n, f)) in enumerate(shards.items()):
        raw = random_blocks(FORMATS[f], n, k, seed + i)
        lin.load_quant(s, raw, FORMATS[f])
        dense.append(dequantize(raw, FORMATS[f], k))
    if bias:
        lin.bias.data.normal_()
    return lin, torch.cat(dense)  # fp32 [N, K]


def _act_dequant(x: torch.Tensor) -> torch.Tensor:
    """What the kernel computes with: x's int16 codes (stored in ACT_ORDER) times their scales."""
    q, d, _ = quant.kernel().quantize_act(x.contiguous())
    order = torch.tensor(quant.ACT_ORDER)  # its own inverse: stored position <-> value index
    codes = q.float().reshape(x.shape[0], -1, 32)[:, :, order]
    return (codes * d[:, :, None]).reshape(x.shape)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_activation_codes_match_torch_bit_for_bit(dtype) -> None:
    """quantize_act: per 32 values d = amax / 32639, codes round(x * (32639 / amax)) to nearest
    even, stored in ACT_ORDER, and s = d * sum(codes): torch's fp32 arithmetic bit for bit (an
    all-zero block has d = 0 and codes 0)."""
    rows, k = random.randint(1, 40), random.choice([64, 256, 640])
    x = (torch.randn(rows, k) * torch.rand(rows, 1) * 4).to(dtype)
    x[0, :32] = 0
    q, d, s = quant.kernel().quantize_act(x)
    assert q.dtype == torch.int16 and q.shape == (rows, k) and d.shape == s.shape == (rows, k // 32)
    blocks = x.float().reshape(rows, -1, 32)
    amax = blocks.abs().amax(-1)
    # a tensor over a tensor: torch computes a Python number over a tensor as number * (1 / t),
    # which rounds differently from the kernel's (and IEEE's) 32639 / amax
    inv = torch.where(amax > 0, torch.full_like(amax, 32639.0) / amax, torch.zeros_like(amax))
    codes = torch.round(blocks * inv[:, :, None])
    assert torch.equal(d, amax / torch.full_like(amax, 32639.0))
    assert torch.equal(q.reshape(rows, -1, 32)[:, :, list(quant.ACT_ORDER)].float(), codes)
    assert torch.equal(s, d * codes.sum(-1))


@needs_kernel
@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("rows", [1, 3, 16, quant.PROMPT_ROWS - 1])  # decode sizes, a tile remainder
def test_kernel_matches_reference_on_its_int16_activations(name, rows, quant_isa) -> None:
    """At every ISA level this CPU runs (the AVX2 build and the portable C++)."""
    rng = random.Random()
    k = rng.choice([256, 512, 1024])
    n = rng.choice([1, 17, 40])
    lin, w = _lin({"": (n, name)}, k, seed=rng.randrange(1 << 20))
    x = torch.randn(rows, k) * torch.rand(rows, 1) * 4
    got = lin(x).double()
    xa = _act_dequant(x).double()
    ref = xa @ w.double().t()
    # fp32 rounding: each product's share is rounded at most ~K/32 + 8 times (per-block integer
    # dots are exact; the block scales' products and the running sum round), so the error is
    # bounded by that many 2^-24 of sum |x w|, not by |ref|, which cancellation can make tiny
    # (the relative-to-max bound alone failed one draw of q6_k at one row and one column). The
    # K formats with a min sum d sc q x and dmin m x apart, terms that |w| does not bound: for
    # them the relative-to-max bound, which every draw so far met, still holds.
    err = (got - ref).abs()
    bound = (k / 32 + 8) * 2.0**-23 * (xa.abs() @ w.double().abs().t())
    assert ((err <= bound) | (err <= 1e-5 * ref.abs().max() + 1e-6)).all()
    # and the int16 codes stay close to the float activations: each is within half a step
    # (amax / 65534 <= |x| / 65534) of its value, so the error vector is at most sqrt(K) |x| / 65534
    # long and |error . w| at most that times |w| (Cauchy-Schwarz), plus fp32 summation
    full = x.double() @ w.double().t()
    scale = x.double().norm(dim=1)[:, None] * w.double().norm(dim=1)[None, :]
    assert ((got - full).abs() <= (k ** 0.5 / 65534 + 1e-5) * scale).all()


@needs_kernel
def test_zero_rows_and_the_packed_op() -> None:
    """No rows: an empty result, nothing read. The decoder stack's quant_linear on the packed
    linear (QuantLinear.pack) gives _int16's bits, bias added, and pack keeps one copy."""
    shards = {"q": (64, "q5_0"), "k": (32, "q5_0"), "v": (32, "q8_0")}
    lin, _ = _lin(shards, 256, seed=random.randrange(1 << 20), bias=True)
    assert lin(torch.randn(0, 256)).shape == (0, 128)
    x = torch.randn(3, 256)
    want = lin._bias(lin._int16(quant.kernel(), x))
    packed = lin.pack()
    assert all(q.untyped_storage().data_ptr() == packed.untyped_storage().data_ptr() for _, q in lin.segments())
    assert torch.equal(quant.kernel().quant_linear(x, packed, lin.bias.detach(), 0), want)
    assert torch.equal(lin._bias(lin._int16(quant.kernel(), x)), want)  # the views read the same bytes


@needs_kernel
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_prompt_rows_dequantize_in_cpp_with_the_references_bits(name, quant_isa) -> None:
    """From PROMPT_ROWS rows on: C++ dequantized slices (bit-equal to the torch reference, and in
    bf16 to its rounding, at every ISA level: AVX-512 has a vector loop) and the dense GEMM on
    float activations; below AVX-512 such calls take the int16 codes instead."""
    lin, w = _lin({"": (300, name)}, 512, seed=random.randrange(1 << 20))
    ext = quant.kernel()
    out = torch.empty(300, 512)
    ext.dequant(lin.qweight0, FORMATS[name].ggml_type, out)
    assert torch.equal(out, w)
    out16 = torch.empty(300, 512, dtype=torch.bfloat16)
    ext.dequant(lin.qweight0, FORMATS[name].ggml_type, out16)
    assert torch.equal(out16, w.bfloat16())
    x = torch.randn(quant.PROMPT_ROWS + 5, 512)
    ref = x.double() @ w.double().t()
    assert ((lin.reference(x, ext).double() - ref).norm() / ref.norm()).item() < 1e-6
    int16 = quant_isa in dev.AVX2_LEVELS
    assert quant.prompt_int16(ext) == int16
    assert torch.equal(lin(x), lin._int16(ext, x) if int16 else lin.reference(x, ext))


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mixed_segments_and_bias(dtype) -> None:
    """q|k|v stored as q5_0 | q5_0 | q8_0 (as in the default Q4_K_M file) plus q6_k rows: three
    segments, outputs in shard order, bias added."""
    shards = {"q": (64, "q5_0"), "k": (32, "q5_0"), "v": (32, "q8_0"), "o": (16, "q6_k")}
    lin, w = _lin(shards, 512, seed=11, bias=True)
    lin = lin.to(dtype)  # the bias; the blocks stay uint8
    assert len(lin.segments()) == 3
    x = torch.randn(5, 512).to(dtype)
    ref = _act_dequant(x.float()).double() @ w.double().t() + lin.bias.double()
    got = lin(x)
    assert got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert ((got.double() - ref).norm() / ref.norm()).item() < tol


def test_fused_parts_bias_rows_land_at_their_outputs() -> None:
    """A checkpoint's per-part biases (Qwen2's q|k|v beside block-format weights): load_shard
    puts each part's rows at its place in the output, across segments of different formats."""
    shards = {"q": (64, FORMATS["q5_0"]), "k": (32, FORMATS["q5_0"]), "v": (32, FORMATS["q8_0"]),
              "o": (16, FORMATS["q6_k"])}
    lin = quant.QuantLinear(512, shards, bias=True)
    parts = {n: torch.randn(r) for n, (r, _) in shards.items()}
    for n in random.sample(list(parts), len(parts)):  # any order, as a checkpoint stores them
        lin.load_shard(lin.bias, parts[n], n)
    assert torch.equal(lin.bias.data, torch.cat([parts[n] for n in shards]))


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_reference_path_and_embedding_rows(name) -> None:
    lin, w = _lin({"": (300, name)}, 256, seed=5)
    lin.use_kernel = False
    x = torch.randn(4, 256, dtype=torch.float64).float()
    ref = x.double() @ w.double().t()
    assert ((lin(x).double() - ref).norm() / ref.norm()).item() < 1e-6
    emb = quant.QuantEmbedding(lin, torch.float32)
    ids = torch.tensor([0, 299, 7, 7])
    assert torch.equal(emb(ids), w[ids])


def test_quantize_model_ties_head_and_embedding() -> None:
    from torch import nn

    from flatserve.model.config import ModelConfig  # noqa: F401 (a real model is not needed)

    class Tiny(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = nn.Module()
            self.model.embed_tokens = nn.Embedding(64, 32)
            self.lm_head = nn.Linear(32, 64, bias=False)
            self.lm_head.weight = self.model.embed_tokens.weight
            self.proj = nn.Linear(32, 32)

    m = Tiny()
    ref_w = m.lm_head.weight.detach().clone()
    quant.quantize_model(m, "int8")
    assert isinstance(m.lm_head, quant.QuantLinear) and m.lm_head.fmts[0].name == "q8_0"
    assert isinstance(m.proj, quant.QuantLinear) and m.proj.bias is not None
    assert m.model.embed_tokens.lin is m.lm_head
    rows = m.model.embed_tokens(torch.arange(64))
    assert (rows - ref_w).abs().max() <= ref_w.abs().amax(1, keepdim=True).max() / 127
    assert quant.summary(m) == {"q8_0": (2, 64 * 34 + 32 * 34)}
    assert quant.describe(quant.summary(m)) == "q8_0 x 2 (0.0 MiB)"


def test_quantize_model_refuses_linears_packed_for_the_cpu_gemm(tmp_path) -> None:
    """A bf16 CPU engine packs its linears (AMX tiles, oneDNN's layout, AVX2 panels) after load;
    quantizing it afterwards would leave those dense, so it is refused (--quantization runs
    before the packing)."""
    from flatserve import LLM
    from tests.conftest import build_checkpoint

    path, _ = build_checkpoint("llama", tmp_path)
    with LLM(device="cpu", model=str(path), dtype="bfloat16", max_model_len=64) as llm:
        model = llm.engine.runner.model
        if not any(getattr(m, "cpu_packed", False) for m in model.modules()):
            pytest.skip(f"no linear packed at this ISA level (cpu_gemm {llm.engine.state.cpu_gemm})")
        with pytest.raises(ValueError, match="packed for the CPU GEMM"):
            quant.quantize_model(model, "q4_0")
    with LLM(device="cpu", model=str(path), dtype="bfloat16", max_model_len=64, quantization="q4_0") as llm:
        model = llm.engine.runner.model
        assert set(quant.summary(model)) == {"q4_0"} and isinstance(model.lm_head, quant.QuantLinear)


def test_unknown_quantization_is_refused() -> None:
    from flatserve.config import EngineConfig

    with pytest.raises(ValueError, match="quantization must be q8_0, q4_0 or int8"):
        EngineConfig.from_kwargs(quantization="int4")
    with pytest.raises(ValueError, match="exclude each other"):
        EngineConfig.from_kwargs(quantization="q8_0", dequantize=True)


def _ctx(q_lens, seq_lens, prompt_lens):
    from flatserve.attention.metadata import AttentionMetadata

    cu = [0]
    for q in q_lens:
        cu.append(cu[-1] + q)
    z = torch.zeros(1, dtype=torch.int32)
    return AttentionMetadata(z, z, z.view(1, 1), z.long(), max(q_lens), max(seq_lens), cu,
                             list(seq_lens), prompt_lens_host=list(prompt_lens))


@needs_kernel
def test_each_row_takes_its_path_whatever_shares_the_step() -> None:
    """A decode row (generated token) beside a 40-row prompt chunk: the int8 kernel for it and
    the float GEMM for the chunk, bit for bit as each computed alone, not a path chosen by the
    step's 41 rows (the engine test of this ran into other batch-dependent arithmetic)."""
    from flatserve.attention.metadata import forward_context

    lin, _ = _lin({"": (48, "q4_k")}, 256, seed=random.randrange(1 << 20))
    x = torch.randn(41, 256)
    with torch.inference_mode():
        with forward_context(_ctx([1, 40], [10, 40], [5, 100])):
            mixed = lin(x)
        with forward_context(_ctx([1], [10], [5])):
            dec = lin(x[:1])
        with forward_context(_ctx([40], [40], [100])):
            pre = lin(x[1:])
    assert torch.equal(mixed[:1], dec) and torch.equal(mixed[1:], pre)
    assert not torch.equal(dec, lin.reference(x[:1]))  # the two paths do differ


@needs_kernel
@pytest.mark.parametrize("name", ["q4_k", "q6_k", "q8_0", "q5_0"])
def test_a_rows_result_does_not_depend_on_how_many_rows_share_the_call(name, quant_isa) -> None:
    """Each path row by row: a row's int16 codes and outputs, and its float-GEMM output, are the
    same bits whatever the call's row count or the row's place in it. Both failed before
    2026-11-26: quantize_act's threaded copy (M > 16) contracted the residual into an FMA that
    the inlined copy (M <= 16) did not, and torch's CPU matmul takes other kernels for a few rows
    (M = 1-3, 5-7, 9-11 on an AVX2 EPYC with MKL)."""
    lin, _ = _lin({"": (64, name)}, 512, seed=random.randrange(1 << 20))
    x = torch.randn(72, 512).bfloat16()
    ext = quant.kernel()
    full_codes = ext.quantize_act(x[:40].contiguous())
    full_q, full_float = lin._int16(ext, x), lin.reference(x, ext)
    for m in random.sample(range(1, 31), 8) + [1, 4, 5, 16, 17]:
        codes = ext.quantize_act(x[:m].contiguous())
        assert all(torch.equal(a, b[:m]) for a, b in zip(codes, full_codes)), m
        assert torch.equal(lin._int16(ext, x[:m]), full_q[:m]), m
        off = random.randrange(1, 20)
        assert torch.equal(lin._int16(ext, x[off:off + m]), full_q[off:off + m]), (off, m)
    for m in list(range(1, 13)) + random.sample(range(13, 72), 6):
        assert torch.equal(lin.reference(x[:m], ext), full_float[:m]), m


def _path(lin, x: torch.Tensor, path: int) -> torch.Tensor:
    """lin's int16 path with every call on one of the amx or avx512 level's paths (gemm's `path`:
    1 the AVX-512 rows16, 2 the tiles, AMX or in VNNI lanes, 0 by row count as the engine calls
    it)."""
    ext = quant.kernel()
    acts = ext.quantize_act(x.contiguous())
    y = torch.empty(x.shape[0], lin.out_features, dtype=x.dtype)
    col = 0
    for fmt, q in lin.segments():
        ext.gemm(*acts, q, fmt.ggml_type, y, col, path=path)
        col += q.shape[0]
    return y


def _codes_bound_holds(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> bool:
    """got within the vector path's bound of the float64 product of x's int16 codes and w: each
    product's share rounded at most ~K/32 + 8 times (test_kernel_matches_reference says why)."""
    k = x.shape[1]
    xa = _act_dequant(x).double()
    ref = xa @ w.double().t()
    err = (got.double() - ref).abs()
    bound = (k / 32 + 8) * 2.0**-23 * (xa.abs() @ w.double().abs().t())
    return bool(((err <= bound) | (err <= 1e-5 * ref.abs().max() + 1e-6)).all())


def _tiles_case(name: str) -> tuple[quant.QuantLinear, torch.Tensor, torch.Tensor, random.Random]:
    """A random `name` linear (N = 37 or 64: a padded last weight group or none; K of 8-33 blocks)
    and 40 fp32 rows (fp32 out: bf16 rounding would hide a last bit) -> (lin, x, the tiles'
    result, rng), the result checked within the codes' bound and equal to path 1's (rows16, or
    rows8 below AVX-512)."""
    rng = random.Random()
    # the 32-value formats at 10 and 33 blocks too: K not a multiple of a K format's 8-block super-block
    k = rng.choice([256, 512, 768] + ([320, 1056] if FORMATS[name].block == 32 else []))
    n = rng.choice([37, 64])
    lin, w = _lin({"": (n, name)}, k, seed=rng.randrange(1 << 20))
    x = torch.randn(40, k) * torch.rand(40, 1) * 4
    full = _path(lin, x, 2)
    assert _codes_bound_holds(full, x, w)
    assert torch.equal(_path(lin, x, 1), full)
    return lin, x, full, rng


@needs_kernel
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_avx512_rows16_matches_the_vector_path_within_its_bound(name, avx512_isa) -> None:
    """At the avx512 level rows16 (csrc/quant_rows.h), forced, stays within the vector path's
    bound of the float64 product of the same int16 codes, at 1-4 rows (a partial group) and
    16-17, N not a multiple of 16; and the format mask (quant.ROWS16_FORMATS) routes AUTO calls
    to the tiles' bits (rows16, or the tiles in VNNI lanes above a few rows)."""
    rng = random.Random()
    k, n = rng.choice([256, 512, 1024]), rng.choice([17, 40])
    lin, w = _lin({"": (n, name)}, k, seed=rng.randrange(1 << 20))
    ext = quant.kernel()
    for rows in (1, 3, 4, 16, 17):
        x = torch.randn(rows, k) * torch.rand(rows, 1) * 4
        assert _codes_bound_holds(_path(lin, x, 1), x, w), (name, rows)
        try:
            ext.set_rows16_formats(1 << min(FORMATS[name].ggml_type, 62))
            assert torch.equal(_path(lin, x, 0), _path(lin, x, 1))
        finally:
            quant._rows16_set.clear()  # the next kernel() call sets the default mask again
            quant.kernel()


@needs_kernel
@pytest.mark.parametrize("name", sorted(FORMATS))
def test_tile_paths_match_the_codes_product_and_each_others_bits(name, tile_isa) -> None:
    """The amx and avx512 levels' two paths for every format, the tiles (AMX-INT8 tiles,
    csrc/quant_amx.h, or their VNNI form, csrc/quant_vnni.h) and rows16 (csrc/quant_rows.h,
    weight rows in AVX-512 lanes): within the vector path's bound of the float64 product of the
    same int16 codes and weights, and each row's bits the same on either path, alone or in calls
    of any size (1-4 rows: a partial rows16 group; 16 and 17: full and padded tile groups), at
    any offset; N not a multiple of 16 (a padded last weight group); and the engine's own calls
    (the default format mask at avx512) give the same bits."""
    assert quant.kernel().isa() == tile_isa
    lin, x, full, rng = _tiles_case(name)
    for m in [1, 2, 3, 4, 5, 16, 17, rng.randrange(6, 40)]:
        off = rng.randrange(0, 40 - m + 1)
        for path in (0, 1, 2):
            assert torch.equal(_path(lin, x[off:off + m], path), full[off:off + m]), (m, off, path)
    assert torch.equal(lin._int16(quant.kernel(), x), full)  # the engine's own calls
    for dtype in (torch.bfloat16, torch.float16):  # the tiles' vector bf16 stores round as c10 does
        xl = x[:17].to(dtype)
        assert torch.equal(_path(lin, xl, 2), _path(lin, xl, 1)), dtype


@needs_kernel
@pytest.mark.parametrize("name", sorted(FORMATS))
@pytest.mark.parametrize("level", ["avxvnni", "avx2"])
def test_ymm_paths_below_avx512_match_the_codes_product_and_the_avx512_tiles(name, level, monkeypatch) -> None:
    """The avx2 and avxvnni builds' two paths (csrc/quant_tiles_ymm.h): the tiles in 256-bit lanes
    (prompt rows, and calls above a few rows) and rows8 (weight rows in the lanes), within the
    vector path's bound of the float64 product of the same int16 codes, each row's bits the same
    on either path, alone or in calls of any size at any offset (1-5 rows: partial rows8 and tile
    steps; 16, 17: a full and a padded activation group), as the engine calls them (path 0), N
    not a multiple of 8 or 16, fp32 and bf16 out; and where this CPU runs the avx512 level, the
    same bits as its tiles in VNNI lanes."""
    from tests.conftest import _at_level

    _at_level(level, monkeypatch)
    ext = quant.kernel()
    assert ext.isa() == level
    lin, x, full, rng = _tiles_case(name)
    for m in [1, 2, 3, 4, 5, 8, 9, 16, 17, rng.randrange(6, 40)]:
        off = rng.randrange(0, 40 - m + 1)
        for path in (0, 1, 2):
            assert torch.equal(_path(lin, x[off:off + m], path), full[off:off + m]), (m, off, path)
    assert torch.equal(lin._int16(ext, x), full)  # the engine's own calls
    xl = x[:17].bfloat16()
    low = _path(lin, xl, 2)  # bf16 out: each result rounded as c10 rounds the fp32 one
    acts = ext.quantize_act(xl)
    y32 = torch.empty(17, lin.out_features)
    ext.gemm(*acts, lin.qweight0, FORMATS[name].ggml_type, y32, 0, path=2)
    assert torch.equal(low, y32.bfloat16())
    assert torch.equal(_path(lin, xl[:3], 1), low[:3])  # rows8's stores round alike
    if "avx512" in dev.cpu_isa_levels():
        monkeypatch.setenv("FLATSERVE_CPU_ISA", "avx512")
        assert quant.kernel().isa() == "avx512"
        assert torch.equal(_path(lin, x, 2), full)
        assert torch.equal(_path(lin, xl, 2), low)


@needs_kernel
@pytest.mark.parametrize("level", ["amx", "avx512", "avxvnni", "avx2", "portable"])
def test_bf16_out_rounds_ties_to_even(level, monkeypatch) -> None:
    """Every path's bf16 stores (the tiles' vector ones, rows8's and rows16's scalar ones) round
    as c10 does, ties to even, where random inputs almost never meet a tie: Q8_0 weights of scale
    1 and activations whose block scale is 1 (amax 32,639: the codes are the values), so every
    result is its integer dot, and ~18% of them are exact ties for bf16's 8 bits (575 of the 3,264
    on average, at least 503 over 300 draws). Fresh random codes per run; 4 to 40 rows cover
    each path."""
    from tests.conftest import _at_level

    _at_level(level, monkeypatch)
    ext = quant.kernel()
    rng = random.Random()
    n, k = 48, 64
    codes = torch.tensor([[rng.randint(-9, 9) for _ in range(k)] for _ in range(n)], dtype=torch.int8)
    codes[:, ::32] = 0  # the weights meet the 32,639 that sets each block's scale with 0
    blocks = torch.cat([torch.tensor([1.0], dtype=torch.float16).view(torch.uint8).repeat(n, k // 32, 1),
                        codes.view(n, k // 32, 32).view(torch.uint8)], dim=2).reshape(n, -1)
    lin = quant.QuantLinear(k, {"": (n, FORMATS["q8_0"])})
    lin.load_quant("", blocks.contiguous(), FORMATS["q8_0"])
    ties = 0
    for m in (4, 8, 16, 40):
        x = torch.tensor([[rng.randint(-60, 60) for _ in range(k)] for _ in range(m)], dtype=torch.float32)
        x[:, ::32] = 32639.0
        exact = x.double() @ codes.double().T  # [m, n], integers below 2^24: exact in fp32 too
        acts = ext.quantize_act(x)  # fp32 in (32,639 is not a bf16 value), bf16 out
        for path in (0, 1, 2) if ext.isa() in ("amx", "avx512") else (0,):
            out = torch.empty(m, n, dtype=torch.bfloat16)
            ext.gemm(*acts, lin.qweight0, FORMATS["q8_0"].ggml_type, out, 0, path)
            assert torch.equal(out, exact.float().bfloat16()), (m, path)
        low = exact.abs() % 2 ** (torch.floor(torch.log2(exact.abs().clamp(min=1))) - 7)
        ties += int(((exact.abs() >= 256) & (low == 2 ** (torch.floor(torch.log2(exact.abs().clamp(min=1))) - 8))).sum())
    assert ties > 100, ties  # the test met ties, each of which half-up rounding would break

