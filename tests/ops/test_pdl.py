"""Programmatic dependent launch (flatserve/ops/pdl.py, device.programmatic_launch): a kernel that
starts before the one it follows has finished must still read that kernel's writes, and a kernel
two launches back (the waits chain). A chain of PDL kernels, eager and in a CUDA graph replayed
with new inputs, must give the same bits as with PDL off (FLATSERVE_PDL=0), and the GEMV's
output must match a float64 reference. Needs an sm_90 GPU and a Triton that launches PDL."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")
if not torch.cuda.is_available():
    pytest.skip("needs CUDA (PDL is a CUDA launch mode)", allow_module_level=True)

from flatserve import device as dev  # noqa: E402
from flatserve.model import cuda_gemv, quant_planar  # noqa: E402
from flatserve.ops import triton_ops  # noqa: E402
from tests.model.test_cuda_gemv import FMT, _check, _weights, mma_scales  # noqa: E402

DEV = torch.device("cuda")
H, I = 4096, 14336  # Llama-3-8B's hidden and MLP sizes: gate|up (28,672 x 4,096) runs ~30 us


@pytest.fixture(scope="module")
def ready() -> None:
    if not dev.programmatic_launch(DEV):
        pytest.skip("no PDL here: it needs sm_90 or later and a Triton with launch_pdl")
    if not cuda_gemv.prepare(DEV):
        pytest.skip(f"the CUDA C++ GEMV did not build here: {cuda_gemv._FAILED}")


def _gemv(x: torch.Tensor, p: torch.Tensor, out: torch.Tensor) -> None:
    codes, scales, nblk = quant_planar._views(p, FMT)
    assert cuda_gemv.gemv(x, codes, scales, out, p.shape[0], nblk)


def _chain(x: torch.Tensor, z: torch.Tensor, res: torch.Tensor, w: torch.Tensor, p_gu: torch.Tensor,
           p_down: torch.Tensor, gu: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One-row kernels, all PDL: a long GEMV, a norm of another row (residual added in place),
    act-and-mul of the GEMV's output (written two launches back: the waits chain), then a GEMV
    of that (written by the kernel just before)."""
    _gemv(x, p_gu, gu)
    y = triton_ops.rms_norm(z, w, 1e-6, False, residual=res)
    a = triton_ops.act_and_mul(gu, "silu")
    _gemv(a, p_down, out)
    return y, a


def _fresh(g: torch.Generator) -> list[torch.Tensor]:
    return [torch.randn(1, n, generator=g).bfloat16().to(DEV) for n in (H, H, H)]


def _setup(g: torch.Generator) -> tuple:
    (p_gu, _), (p_down, wd) = _weights(2 * I, H, g), _weights(H, I, g)
    w = (1 + 0.1 * torch.randn(H, generator=g)).bfloat16().to(DEV)
    gu = torch.empty(1, 2 * I, dtype=torch.bfloat16, device=DEV)
    return p_gu, p_down, wd, w, gu


def test_pdl_chain_gives_the_bits_of_plain_launches(ready, monkeypatch) -> None:
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    p_gu, p_down, wd, w, gu = _setup(g)
    x, z, res = _fresh(g)
    runs = {}
    for pdl in ("1", "0"):
        monkeypatch.setenv("FLATSERVE_PDL", pdl)
        r = res.clone()
        gu.fill_(float("nan"))
        out = torch.full((1, H), float("nan"), dtype=torch.bfloat16, device=DEV)
        y, a = _chain(x, z, r, w, p_gu, p_down, gu, out)
        runs[pdl] = (y, a, r, out, gu.clone())
    for u, v in zip(runs["1"], runs["0"]):
        assert torch.equal(u, v)
    _check(runs["1"][3], runs["1"][1], wd, mma_scales(p_down))


def test_pdl_chain_in_a_cuda_graph_replays_with_new_inputs(ready, monkeypatch) -> None:
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    p_gu, p_down, wd, w, gu = _setup(g)
    x, z, res = _fresh(g)
    out = torch.empty(1, H, dtype=torch.bfloat16, device=DEV)
    monkeypatch.setenv("FLATSERVE_PDL", "1")
    _chain(x, z, res.clone(), w, p_gu, p_down, gu, out)  # compile outside the capture
    r = res.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, a = _chain(x, z, r, w, p_gu, p_down, gu, out)
    for _ in range(3):
        for t, f in zip((x, z, res), _fresh(g)):
            t.copy_(f)
        r.copy_(res)
        out.fill_(float("nan"))
        graph.replay()
        monkeypatch.setenv("FLATSERVE_PDL", "0")
        r0, out0, gu0 = res.clone(), torch.empty_like(out), torch.empty_like(gu)
        y0, a0 = _chain(x, z, r0, w, p_gu, p_down, gu0, out0)
        monkeypatch.setenv("FLATSERVE_PDL", "1")
        torch.cuda.synchronize()
        assert torch.equal(y, y0) and torch.equal(a, a0) and torch.equal(r, r0)
        assert torch.equal(out, out0)
        _check(out, a0, wd, mma_scales(p_down))
