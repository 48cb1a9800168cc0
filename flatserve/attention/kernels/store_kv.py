"""KV write: new K/V rows into the paged caches by slot_mapping (slot < 0 skipped)."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flatserve.ops import pdl


@triton.jit
def _store_kv_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cb, stride_cs, stride_ch,
                     BLOCK_SIZE: tl.constexpr, HEAD: tl.constexpr, HEAD_P: tl.constexpr,
                     PDL: tl.constexpr):
    pdl.sync(PDL)
    t = tl.program_id(0)
    h = tl.program_id(1)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:  # padded CUDA-graph rows
        return
    d = tl.arange(0, HEAD_P)
    m = d < HEAD
    blk = slot // BLOCK_SIZE
    off = slot % BLOCK_SIZE
    dst = blk * stride_cb + off * stride_cs + h * stride_ch + d
    k = tl.load(k_ptr + t * stride_kt + h * stride_kh + d, mask=m)
    v = tl.load(v_ptr + t * stride_vt + h * stride_vh + d, mask=m)
    tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=m)
    tl.store(vc_ptr + dst, v.to(vc_ptr.dtype.element_ty), mask=m)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """k, v [T, Hkv, D] -> caches [num_blocks, block_size, Hkv, D]."""
    T, H, D = k.shape
    assert v.shape == k.shape and k_cache.shape == v_cache.shape
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    assert k.stride(-1) == 1 and v.stride(-1) == 1 and slot_mapping.shape == (T,)
    if T == 0:
        return
    _store_kv_kernel[(T, H)](
        k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        BLOCK_SIZE=k_cache.shape[1], HEAD=D, HEAD_P=triton.next_power_of_2(D), **pdl.launch(k.device, T))

