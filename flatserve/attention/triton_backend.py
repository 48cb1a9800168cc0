"""CUDA attention backend: Triton KV write + one unified paged varlen attention launch."""
from __future__ import annotations

import torch

from flatserve.attention.base import LayerAttnParams
from flatserve.attention.metadata import AttentionMetadata


class TritonAttentionBackend:
    name = "triton"

    def __init__(self) -> None:
        # Imported here, not at module top: `import flatserve` never needs Triton.
        from flatserve.attention.kernels import decode_attention as da
        from flatserve.attention.kernels.store_kv import store_kv
        from flatserve.attention.kernels.unified_attention import unified_attention

        self._store, self._attend = store_kv, unified_attention
        self._decode, self.decode_fits = da.decode_attention, da.use

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                p: LayerAttnParams, sinks: torch.Tensor | None = None) -> torch.Tensor:
        self._store(k, v, k_cache, v_cache, meta.slot_mapping)
        return self._attend(q, k_cache, v_cache, meta, p, sinks)

    def attend(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata, p: LayerAttnParams, sinks: torch.Tensor | None = None
               ) -> torch.Tensor:
        """`forward` without the KV write: the fused rope op (triton_ops.qk_norm_rope) made it."""
        return self._attend(q, k_cache, v_cache, meta, p, sinks)

    def decode_rope(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor, meta: AttentionMetadata, p: LayerAttnParams, rope: tuple,
                    sinks: torch.Tensor | None = None) -> torch.Tensor:
        """A decode-only step where `decode_fits`: rope, KV write, attention and the split-KV
        merge in one launch (kernels/decode_attention.py); q, k, v before rope."""
        return self._decode(q, k, v, k_cache, v_cache, meta, p, rope, sinks)
