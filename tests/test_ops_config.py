"""Choosing fused ops by name (CPU: the names, the errors, the torch default)."""
from __future__ import annotations

import pytest

from flatserve.ops import FUSED_OPS, parse_fused_ops


def test_auto_follows_the_backend() -> None:
    assert parse_fused_ops("auto", "triton") == frozenset(FUSED_OPS)
    assert parse_fused_ops("auto", "torch") == frozenset()
    assert parse_fused_ops("none", "triton") == frozenset()
    assert parse_fused_ops("rope, act", "triton") == frozenset({"rope", "act"})
    # Both C++ attention backends take the C++ fused ops (cpu-sdpa differs only in its prefill).
    assert parse_fused_ops("auto", "cpu-sdpa") == parse_fused_ops("auto", "cpu")


def test_bad_names_and_backends_are_refused() -> None:
    with pytest.raises(ValueError, match="unknown fused op.*rmsnrom"):
        parse_fused_ops("rmsnrom", "triton")
    with pytest.raises(ValueError, match="need the triton .CUDA. or a C.. .cpu, cpu-sdpa."):
        parse_fused_ops("act", "torch")


def test_a_backend_on_the_wrong_device_is_refused_before_loading() -> None:
    from flatserve import LLM

    with pytest.raises(ValueError, match="attention backend 'triton' runs on cuda, but the device is cpu"):
        LLM(model="/nonexistent/model", device="cpu", attention_backend="triton")


