"""oneDNN pre-packed bf16 linears (`cpu_gemm="onednn"`): the layer against a float64 reference and
the packing of a tied head (the whole model: tests/model/test_cpu_gemm.py)."""
from __future__ import annotations

import random

import pytest
import torch
from torch import nn

from flatserve.model import onednn

needs_onednn = pytest.mark.skipif(not onednn.available(torch.bfloat16),
                                  reason="no oneDNN with native bf16 on this CPU")


@needs_onednn
@pytest.mark.parametrize("rows", [0, 1, 5, 300])
def test_onednn_linear_matches_float64_reference(rows) -> None:
    N, K = random.choice([(300, 64), (5000, 640), (640, 2048)])
    w = (torch.randn(N, K) * torch.rand(N, 1) * 3).bfloat16()
    bias = torch.randn(N).bfloat16()
    x = torch.randn(2, rows, K).bfloat16()  # leading dims are flattened and restored
    got = onednn.OneDNNLinear(w, bias)(x)
    assert got.shape == (2, rows, N) and got.dtype == torch.bfloat16
    if rows == 0:
        return
    ref = x.double() @ w.double().t() + bias.double()
    plain = nn.functional.linear(x, w, bias).double()
    err = ((got.double() - ref).norm() / ref.norm()).item()
    err_plain = ((plain - ref).norm() / ref.norm()).item()
    # bf16 output rounding alone is ~2e-3 relative; the packed path may not be worse than F.linear.
    assert err < 1e-2 and err <= 1.5 * err_plain + 1e-4


@needs_onednn
def test_pack_linears_counts_a_tied_head_once_more() -> None:
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.model = nn.Module()
            self.model.embed_tokens = nn.Embedding(1000, 64, dtype=torch.bfloat16)
            self.model.proj = nn.Linear(64, 64, dtype=torch.bfloat16)
            self.lm_head = nn.Linear(64, 1000, bias=False, dtype=torch.bfloat16)
            self.lm_head.weight = self.model.embed_tokens.weight

    m = M()
    assert onednn.pack_linears(m) == 1000 * 64 * 2
    assert isinstance(m.lm_head, onednn.OneDNNLinear) and isinstance(m.model.proj, onednn.OneDNNLinear)
    assert m.model.embed_tokens.weight.shape == (1000, 64)  # the lookup keeps its plain rows
