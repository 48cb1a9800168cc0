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
ROWS, H, N = 8192, 4096, 6151  # the norm over 8,192 rows takes tens of us: the GEMV waits on it


@pytest.fixture(scope="module")
def ready() -> None:
    if not dev.programmatic_launch(DEV):
        pytest.skip("no PDL here: it needs sm_90 or later and a Triton with launch_pdl")
    if not cuda_gemv.prepare(DEV):
        pytest.skip(f"the CUDA C++ GEMV did not build here: {cuda_gemv._FAILED}")


def _chain(big: torch.Tensor, res: torch.Tensor, w: torch.Tensor, small: torch.Tensor,
           p: torch.Tensor, out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A long norm (residual added in place), a short kernel, then the GEMV on the norm's last
    row: the GEMV's wait covers the act kernel, whose wait covers the norm."""
    y = triton_ops.rms_norm(big, w, 1e-6, False, residual=res)
    z = triton_ops.act_and_mul(small, "silu")
    codes, scales, nblk = quant_planar._views(p, FMT)
    assert cuda_gemv.gemv(y[-1:], codes, scales, out, N, nblk)
    return y, z


def _inputs(g: torch.Generator) -> list[torch.Tensor]:
    return [torch.randn(ROWS, H, generator=g).bfloat16().to(DEV),
            torch.randn(ROWS, H, generator=g).bfloat16().to(DEV),
            torch.randn(1, 2 * 14336, generator=g).bfloat16().to(DEV)]


def test_pdl_chain_gives_the_bits_of_plain_launches(ready, monkeypatch) -> None:
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    p, wd = _weights(N, H, g)
    w = (1 + 0.1 * torch.randn(H, generator=g)).bfloat16().to(DEV)
    big, res, small = _inputs(g)
    runs = {}
    for pdl in ("1", "0"):
        monkeypatch.setenv("FLATSERVE_PDL", pdl)
        r = res.clone()
        out = torch.full((1, N), float("nan"), dtype=torch.bfloat16, device=DEV)
        y, z = _chain(big, r, w, small, p, out)
        runs[pdl] = (y, z, r, out)
    for a, b in zip(runs["1"], runs["0"]):
        assert torch.equal(a, b)
    _check(runs["1"][3], runs["1"][0][-1:], wd, mma_scales(p))


def test_pdl_chain_in_a_cuda_graph_replays_with_new_inputs(ready, monkeypatch) -> None:
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    p, wd = _weights(N, H, g)
    w = (1 + 0.1 * torch.randn(H, generator=g)).bfloat16().to(DEV)
    big, res, small = _inputs(g)
    out = torch.empty(1, N, dtype=torch.bfloat16, device=DEV)
    monkeypatch.setenv("FLATSERVE_PDL", "1")
    _chain(big, res.clone(), w, small, p, out)  # compile outside the capture
    r = res.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y, z = _chain(big, r, w, small, p, out)
    for _ in range(3):
        fresh = _inputs(g)
        for t, f in zip((big, res, small), fresh):
            t.copy_(f)
        r.copy_(res)
        out.fill_(float("nan"))
        graph.replay()
        monkeypatch.setenv("FLATSERVE_PDL", "0")
        r0, out0 = res.clone(), torch.empty_like(out)
        y0, z0 = _chain(big, r0, w, small, p, out0)
        monkeypatch.setenv("FLATSERVE_PDL", "1")
        torch.cuda.synchronize()
        assert torch.equal(y, y0) and torch.equal(z, z0) and torch.equal(r, r0)
        assert torch.equal(out, out0)
        _check(out, y0[-1:], wd, mma_scales(p))
