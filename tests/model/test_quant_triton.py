"""The Triton quantized GEMMs (flatserve/model/quant_triton.py on stored blocks,
flatserve/model/quant_planar.py on the q4_0 / q8_0 planar copy) against the torch reference
(dequantized weights, dense matmul). On the CPU through the Triton interpreter (TRITON_INTERPRET=1
set by the test in a subprocess, since the interpreter is chosen at import); on CUDA directly."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")

_CHECK = r'''
import sys, torch
from flatserve.model import quant, quant_planar, quant_triton
from flatserve.model.qformats import FORMATS, dequantize
from tests.model.test_qformats import random_blocks
dev = sys.argv[1]
for name in quant_triton.KERNEL_FORMATS:
    fmt = FORMATS[name]
    # Rows 1-16 take the split-K GEMVs (K split in 2-8 here; q4_0 / q8_0 up to FMA_ROWS rows
    # the FMA kernel), more rows the dequantize-then-matmul path.
    shapes = ((1, (70, 128)), (3, (64, 1024)), (5, (64, 2048)), (16, (40, 4096)), (40, (33, 96)), (300, (24, 64))) \
        if fmt.block == 32 else ((1, (70, 256)), (3, (64, 1024)), (5, (64, 2048)), (16, (40, 4096)), (40, (33, 768)),
                                 (300, (24, 256)))  # K formats: 256-value super-blocks
    assert quant_triton._gemv_tiles(torch.device(dev), 40, 4096 // 32)[2] > 1  # K is split
    for m, (n, k) in shapes:
        raw = random_blocks(fmt, n, k, seed=m + fmt.ggml_type)
        w = dequantize(raw, fmt, k)
        x = torch.randn(m, k)
        out = torch.empty(m, n, device=dev)
        quant_triton.qgemm(x.to(dev), raw.to(dev), fmt, out)
        ref = x.double() @ w.double().t()
        err = ((out.cpu().double() - ref).norm() / ref.norm()).item()
        assert err < 1e-5, (name, m, n, k, err)
# The planar copy (quant_planar): fresh random blocks and activations every run; rows 1-2 the FMA
# kernel, 3-40 the fused GEMM (3-32 also the tensor-core GEMV it replaced); K split in 2-16 where K allows;
# the output poisoned with NaN first (every element written).
g = torch.Generator().manual_seed(torch.seed() % 2**31)
for name in quant_planar.FORMATS:
    fmt = FORMATS[name]
    for m, (n, k) in ((1, (70, 128)), (1, (130, 1024)), (2, (64, 2048)), (3, (33, 256)), (4, (64, 1024)),
                      (5, (64, 2048)), (16, (40, 4096)), (32, (24, 256)), (40, (33, 96))):
        raw = random_blocks(fmt, n, k, seed=int(torch.randint(0, 2**31, (1,), generator=g)))
        p = quant_planar.repack(raw.to(dev), fmt)
        w = dequantize(raw, fmt, k)
        x = torch.randn(m, k, generator=g)
        ref = x.double() @ w.double().t()
        # the auto tiles; at FMA rows also the other loops (STAGES 0: two steps ahead in
        # registers, 1: one step, 3: Triton's pipeliner) and 8 blocks a step
        other = ((64, 4, 2, 4, 0), (128, 8, 2, 8, 1), (64, 4, 2, 4, 3))
        for tiles in (None, *other) if m <= quant_planar.FMA_ROWS and k >= 512 else (None,):
            out = torch.full((m, n), float("nan"), device=dev)
            quant_planar.qgemm(x.to(dev), p, fmt, out, tiles)
            err = ((out.cpu().double() - ref).norm() / ref.norm()).item()
            assert err < 1e-5, ("planar", name, m, n, k, tiles, err)
            if m <= quant_planar.FMA_ROWS:  # the split sum in-kernel or a 2nd launch: same bits
                quant_planar.FUSED_SUM = False
                out2 = torch.full((m, n), float("nan"), device=dev)
                quant_planar.qgemm(x.to(dev), p, fmt, out2, tiles)
                quant_planar.FUSED_SUM = True
                assert torch.equal(out, out2), ("planar split sum", name, m, n, k, tiles)
            elif m <= quant_planar.GEMV_ROWS:  # the tensor-core GEMV (the path before the GEMM)
                quant_planar.GEMM = False
                out2 = torch.full((m, n), float("nan"), device=dev)
                quant_planar.qgemm(x.to(dev), p, fmt, out2, tiles)
                quant_planar.GEMM = True
                err = ((out2.cpu().double() - ref).norm() / ref.norm()).item()
                assert err < 1e-5, ("planar gemv", name, m, n, k, err)
# The FMA GEMV on bf16 x (the engine's activations; above fp32): widened exactly, so the products
# are exact and only the fp32 sums' rounding differs from the float64 reference, ~1e-7 relative.
for name in quant_planar.FORMATS:
    fmt = FORMATS[name]
    for m, (n, k) in ((1, (130, 1024)), (2, (33, 37 * 32))):
        raw = random_blocks(fmt, n, k, seed=int(torch.randint(0, 2**31, (1,), generator=g)))
        p = quant_planar.repack(raw.to(dev), fmt)
        x = torch.randn(m, k, generator=g).bfloat16()
        exact = x.double() @ dequantize(raw, fmt, k).double().t()
        out = torch.full((m, n), float("nan"), device=dev)
        quant_planar.qgemm(x.to(dev), p, fmt, out)
        assert ((out.cpu().double() - exact).norm() / exact.norm()).item() < 1e-5, ("fma bf16", name, m)
# The fused GEMM (quant_planar._gemm_kernel) at row counts that are not multiples of its row
# tile (17, 100, 257) and columns not of its column tile (70, 33): the auto tiles, and others
# with K split in 2 (fixed-order sums), 1-4 blocks a step. fp32 activations (the interpreter has
# no bf16 dots): the products are exact and only the fp32 sums' rounding differs from the
# float64 reference, ~1e-7 relative, so 1e-5.
for name in quant_planar.FORMATS:
    fmt = FORMATS[name]
    for m, (n, k) in ((17, (70, 512)), (100, (33, 256)), (257, (70, 256))):
        raw = random_blocks(fmt, n, k, seed=int(torch.randint(0, 2**31, (1,), generator=g)))
        p = quant_planar.repack(raw.to(dev), fmt)
        x = torch.randn(m, k, generator=g)
        ref = x.double() @ dequantize(raw, fmt, k).double().t()
        for tiles in (None, (16, 32, 1, 2, 4, 2), (64, 64, 4, 1, 4, 2), (128, 64, 2, 2, 8, 3)):
            out = torch.full((m, n), float("nan"), device=dev)
            quant_planar.gemm(x.to(dev), p, fmt, out, tiles)
            err = ((out.cpu().double() - ref).norm() / ref.norm()).item()
            assert err < 1e-5, ("gemm", name, m, n, k, tiles, err)
        if dev == "cuda":  # bf16 activations: the reference's bits (w rounded to bf16, fp32 sums);
            # the outputs' bf16 rounding (2^-9 relative) bounds the difference, so 1e-2
            xb = x.to(dev, torch.bfloat16)
            refb = xb.double().cpu() @ dequantize(raw, fmt, k).bfloat16().double().t()
            out = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
            quant_planar.qgemm(xb, p, fmt, out)
            err = ((out.cpu().double() - refb).norm() / refb.norm()).item()
            assert err < 1e-2, ("gemm bf16", name, m, n, k, err)
print("ok")
'''


def _run(dev: str, interpret: bool) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1" if interpret else "0")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    r = subprocess.run([sys.executable, "-c", _CHECK, dev], env=env, capture_output=True, text=True,
                       timeout=600, cwd=root)
    assert r.returncode == 0 and "ok" in r.stdout, r.stdout + r.stderr[-3000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the compiled kernel "
                    "(test_triton_qgemm_cuda_matches_reference); the interpreter check is for CPUs")
def test_triton_qgemm_interpreted_matches_reference() -> None:
    _run("cpu", interpret=True)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (the interpreter test covers the CPU)")
def test_triton_qgemm_cuda_matches_reference() -> None:
    _run("cuda", interpret=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_quantlinear_on_cuda_uses_triton_for_32_value_formats() -> None:
    from flatserve.model import quant
    from flatserve.model.qformats import FORMATS, dequantize
    from tests.model.test_qformats import random_blocks

    shards = {"q": (64, FORMATS["q5_0"]), "v": (32, FORMATS["q8_0"])}
    lin = quant.QuantLinear(256, shards)
    dense = []
    for i, (s, (n, f)) in enumerate(shards.items()):
        raw = random_blocks(f, n, 256, seed=i)
        lin.load_quant(s, raw, f)
        dense.append(dequantize(raw, f, 256))
    lin = lin.cuda()
    assert lin._triton()
    x = torch.randn(3, 256, device="cuda", dtype=torch.bfloat16)
    ref = x.double().cpu() @ torch.cat(dense).double().t()
    got = lin(x).double().cpu()
    assert ((got - ref).norm() / ref.norm()).item() < 1e-2  # bf16 activations and output


@pytest.mark.parametrize("name", ["q4_0", "q8_0"])
def test_planar_round_trip(name: str) -> None:
    """repack then to_blocks gives the stored blocks back, all rows or a gather of rows; the
    planar tensor has the blocks' shape and bytes; the codes in the documented order: q4_0's
    nibble s (bits 4s) of int32 word w is value 4s + w, q8_0's byte s of word w value 8s + w."""
    from flatserve.model import quant_planar
    from flatserve.model.qformats import FORMATS, dequantize
    from tests.model.test_qformats import random_blocks

    fmt = FORMATS[name]
    raw = random_blocks(fmt, 37, 512, seed=int(torch.seed() % 2**31))
    p = quant_planar.repack(raw, fmt)
    assert p.shape == raw.shape and p.dtype == torch.uint8
    assert torch.equal(quant_planar.to_blocks(p, fmt), raw)
    ids = torch.tensor([5, 0, 36, 5])
    assert torch.equal(quant_planar.to_blocks(p, fmt, ids), raw[ids])
    codes, scales = quant_planar._split(p, fmt)
    w = dequantize(raw, fmt, 512).view(37, 16, 32)
    words = codes.contiguous().view(torch.int32)  # [37, 16, W]
    bits, nw = (4, 4) if name == "q4_0" else (8, 8)
    q = torch.empty(37, 16, 32)
    for s in range(32 // nw):
        field = (words >> (bits * s)) & (2**bits - 1)
        q[..., nw * s:nw * (s + 1)] = (field - 8 if name == "q4_0" else (field ^ 128) - 128).float()
    assert torch.equal(scales.float()[..., None] * q, w)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_quantlinear_on_cuda_repacks_q4_0_and_q8_0_at_load() -> None:
    """Loaded on CUDA, q4_0 / q8_0 segments become the planar copy once their last shard is in
    (same bytes), q5_0 stays as stored; outputs match the reference at 1, 3, 20 and 70 rows, and
    the embedding's row lookup reads the planar table."""
    from flatserve.model import quant
    from flatserve.model.qformats import FORMATS, dequantize
    from tests.model.test_qformats import random_blocks

    shards = {"q": (96, FORMATS["q4_0"]), "k": (32, FORMATS["q4_0"]), "v": (64, FORMATS["q5_0"]),
              "o": (48, FORMATS["q8_0"])}
    lin = quant.QuantLinear(512, shards).cuda()
    dense = []
    for i, (s, (n, f)) in enumerate(shards.items()):
        raw = random_blocks(f, n, 512, seed=int(torch.seed() % 2**31))
        lin.load_quant(s, raw, f)
        dense.append(dequantize(raw, f, 512))
        assert lin.planar == {"q": set(), "k": {0}, "v": {0}, "o": {0, 2}}[s], (s, lin.planar)
    assert lin.weight_bytes() == sum(n * f.row_bytes(512) for n, f in shards.values())
    w = torch.cat(dense).double()
    for m in (1, 3, 20, 70):
        x = torch.randn(m, 512, device="cuda")
        ref = x.double().cpu() @ w.t()
        got = lin(x).double().cpu()
        assert ((got - ref).norm() / ref.norm()).item() < 1e-5, m
    table = quant.QuantLinear(512, {"": (40, FORMATS["q4_0"])}).cuda()
    raw = random_blocks(FORMATS["q4_0"], 40, 512, seed=3)
    table.load_quant("", raw, FORMATS["q4_0"])
    assert table.planar == {0}
    ids = torch.tensor([7, 0, 39], device="cuda")
    got = quant.QuantEmbedding(table)(ids).cpu()
    assert torch.equal(got, dequantize(raw, FORMATS["q4_0"], 512)[ids.cpu()])


@pytest.mark.parametrize("name,big", [("NVIDIA H200", 128), ("NVIDIA H100 80GB HBM3", 256)])
def test_fused_gemm_rows_by_gpu(name: str, big: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fused GEMM's row limit for large weights: 128 on an H200, 256 elsewhere (measured on
    both, docs/performance-gpu.md); small weights 128 everywhere, CPU tensors the default rule.
    The device's name is faked: the rule is host code."""
    from flatserve import device as dev
    from flatserve.model import quant_planar

    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: name)
    dev._hbm3e.cache_clear()
    try:
        gpu = torch.device("cuda", 0)
        big_w, small_w = (28672, 4096), (4096, 4096)  # >= 2^25 values, < 2^25
        for m in (2, 3, 128, 129, 256, 257):
            assert quant_planar.use_gemm(m, *big_w, gpu) == (2 < m <= big)
            assert quant_planar.use_gemm(m, *small_w, gpu) == (2 < m <= 128)
            assert quant_planar.use_gemm(m, *big_w, torch.device("cpu")) == (2 < m <= 256)
    finally:
        dev._hbm3e.cache_clear()
