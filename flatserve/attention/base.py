"""The attention backend interface and its by-name registry (backends imported lazily)."""
from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Protocol

import torch

from flatserve.attention.metadata import AttentionMetadata


@dataclass(frozen=True, slots=True)
class LayerAttnParams:
    scale: float
    sliding_window: int | None = None  # keys with pos > q_pos - window are visible
    softcap: float | None = None


class AttentionBackend(Protocol):
    name: str

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, p: LayerAttnParams) -> torch.Tensor:
        """Write k/v [T, Hkv, D] into the caches by slot_mapping, attend q [T, Hq, D] -> [T, Hq, D]."""
        ...


_BACKENDS = {
    "torch": ("flatserve.attention.torch_backend", "TorchAttentionBackend"),
    "cpu": ("flatserve.attention.cpu_backend", "CpuAttentionBackend"),
    "cpu-sdpa": ("flatserve.attention.cpu_backend", "CpuSdpaPrefillBackend"),
    "triton": ("flatserve.attention.triton_backend", "TritonAttentionBackend"),
}


def get_backend(name: str) -> AttentionBackend:
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {sorted(_BACKENDS)}")
    module, cls = _BACKENDS[name]
    return getattr(importlib.import_module(module), cls)()
