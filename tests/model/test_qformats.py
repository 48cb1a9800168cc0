"""GGUF block formats: the torch dequantization is bit-equal to the `gguf` package's on random
blocks of every type; the quantizers round-trip within their step."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from flatserve.model.qformats import FORMATS, GGUF, dequantize, quantize

gguf = pytest.importorskip("gguf")

# Byte offsets of each format's fp16 fields: random bytes there could be NaN/inf.
_F16 = {"q4_0": [0], "q5_0": [0], "q8_0": [0], "q4_k": [0, 2], "q5_k": [0, 2], "q6_k": [208],
        "q4_g": [0]}


def random_blocks(fmt, n_rows: int, k: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n_rows * (k // fmt.block), fmt.type_size), generator=g, dtype=torch.uint8)
    for off in _F16[fmt.name]:
        d = (torch.randn(raw.shape[0], generator=g) * 0.05).to(torch.float16)
        raw[:, off:off + 2] = d.reshape(-1, 1).view(torch.uint8)
    if fmt.name == "q4_g":  # zero points 0..16 (GPTQ's stored + 1 reaches 16)
        raw[:, 2] %= 17
    return raw.reshape(n_rows, -1)


@pytest.mark.parametrize("name", sorted(GGUF))
def test_dequantize_bit_equal_to_gguf(name: str) -> None:
    fmt = FORMATS[name]
    k = 512
    raw = random_blocks(fmt, 7, k, seed=fmt.ggml_type)
    ours = dequantize(raw, fmt, k)
    ref = gguf.quants.dequantize(raw.numpy(), gguf.GGMLQuantizationType(fmt.ggml_type))
    assert ref.shape == (7, k)
    assert np.array_equal(ours.numpy().view(np.uint32), ref.astype(np.float32).view(np.uint32))


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_quantize_round_trip(name: str) -> None:
    fmt = FORMATS[name]
    w = torch.randn(24, 512, generator=torch.Generator().manual_seed(3))
    back = dequantize(quantize(w, fmt), fmt, 512)
    # Relative RMS error by bits per value (4-bit ~0.1, 5-bit ~0.05, 6-bit ~0.03, 8-bit ~0.005).
    bound = {"q4_0": 0.13, "q4_k": 0.13, "q5_0": 0.07, "q5_k": 0.07, "q6_k": 0.04, "q8_0": 0.01,
             "q4_g": 0.13}[name]
    rel = ((back - w).pow(2).mean() / w.pow(2).mean()).sqrt().item()
    assert rel < bound, rel
    assert rel > bound / 20  # it is a quantization, not a copy


@pytest.mark.parametrize("name", ["q4_0", "q8_0"])
def test_torch_quantizer_bit_equal_to_gguf(name: str) -> None:
    """quantize()'s torch path (it runs on a GPU's weights) against the gguf package's numpy
    quantizer, on fresh random blocks with the edge cases: an all-zero block, a block whose
    largest magnitude appears with both signs (q4_0 takes the first), values at a rounding
    half (q8_0 rounds half away from zero), tiny and huge scales."""
    fmt = FORMATS[name]
    g = torch.Generator().manual_seed(int(np.random.SeedSequence().entropy % 2**31))
    w = torch.randn(64, 512, generator=g) * torch.logspace(-6, 4, 64)[:, None]
    w[0, :32] = 0
    w[1, :32] = torch.linspace(-1, 1, 32)
    w[1, 0], w[1, 5] = 2.0, -2.0
    w[2, :32] = torch.arange(32) - 15.5  # halves once scaled by 127 / 16.5
    ours = quantize(w, fmt)
    ref = gguf.quants.quantize(w.numpy(), gguf.GGMLQuantizationType(fmt.ggml_type))
    assert np.array_equal(ours.numpy(), ref.reshape(64, -1))
