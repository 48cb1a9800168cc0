"""Attention sinks in the Triton unified kernel, run on the CPU under the Triton interpreter
(TRITON_INTERPRET=1, set in a subprocess before Triton is imported) against the torch backend:
mixed decode + prefill batches, with and without a window, one and two KV segments (the sink
enters the softmax once, in segment 0, and the merge keeps it). On CUDA, tests/attention/
test_kernels.py runs the compiled kernel on the same checks."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def run_all() -> None:
    from flatserve.attention.base import LayerAttnParams
    from flatserve.attention.kernels.unified_attention import unified_attention
    from flatserve.attention.torch_backend import paged_attention_ref
    from tests.attention.cases import make_case, rel_err

    cases = [([1, 1, 1], [40, 7, 130], None, 2), ([1, 20, 1, 33], [5, 20, 90, 70], None, 1),
             ([1, 17, 1], [100, 60, 9], 24, 1), ([1, 1], [150, 3], 32, 2)]
    for q_lens, seq_lens, window, segs in cases:
        q, kc, vc, meta = make_case(q_lens, seq_lens, 4, 2, 16, 16, torch.float32, seed=7,
                                    device="cpu")
        p = LayerAttnParams(16 ** -0.5, window, None)
        sk = torch.randn(4, generator=torch.Generator().manual_seed(len(q_lens))) * 2
        for sinks in (sk, None):
            out = torch.full_like(q, float("nan"))
            unified_attention(q, kc, vc, meta, p, sinks, out=out, segments=segs)
            ref = paged_attention_ref(q.double(), kc.double(), vc.double(), meta, p, sinks)
            err = rel_err(out, ref)
            assert err < 1e-5, f"{q_lens} window={window} segments={segs} sinks={sinks is not None}: {err:.2e}"
    print("OK")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine runs the compiled kernel with "
                    "sinks (tests/attention/test_kernels.py); the interpreter check is for CPUs")
def test_unified_attention_sinks_under_triton_interpreter() -> None:
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    code = "from tests.attention.test_unified_sinks_interpreter import run_all; run_all()"
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0 and "OK" in r.stdout, r.stderr[-3000:]
