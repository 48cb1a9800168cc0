"""The Triton quantized GEMM (flatserve/model/quant_triton.py) against the torch reference
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
from flatserve.model import quant, quant_triton
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
