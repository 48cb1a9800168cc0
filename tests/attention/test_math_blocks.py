"""The torch backend's maths path (sinks, softcap) in blocks of MATH_ROWS query rows (its fp32
scores would otherwise be [Hkv, n*g, L] in one piece) against the dense float64 computation."""
from __future__ import annotations

import pytest
import torch

from flatserve.attention.base import LayerAttnParams
from flatserve.attention.torch_backend import MATH_ROWS, attend_one
from tests.attention.test_torch_backend import _dense


@pytest.mark.parametrize("window,softcap", [(None, None), (40, None), (None, 20.0), (300, 30.0)])
def test_blocked_maths_path_matches_dense(window, softcap) -> None:
    g = torch.Generator().manual_seed(11)
    n, L = 2 * MATH_ROWS + 37, 2 * MATH_ROWS + 90  # three blocks continuing a context
    q = torch.randn(n, 8, 16, generator=g, dtype=torch.float64)
    k = torch.randn(L, 2, 16, generator=g, dtype=torch.float64)
    v = torch.randn(L, 2, 16, generator=g, dtype=torch.float64)
    sinks = torch.randn(8, generator=g, dtype=torch.float64)
    p = LayerAttnParams(0.25, window, softcap)
    q_start = L - n
    k_start = 0 if window is None else max(0, q_start - window + 1)
    out = attend_one(q, k[k_start:], v[k_start:], q_start, k_start, p, sinks)
    torch.testing.assert_close(out, _dense(q, k, v, q_start, p, sinks), rtol=1e-9, atol=1e-9)
