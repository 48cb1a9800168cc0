"""The Triton attention kernel under the Triton interpreter (TRITON_INTERPRET=1, CPU tensors)
against the torch backend: the head sizes and options of issue #32's families, checked where
no GPU is (tests/attention/test_kernels.py runs the full set on CUDA)."""
from __future__ import annotations

import os
import random

import pytest
import torch

from flatserve.attention.base import LayerAttnParams
from flatserve.attention.torch_backend import paged_attention_ref
from tests.attention.cases import make_case, rel_err

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="runs under TRITON_INTERPRET=1 (CUDA: test_kernels.py)")


@pytest.mark.parametrize("d,softcap,window", [
    (80, None, None), (96, None, 32), (96, 2.0, None), (256, 2.0, 32), (64, None, None)])
def test_head_sizes_softcap_window(d: int, softcap: float | None, window: int | None) -> None:
    from flatserve.attention.kernels.unified_attention import unified_attention

    q_lens = [1, 1, 40, 7]
    seq_lens = [random.randint(1, 90), random.randint(1, 90), 40, 60]
    q, kc, vc, meta = make_case(q_lens, seq_lens, 4, 2, d, 16, torch.float32, device="cpu")
    p = LayerAttnParams(d ** -0.5, window, softcap)
    out = torch.full_like(q, float("nan"))
    unified_attention(q, kc, vc, meta, p, None, out=out, segments=1)
    ref = paged_attention_ref(q, kc, vc, meta, p, None)
    assert rel_err(out, ref) < 1e-4
