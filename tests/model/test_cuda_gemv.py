"""The one-row q4_0 GEMV in CUDA C++ (flatserve/model/cuda_gemv.py, ops/csrc/q4_gemv_cuda.cu):
against a float64 reference element by element on fresh random blocks and activations, at row
counts with and without a tail for both rows-per-warp kernels and K with and without a tail step;
inside a CUDA graph; the fallbacks to the Triton GEMV (unaligned x, the kernel off, a failed
build). Needs CUDA: the CPU has no such kernel (the Triton interpreter tests cover the planar
layout there)."""
from __future__ import annotations

import logging

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA (the kernel is CUDA C++)", allow_module_level=True)

from flatserve.model import cuda_gemv, quant_planar  # noqa: E402
from flatserve.model.qformats import FORMATS, dequantize  # noqa: E402
from tests.model.test_qformats import random_blocks  # noqa: E402

FMT = FORMATS["q4_0"]
DEV = torch.device("cuda")


def _weights(n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    raw = random_blocks(FMT, n, k, seed=int(torch.randint(0, 2**31, (1,), generator=g)))
    return quant_planar.repack(raw.to(DEV), FMT), dequantize(raw, FMT, k).double()


def _check(got: torch.Tensor, x: torch.Tensor, w: torch.Tensor, scales: torch.Tensor | None = None,
           scale: float = 1.0, rel: float = 0.0, h2: bool = False) -> None:
    """Products d (q - 8) x are exact in fp32 (an fp16 scale times a bf16 x times a 4-bit integer),
    so only the fp32 sums round: a lane sums 8 products a step, scales by d and adds into its
    accumulator over nblk / 8 steps, then 5 shuffle levels: at most nblk / 8 + 16 roundings on the
    way to any output, each 2^-24 of at most sum |term|. The bf16 output then rounds once more
    (half an ulp: 2^-8 relative). With `scales` (fp16 [N, nblk]: the tensor-core kernel ran), each
    block's sum C = sum (128 + q) x (two mma's, fp32) less 136 sum(x) cancels: |C| <= 143
    sum |x| and 136 sum(x) carries 33 roundings of sum |x|, so each block adds at most
    |d| (2^-21 143 + 2^-24 136 33) sum |x| < 2^-11 |d| sum |x| more. With `scale` (q4_ks_norm's
    1 / rms): the sums scaled, the scale itself off by at most `rel` of its value. With `h2`
    (q4_ks's packed-fp16 products): x's block scaled by 2^e (max |x| 2^e in [2^10, 2^11)), each
    of 8 HFMA2 into an fp16 sum rounds by at most 2^-11 of that sum, so a block's sum is within
    2^-8 of its sum |term|; an fp16 subnormal rounds by 2^-25 absolute (x 2^e's tiny values, a
    sum near 0): at most 64 such a block, each 2^-25 8 2^-e |d| <= 2^-32 max |x| |d| once scaled
    back (|d| <= max |w| of a block with a nonzero term; a block of zero terms sums exactly)."""
    xd = x.double().cpu().reshape(-1)
    ref = scale * (w @ xd)
    nblk = x.shape[-1] // 32
    # the row-sequential kernels: 31 roundings in a lane's block sum, nblk / 32 steps, 5 levels
    # (q4_ks: 31 + 1 in a lane, 5 lane levels, 3 warps)
    acc = scale * max(nblk / 8 + 16, 40 + nblk / 32) * 2.0 ** -24 * (w.abs() @ xd.abs())
    if scales is not None:
        acc = acc + 2.0 ** -11 * (scales.double().abs().cpu() @ xd.abs().reshape(nblk, 32).sum(1))
    if h2:
        xmax = xd.abs().reshape(nblk, 32).amax(1)
        wmax = w.abs().reshape(w.shape[0], nblk, 32).amax(2)
        acc = acc + scale * (2.0 ** -8 * (w.abs() @ xd.abs()) + 2.0 ** -26 * (wmax @ xmax))
    err = (got.double().cpu().reshape(-1) - ref).abs()
    assert torch.isfinite(got).all()
    bound = (ref.abs() + acc) * (2.0 ** -8 + rel) + acc + ref.abs() * rel
    assert (err <= bound).all(), (err - bound).max()


def mma_scales(p: torch.Tensor) -> torch.Tensor | None:
    """The scales _check needs where gemv takes the tensor-core kernel for weights `p`."""
    _, scales, nblk = quant_planar._views(p, FMT)
    return scales if cuda_gemv.choose(p.shape[0], nblk, p.device)[0][0] == "mma" else None


def fp16(p: torch.Tensor) -> bool:
    """Whether gemv takes a kernel with packed-fp16 products for weights `p` (_check's `h2`)."""
    _, _, nblk = quant_planar._views(p, FMT)
    return cuda_gemv.fp16_products(cuda_gemv.choose(p.shape[0], nblk, p.device)[0])


@pytest.fixture(scope="module")
def ready() -> None:
    if not cuda_gemv.prepare(DEV):
        pytest.skip(f"the CUDA C++ GEMV did not build here: {cuda_gemv._FAILED}")


# (N, K): row tails for every FMA kernel (4 warps x 1, 2, 4 rows a CTA) and the tensor-core one
# (from 40 x the SMs: 5,280 rows on an H100); K of one block, of a tail step only (640: 20
# blocks), of whole load groups only (14,336: 7 groups of 2 FMA steps of 32 blocks), of groups
# and a tail (4,192: 131 blocks), of no whole FMA group (1,536 and 2,560: 48 and 80 blocks; the
# mma kernel's groups of 2 and 4 steps of 8 blocks, then its tail). `kernel`: the FMA kernel at
# 1, 2 or 4 rows a warp, or the tensor-core kernel with 2 or 4 steps a load group (weights under
# 40 x SMs rows take the FMA kernel by fma_rows()). The FMA kernel with its products in packed
# fp16 (the default) and in fp32.
@pytest.mark.parametrize("kernel", [("fma", 1), ("fma", 2), ("fma", 4), ("fma32", 1), ("fma32", 2),
                                    ("fma32", 4), ("mma", 2), ("mma", 4)])
@pytest.mark.parametrize("n,k", [(8, 32), (13, 640), (1000, 4192), (6151, 4096), (300, 14336),
                                 (5400, 640), (5301, 4192), (777, 1536), (5350, 2560)])
def test_gemv_matches_float64_reference(ready, monkeypatch, n: int, k: int, kernel) -> None:
    kind, v = kernel
    monkeypatch.setattr(cuda_gemv, "H2", "" if kind == "fma32" else "_h2")
    monkeypatch.setattr(cuda_gemv, "H2_ROWS", True)
    kind = "fma" if kind == "fma32" else kind
    monkeypatch.setattr(cuda_gemv, "KS", False)
    monkeypatch.setattr(cuda_gemv, "KSX", False)
    monkeypatch.setattr(cuda_gemv, "MMA", kind == "mma")
    monkeypatch.setattr(cuda_gemv, "FMA_ROWS" if kind == "fma" else "STEPS", v)
    _gemv_against_reference(n, k, ("mma", v) if kind == "mma" and cuda_gemv.rows_per_warp(n, DEV) == 4
                            else (v, 2) if kind == "fma" else None)


# q4_ks (K <= 4,096; 8 rows a CTA): row tails; K of one block, of a partial slice (640: 20
# blocks), of 3 slices and a part (4,000: 125 blocks), of 4 (4,096).
# h2: the packed-fp16 products (the default), "": the fp32 ones.
@pytest.mark.parametrize("h2", ["_h2", ""])
@pytest.mark.parametrize("n,k", [(8, 32), (13, 640), (1001, 4000), (6151, 4096), (131, 4096)])
def test_ks_matches_float64_reference(ready, monkeypatch, n: int, k: int, h2: str) -> None:
    monkeypatch.setattr(cuda_gemv, "KS_ALL", True)
    monkeypatch.setattr(cuda_gemv, "H2", h2)
    _gemv_against_reference(n, k, ("ks", 8))


# q4_ksx (q4_ks split along K over a cluster of ceil(K / 4,096) CTAs, sm_90): row tails; clusters of
# 1 (one block; 20 blocks; 128), 2 (131 blocks: a partial second CTA), 4 (down's 448 blocks) and 8
# (1,024 blocks), the products in packed fp16 and in fp32.
@pytest.mark.parametrize("h2", ["_h2", ""])
@pytest.mark.parametrize("n,k", [(8, 32), (13, 640), (4096, 4096), (1001, 4192), (300, 14336),
                                 (4096, 14336), (77, 32768)])
def test_ksx_matches_float64_reference(ready, monkeypatch, n: int, k: int, h2: str) -> None:
    if torch.cuda.get_device_capability(DEV)[0] < 9:
        pytest.skip("q4_ksx needs thread block clusters (sm_90)")
    monkeypatch.setattr(cuda_gemv, "KS", False)
    monkeypatch.setattr(cuda_gemv, "H2", h2)
    _gemv_against_reference(n, k, ("ksx", 8))


@pytest.mark.parametrize("kind", ["ks", "fma", "ksx"])
def test_fp16_products_keep_huge_and_tiny_activations(ready, monkeypatch, kind: str) -> None:
    """The packed-fp16 products (q4_ks, q4_ksx, the FMA kernel) on a residual stream fp16 cannot hold
    (|x| up to 2^20: each block's x is scaled by a power of two first) and on blocks of values
    near bf16's smallest normal, next to ordinary blocks: finite, and within _check's bound."""
    monkeypatch.setattr(cuda_gemv, "KS", kind == "ks")
    monkeypatch.setattr(cuda_gemv, "KS_ALL", kind == "ks")
    monkeypatch.setattr(cuda_gemv, "KSX", kind == "ksx")
    monkeypatch.setattr(cuda_gemv, "MMA", False)
    monkeypatch.setattr(cuda_gemv, "H2", "_h2")
    monkeypatch.setattr(cuda_gemv, "H2_ROWS", True)
    if kind == "ksx" and torch.cuda.get_device_capability(DEV)[0] < 9:
        pytest.skip("q4_ksx needs thread block clusters (sm_90)")
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    n, k = {"ks": (1001, 4096), "fma": (1000, 4192), "ksx": (1000, 14336)}[kind]
    p, w = _weights(n, k, g)
    x = torch.randn(1, k, generator=g)
    x.view(-1, 32)[::3] *= 2.0 ** 20  # massive activations, a third of the blocks
    x.view(-1, 32)[1::3] *= 2.0 ** -120
    x = x.bfloat16().to(DEV)
    codes, scales, nblk = quant_planar._views(p, FMT)
    key = cuda_gemv.choose(n, nblk, DEV)[0]
    assert key[0] == (kind if kind != "fma" else 1) and cuda_gemv.fp16_products(key), key
    out = torch.full((1, n), float("nan"), dtype=torch.bfloat16, device=DEV)
    assert cuda_gemv.gemv(x, codes, scales, out, n, nblk)
    _check(out, x, w, h2=True)


# The fused forms of model/cuda_stack.py. q4_ks with the RMSNorm inside: x is the residual stream
# h and out = rsqrt(mean(h^2) + eps) * W bf16(h * nw); checked as _check on x' = bf16(h * nw)
# (that product of two bf16 is exact in fp32 and rounds as the kernel's cvt.rn) plus the scale's
# own error: h^2 summed in fp32 (k terms: k 2^-24 of the sum, half of it in rsqrt) and rsqrtf
# (2 ulp). K of one block, of a partial slice, of 4 slices; row tails.
@pytest.mark.parametrize("h2", ["_h2", ""])
@pytest.mark.parametrize("n,k", [(8, 32), (13, 640), (1001, 4000), (6151, 4096)])
def test_ks_norm_matches_float64_reference(ready, monkeypatch, n: int, k: int, h2: str) -> None:
    monkeypatch.setattr(cuda_gemv, "H2", h2)
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    p, w = _weights(n, k, g)
    h = (torch.randn(1, k, generator=g) * 3).bfloat16().to(DEV)
    nw = (1 + 0.3 * torch.randn(k, generator=g)).bfloat16().to(DEV)
    eps = 1e-5
    codes, scales, nblk = quant_planar._views(p, FMT)
    out = torch.full((1, n), float("nan"), dtype=torch.bfloat16, device=DEV)
    assert cuda_gemv.gemv(h, codes, scales, out, n, nblk, norm=(nw, eps))
    xw = (h.float() * nw.float()).bfloat16()
    r = 1 / (h.double().pow(2).mean() + eps).sqrt().item()
    _check(out, xw, w, scale=r, rel=k * 2.0 ** -24 + 2.0 ** -21, h2=bool(h2))


# Gate|up with the norm in and act(gate) * up out: the same bits as q4_ks_norm's gate and up
# outputs followed by _act_mul_kernel's arithmetic (act in fp32 of the bf16 gate, rounded, times
# up, rounded), the exponential's last bits aside: within 2 bf16 steps. Intermediate sizes with
# a CTA tail (4 outputs a CTA).
@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("i,k", [(4, 32), (13, 640), (1001, 4096)])
def test_ks_norm_act_is_the_norm_gemv_then_act_and_mul(ready, act: str, i: int, k: int) -> None:
    from flatserve.ops.triton_ops import act_and_mul

    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    p, _ = _weights(2 * i, k, g)
    h = torch.randn(1, k, generator=g).bfloat16().to(DEV)
    nw = (1 + 0.3 * torch.randn(k, generator=g)).bfloat16().to(DEV)
    codes, scales, nblk = quant_planar._views(p, FMT)
    gu = torch.full((1, 2 * i), float("nan"), dtype=torch.bfloat16, device=DEV)
    assert cuda_gemv.gemv(h, codes, scales, gu, 2 * i, nblk, norm=(nw, 1e-6))
    out = torch.full((1, i), float("nan"), dtype=torch.bfloat16, device=DEV)
    assert cuda_gemv.gemv(h, codes, scales, out, 2 * i, nblk, norm=(nw, 1e-6), act=act)
    ref = act_and_mul(gu, act).float()
    assert torch.isfinite(out).all()
    assert ((out.float() - ref).abs() <= 2.0 ** -6 * ref.abs()).all()
    assert (out.float() == ref).float().mean() > 0.9  # mostly the same bits


# The residual add in the store, for every kernel family: the bits of the plain GEMV's output
# added to res in bf16 (torch's bf16 add: fp32 sum, one rounding).
@pytest.mark.parametrize("kernel", [("fma", 4), ("fma", 1), ("mma", 2), ("ks", 8), ("ksx", 8)])
def test_residual_add_is_the_gemv_then_the_add(ready, monkeypatch, kernel) -> None:
    kind, v = kernel
    if kind == "ksx" and torch.cuda.get_device_capability(DEV)[0] < 9:
        pytest.skip("q4_ksx needs thread block clusters (sm_90)")
    n, k = {"fma": (1000, 4192), "mma": (5400, 4096), "ks": (1001, 4096), "ksx": (1000, 14336)}[kind]
    monkeypatch.setattr(cuda_gemv, "KS", kind == "ks")
    monkeypatch.setattr(cuda_gemv, "KSX", kind == "ksx")
    monkeypatch.setattr(cuda_gemv, "KS_ALL", kind == "ks")
    monkeypatch.setattr(cuda_gemv, "MMA", kind == "mma")
    monkeypatch.setattr(cuda_gemv, "FMA_ROWS" if kind == "fma" else "STEPS",
                        v if kind in ("fma", "mma") else None)
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    p, _ = _weights(n, k, g)
    codes, scales, nblk = quant_planar._views(p, FMT)
    key = cuda_gemv.choose(n, nblk, DEV)[0]
    assert key[0] == kind if kind != "fma" else key == (v, 2), key
    x = torch.randn(1, k, generator=g).bfloat16().to(DEV)
    res = (torch.randn(1, n, generator=g) * 4).bfloat16().to(DEV)
    plain = torch.full((1, n), float("nan"), dtype=torch.bfloat16, device=DEV)
    assert cuda_gemv.gemv(x, codes, scales, plain, n, nblk)
    out = torch.full_like(plain, float("nan"))
    assert cuda_gemv.gemv(x, codes, scales, out, n, nblk, res=res)
    assert torch.equal(out, plain + res)


# The hand-off between two GEMVs of model/cuda_stack.py: the FMA kernel with `norm_out` stores the
# plain residual GEMV's bits, hw = bf16(h * nw) bit for bit (torch's fp32 product, one rounding)
# and its CTAs' sums of h^2; q4_ks with `prenormed` on (hw, those sums) is then held to the
# float64 reference of W rmsnorm(h) exactly as q4_ks_norm is (the sum of h^2 in a different
# order, the same bound), and with `act` to the same GEMV followed by act_and_mul. Each FMA row
# count; the producer's rows (the next GEMV's K) of 1, 4 and 4 slices; K of the producer with a
# tail step (4,192) and of down's 448 blocks.
@pytest.mark.parametrize("rows", [1, 2, 4, "ksx"])
@pytest.mark.parametrize("n,k,m", [(32 * 4 * 4, 4192, 1002), (640, 14336, 264), (4096, 4096, 6151)])
def test_handoff_is_the_norm_split_across_two_gemvs(ready, monkeypatch, rows, n: int, k: int,
                                                     m: int) -> None:
    from flatserve.ops.triton_ops import act_and_mul

    ksx = isinstance(rows, str)
    if ksx and torch.cuda.get_device_capability(DEV)[0] < 9:
        pytest.skip("q4_ksx needs thread block clusters (sm_90)")
    monkeypatch.setattr(cuda_gemv, "KSX", ksx)
    monkeypatch.setattr(cuda_gemv, "FMA_ROWS", None if ksx else rows)
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    p, _ = _weights(n, k, g)
    q, wq = _weights(m, n, g)
    codes, scales, nblk = quant_planar._views(p, FMT)
    x = torch.randn(1, k, generator=g).bfloat16().to(DEV)
    res = (torch.randn(1, n, generator=g) * 4).bfloat16().to(DEV)
    nw = (1 + 0.3 * torch.randn(n, generator=g)).bfloat16().to(DEV)
    plain = torch.full((1, n), float("nan"), dtype=torch.bfloat16, device=DEV)
    assert cuda_gemv.gemv(x, codes, scales, plain, n, nblk, res=res)
    h, hw = torch.full_like(plain, float("nan")), torch.full_like(plain, float("nan"))
    part = torch.full((cuda_gemv.handoff_parts(n, DEV, nblk),), float("nan"), device=DEV)
    assert part.numel() == n // (8 if ksx else 4 * rows)
    assert cuda_gemv.gemv(x, codes, scales, h, n, nblk, res=res, norm_out=(nw, hw, part))
    assert torch.equal(h, plain)
    assert torch.equal(hw, (h.float() * nw.float()).bfloat16())
    ss = h.double().pow(2).sum().item()
    assert abs(part.double().sum().item() - ss) <= 2.0 ** -24 * (n // part.numel() + part.numel()) * ss
    eps = 1e-5
    qc, qs, qnblk = quant_planar._views(q, FMT)
    out = torch.full((1, m), float("nan"), dtype=torch.bfloat16, device=DEV)
    assert cuda_gemv.gemv(hw, qc, qs, out, m, qnblk, prenormed=(part, eps))
    r = 1 / (h.double().pow(2).mean() + eps).sqrt().item()
    _check(out, hw, wq, scale=r, rel=n * 2.0 ** -24 + 2.0 ** -21, h2=bool(cuda_gemv.H2))
    if m % 2 == 0:
        a = torch.full((1, m // 2), float("nan"), dtype=torch.bfloat16, device=DEV)
        assert cuda_gemv.gemv(hw, qc, qs, a, m, qnblk, prenormed=(part, eps), act="silu")
        ref = act_and_mul(out, "silu").float()
        assert ((a.float() - ref).abs() <= 2.0 ** -6 * ref.abs()).all()
        assert (a.float() == ref).float().mean() > 0.9


def test_handoff_parts_need_whole_ctas(monkeypatch) -> None:
    """o's and down's rows split evenly into q4_ksx's row groups (8 rows, sm_90) or the FMA
    kernel's CTAs, else no hand-off; none where o and down would take different kernels."""
    ksx = torch.cuda.get_device_capability(DEV)[0] >= 9
    for n in (64, 640, 4096, 5120):
        if ksx:
            assert cuda_gemv.handoff_parts(n, DEV, 128, 448) * cuda_gemv.KS_ROWS == n
        monkeypatch.setattr(cuda_gemv, "KSX", False)
        assert cuda_gemv.handoff_parts(n, DEV, 128, 448) * 4 * cuda_gemv.fma_rows(n, DEV) == n
        monkeypatch.setattr(cuda_gemv, "KSX", True)
    assert cuda_gemv.handoff_parts(4100, DEV, 128) == 0
    if ksx:  # o by q4_ksx, down (1,025 blocks) by the FMA kernel
        assert cuda_gemv.handoff_parts(4096, DEV, 128, 1025) == 0


def test_ks_takes_large_weights_of_k_up_to_4096(ready) -> None:
    """From 40 x the SMs rows (where the tensor-core kernel ran before) and K <= 4,096 only."""
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    assert cuda_gemv.choose(40 * sms, 128, DEV)[0] == ("ks", cuda_gemv.KS_ROWS)
    assert cuda_gemv.choose(40 * sms - 1, 128, DEV)[0][0] != "ks"
    assert cuda_gemv.choose(40 * sms, 129, DEV)[0][0] != "ks"


def _gemv_against_reference(n: int, k: int, want: tuple | None) -> None:
    """One GEMV through gemv() (asserting its kernel where `want` names one) against _check, then
    through qgemm, which takes the same kernel at one row: the same bits."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    p, w = _weights(n, k, g)
    x = torch.randn(1, k, generator=g).bfloat16().to(DEV)
    codes, scales, nblk = quant_planar._views(p, FMT)
    key = cuda_gemv.choose(n, nblk, DEV)[0]
    if want is not None:
        assert key == want, key
    out = torch.full((1, n), float("nan"), dtype=torch.bfloat16, device=DEV)
    assert cuda_gemv.gemv(x, codes, scales, out, n, nblk)
    _check(out, x, w, scales if key[0] == "mma" else None, h2=cuda_gemv.fp16_products(key))
    via = torch.full((1, n), float("nan"), dtype=torch.bfloat16, device=DEV)
    quant_planar.qgemm(x, p, FMT, via)
    assert torch.equal(via, out)


def test_both_load_group_sizes_give_the_same_bits(ready, monkeypatch) -> None:
    """The tensor-core kernel's two register buffers change when the loads issue, not the
    arithmetic or its order: 2 and 4 steps a group, and the one-wave rule's own pick, give the
    same bits."""
    monkeypatch.setattr(cuda_gemv, "KS", False)
    monkeypatch.setattr(cuda_gemv, "KSX", False)
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    for n, k in ((6151, 4096), (5600, 1536), (5400, 14336)):
        p, _ = _weights(n, k, g)
        codes, scales, nblk = quant_planar._views(p, FMT)
        x = torch.randn(1, k, generator=g).bfloat16().to(DEV)
        outs = []
        for steps in (2, 4, None):
            monkeypatch.setattr(cuda_gemv, "STEPS", steps)
            assert cuda_gemv.choose(n, nblk, DEV)[0][0] == "mma"
            out = torch.full((1, n), float("nan"), dtype=torch.bfloat16, device=DEV)
            assert cuda_gemv.gemv(x, codes, scales, out, n, nblk)
            outs.append(out)
        assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2]), (n, k)


def test_fma_rows_keep_every_sm_busy() -> None:
    """4 rows a warp where the grid still has a CTA for every SM, fewer below."""
    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    assert [cuda_gemv.fma_rows(n, DEV) for n in (16 * sms, 16 * sms - 1, 8 * sms - 1, 64)] == [4, 2, 1, 1]


def test_gemv_in_a_cuda_graph_replays_with_new_activations(ready) -> None:
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    n, k = 6151, 4096
    p, w = _weights(n, k, g)
    x = torch.randn(1, k, generator=g).bfloat16().to(DEV)
    out = torch.empty(1, n, dtype=torch.bfloat16, device=DEV)
    quant_planar.qgemm(x, p, FMT, out)  # warm-up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        quant_planar.qgemm(x, p, FMT, out)
    for _ in range(2):
        x.copy_(torch.randn(1, k, generator=g).bfloat16())
        out.fill_(float("nan"))
        graph.replay()
        eager = torch.empty_like(out)
        quant_planar.qgemm(x, p, FMT, eager)
        assert torch.equal(out, eager)
        _check(out, x, w, mma_scales(p), h2=fp16(p))


def test_unaligned_or_disabled_falls_back_to_triton(ready, monkeypatch) -> None:
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    n, k = 70, 1024
    p, w = _weights(n, k, g)
    codes, scales, nblk = quant_planar._views(p, FMT)
    buf = torch.randn(1, k + 8, generator=g).bfloat16().to(DEV)
    x = buf[:, 1:1 + k]  # 2 bytes past a 16-byte boundary
    out = torch.full((1, n), float("nan"), dtype=torch.bfloat16, device=DEV)
    assert not cuda_gemv.gemv(x, codes, scales, out, n, nblk) and torch.isnan(out).all()
    quant_planar.qgemm(x, p, FMT, out)
    _check(out, x, w)
    monkeypatch.setattr(cuda_gemv, "ENABLED", False)
    monkeypatch.setattr(cuda_gemv, "_API", None)
    assert not cuda_gemv.prepare(DEV)
    x = buf[:, :k]
    out.fill_(float("nan"))
    quant_planar.qgemm(x, p, FMT, out)
    _check(out, x, w)


def test_a_failed_build_is_reported_once_and_remembered(monkeypatch, caplog) -> None:
    class Broken:
        def __init__(self) -> None:
            raise OSError("no libnvrtc (a test)")

    monkeypatch.setattr(cuda_gemv, "_API", None)
    monkeypatch.setattr(cuda_gemv, "_FAILED", None)
    monkeypatch.setattr(cuda_gemv, "_Api", Broken)
    with caplog.at_level(logging.WARNING, logger="flatserve"):
        assert not cuda_gemv.prepare(DEV) and not cuda_gemv.prepare(DEV)
    assert [r.getMessage() for r in caplog.records if "GEMV in CUDA C++" in r.getMessage()] == \
        ["q4_0 one-row GEMV in CUDA C++ unavailable (no libnvrtc (a test)); the Triton GEMV is used"]
    x = torch.randn(1, 256).bfloat16().to(DEV)
    g = torch.Generator().manual_seed(1)
    p, w = _weights(40, 256, g)
    out = torch.full((1, 40), float("nan"), dtype=torch.bfloat16, device=DEV)
    quant_planar.qgemm(x, p, FMT, out)  # the Triton GEMV
    _check(out, x, w)


def test_the_cubin_is_built_once_then_read_from_the_kernel_cache(ready, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    major, minor = torch.cuda.get_device_capability(DEV)
    api = cuda_gemv._API
    first = api.cubin(f"sm_{major}{minor}")
    files = list((tmp_path / "flatserve").glob("q4_gemv_cuda-*.cubin"))
    assert len(files) == 1 and files[0].read_bytes() == first

    def no_build(arch: str) -> bytes:
        raise AssertionError("built again although the cache holds it")

    monkeypatch.setattr(api, "compile", no_build)
    assert api.cubin(f"sm_{major}{minor}") == first


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")
def test_gemv_on_a_second_gpu_uses_that_devices_kernels(ready) -> None:
    """A data-parallel replica's GPU, cuda:1 (current, as start-up sets it): the module is loaded
    into that device's context and the launch lands there, both kernels."""
    dev1 = torch.device("cuda", 1)
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    with torch.cuda.device(dev1):
        assert cuda_gemv.prepare(dev1) and 1 in cuda_gemv._API.funcs
        for n, k in ((1000, 4096), (6151, 4096), (1000, 14336)):  # q4_ksx (FMA below sm_90), q4_ks, q4_ksx
            raw = random_blocks(FMT, n, k, seed=int(torch.randint(0, 2**31, (1,), generator=g)))
            p, w = quant_planar.repack(raw.to(dev1), FMT), dequantize(raw, FMT, k).double()
            x = torch.randn(1, k, generator=g).bfloat16().to(dev1)
            codes, scales, nblk = quant_planar._views(p, FMT)
            out = torch.full((1, n), float("nan"), dtype=torch.bfloat16, device=dev1)
            assert cuda_gemv.gemv(x, codes, scales, out, n, nblk)
            torch.cuda.synchronize(dev1)
            _check(out, x, w, mma_scales(p), h2=fp16(p))
