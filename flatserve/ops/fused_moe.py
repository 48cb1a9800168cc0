"""Fused MoE on CUDA in Triton: routing, one sort by expert, two grouped GEMM launches.

Per layer, over the flat batch x [T, H] with top-k routing (N = T * k (token, expert) pairs):

  1. router logits = F.linear(x, W_r, b_r) (cuBLAS), then `_route_kernel` (one program per
     token): softmax + top-k (+ renormalize) for Qwen3-MoE, or top-k + softmax over the k for
     GPT-OSS -> weights [T, k] fp32, ids [T, k] int32.
  2. `align_by_expert`: the pairs sorted by expert once, each expert's run padded to a multiple of
     BLOCK_M. Every shape is a function of T alone (the padded length is N + E * (BLOCK_M - 1)), so
     the step holds no host sync and replays inside a CUDA graph:

         sorted_ids  | e0 pairs ..... pad | e2 pairs pad | (e1 got none: no block) | unused ...
         block_expert|   0    |    0     |      2       |                         |  E (exit)

  3. `_moe_gemm_kernel` for gate_up over all experts in one launch: a program owns BLOCK_M rows of
     one expert and BLOCK_N columns of both gate and up, applies the activation (SiLU, or GPT-OSS's
     clamped SwiGLU) in its epilogue and writes act(gate) * up [N, I] in pair order.
  4. the same kernel for down (bias, times the routing weight) -> [N, H] in pair order.
  5. out = sum over each token's k rows ([T, k, H] -> [T, H]): the weighted sum in token order.

Each expert's weights are read once per step by the programs of its row blocks, whatever the
number of tokens routed to it; experts that get no token cost no program past the first check.
The torch reference is `flatserve.model.moe.moe_ref` (checked in tests/ops/test_fused_moe.py).
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from flatserve.model.config import MoeConfig


@triton.jit
def _route_kernel(logits_ptr, w_ptr, id_ptr, E, stride_l,
                  K: tl.constexpr, K_P: tl.constexpr, E_P: tl.constexpr,
                  SOFTMAX_FIRST: tl.constexpr, NORM: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    e = tl.arange(0, E_P)
    x = tl.load(logits_ptr + t * stride_l + e, mask=e < E, other=float("-inf")).to(tl.float32)
    if SOFTMAX_FIRST:  # Qwen3-MoE: probabilities over all experts, then the top k of those
        x = tl.exp(x - tl.max(x, 0))
        x = x / tl.sum(x, 0)
    slot = tl.arange(0, K_P)
    vals = tl.zeros([K_P], tl.float32)
    ids = tl.zeros([K_P], tl.int32)
    for i in tl.static_range(K):  # k rounds of argmax; ties go to the lowest expert id
        m = tl.max(x, 0)
        idx = tl.min(tl.where(x == m, e, E_P), 0)
        vals = tl.where(slot == i, m, vals)
        ids = tl.where(slot == i, idx, ids)
        x = tl.where(e == idx, float("-inf"), x)
    if SOFTMAX_FIRST:
        if NORM:
            vals = vals / tl.sum(tl.where(slot < K, vals, 0.0), 0)
    else:  # GPT-OSS: softmax over the k chosen logits (the first is their max)
        vals = tl.where(slot < K, tl.exp(vals - tl.max(tl.where(slot < K, vals, float("-inf")), 0)), 0.0)
        vals = vals / tl.sum(vals, 0)
    tl.store(w_ptr + t * K + slot, vals, mask=slot < K)
    tl.store(id_ptr + t * K + slot, ids, mask=slot < K)


def route(x: torch.Tensor, rw: torch.Tensor, rb: torch.Tensor | None, moe: MoeConfig
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, H] -> (weights [T, k] fp32, expert ids [T, k] int32)."""
    logits = F.linear(x, rw, rb)  # [T, E]
    T, E = logits.shape
    w = torch.empty(T, moe.top_k, dtype=torch.float32, device=x.device)
    ids = torch.empty(T, moe.top_k, dtype=torch.int32, device=x.device)
    if T:
        _route_kernel[(T,)](logits, w, ids, E, logits.stride(0), K=moe.top_k,
                            K_P=triton.next_power_of_2(moe.top_k), E_P=triton.next_power_of_2(E),
                            SOFTMAX_FIRST=moe.router == "softmax_topk", NORM=moe.norm_topk_prob)
    return w, ids


def align_by_expert(ids: torch.Tensor, num_experts: int, block_m: int
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """ids [T, k] -> (sorted_ids [P] int32: pair indices grouped by expert, each group padded to a
    multiple of block_m with N (a pair that does not exist); block_expert [P / block_m] int32: the
    expert of each row block, num_experts past the last used block). P = N + E * (block_m - 1)
    rounded up to block_m: static for a given T, no host sync."""
    flat = ids.flatten().long()  # [N]
    N, dev = flat.numel(), ids.device
    counts = torch.zeros(num_experts, dtype=torch.int64, device=dev)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = torch.cumsum(padded, 0)  # [E]
    order = torch.sort(flat, stable=True).indices  # pairs by expert, token order inside
    e_sorted = flat[order]
    rank = torch.arange(N, device=dev) - (torch.cumsum(counts, 0) - counts)[e_sorted]
    P = -(-(N + num_experts * (block_m - 1)) // block_m) * block_m
    sorted_ids = torch.full((P,), N, dtype=torch.int32, device=dev)
    sorted_ids[(pad_end - padded)[e_sorted] + rank] = order.to(torch.int32)
    starts = torch.arange(0, P, block_m, device=dev)
    block_expert = torch.searchsorted(pad_end, starts, right=True).to(torch.int32)
    return sorted_ids, block_expert


@triton.jit
def _moe_gemm_kernel(a_ptr, w_ptr, b_ptr, c_ptr, topw_ptr, sorted_ptr, block_e_ptr,
                     num_pairs, num_experts, n_out, k_dim, up_off, limit, alpha,
                     stride_am, stride_we, stride_wn, stride_be, stride_cm,
                     A_DIV: tl.constexpr, GATED: tl.constexpr, CLAMP: tl.constexpr,
                     HAS_BIAS: tl.constexpr, MUL_W: tl.constexpr, IEEE: tl.constexpr,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """C[pair, n] = epilogue(A[pair // A_DIV] . W[e, n]) for the BLOCK_M pairs of one expert's
    row block. W is [E, n_out (+ up_off rows of up), k_dim] (F.linear layout, k contiguous)."""
    pid = tl.program_id(0)
    n_blocks = tl.cdiv(n_out, BLOCK_N)
    pid_m = pid // n_blocks
    pid_n = pid % n_blocks
    e = tl.load(block_e_ptr + pid_m).to(tl.int64)
    if e >= num_experts:
        return  # past the last used row block
    pair = tl.load(sorted_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    row_ok = pair < num_pairs
    a_row = (pair // A_DIV).to(tl.int64)
    n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < n_out
    kk = tl.arange(0, BLOCK_K)
    a_base = a_ptr + a_row[:, None] * stride_am
    w_base = w_ptr + e * stride_we + n[None, :].to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, k_dim, BLOCK_K):
        k_ok = k0 + kk < k_dim
        a = tl.load(a_base + (k0 + kk)[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_base + (k0 + kk)[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if IEEE:
            acc += tl.dot(a, w, input_precision="ieee")
        else:
            acc += tl.dot(a, w)
        if GATED:
            wu = tl.load(w_base + up_off * stride_wn + (k0 + kk)[:, None],
                         mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            if IEEE:
                acc_up += tl.dot(a, wu, input_precision="ieee")
            else:
                acc_up += tl.dot(a, wu)
    if HAS_BIAS:
        acc += tl.load(b_ptr + e * stride_be + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(b_ptr + e * stride_be + up_off + n, mask=n_ok,
                              other=0.0).to(tl.float32)[None, :]
    if GATED:
        if CLAMP:  # GPT-OSS: gate <= limit, |up| <= limit, gate * sigmoid(alpha gate) * (up + 1)
            g = tl.minimum(acc, limit)
            u = tl.minimum(tl.maximum(acc_up, -limit), limit)
            acc = g * tl.sigmoid(g * alpha) * (u + 1.0)
        else:  # SiLU(gate) * up
            acc = acc * tl.sigmoid(acc) * acc_up
    if MUL_W:
        acc = acc * tl.load(topw_ptr + pair, mask=row_ok, other=0.0)[:, None]
    tl.store(c_ptr + pair[:, None].to(tl.int64) * stride_cm + n[None, :], acc.to(c_ptr.dtype.element_ty),
             mask=row_ok[:, None] & n_ok[None, :])


# (BLOCK_N, BLOCK_K, warps, stages) per BLOCK_M; env override for sweeps on the device.
# 128-row tiles: benchmarks/dev/moe_gemm_sweep.py at 32,768 tokens on an H100 (2026-11-26)
# gave gate_up 605 vs 403 TFLOP/s and down 485 vs 357 (Qwen3-30B-A3B experts), 579 vs 388
# and 512 vs 351 (GPT-OSS-20B) against 64-row tiles; at 512 tokens every tile ties.
GEMM_CFG = {16: (64, 128, 4, 3), 32: (64, 128, 4, 3), 64: (128, 64, 4, 3), 128: (128, 64, 8, 3)}
if os.environ.get("FLATSERVE_MOE_CFG"):
    _c = tuple(int(v) for v in os.environ["FLATSERVE_MOE_CFG"].split(","))
    GEMM_CFG = {m: _c for m in GEMM_CFG}


def block_m_for(num_pairs: int, num_experts: int, elem_bytes: int = 2) -> int:
    """Rows per program from the mean rows per expert (host ints only): decode batches leave
    most experts with a few rows, where 64-row tiles would be mostly padding. 128-row tiles
    only for 16-bit inputs: fp32's gated tiles (A 128x64 + gate and up 64x128, 3 stages) need
    294 KB of shared memory, past an H100's 227 KB."""
    mean = num_pairs / num_experts
    if mean > 256 and elem_bytes <= 2:
        return 128
    return 16 if mean <= 16 else (32 if mean <= 64 else 64)


def grouped_gemm(a: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, out: torch.Tensor,
                 sorted_ids: torch.Tensor, block_expert: torch.Tensor, block_m: int, a_div: int,
                 n_out: int, gated: bool = False, moe: MoeConfig | None = None,
                 topw: torch.Tensor | None = None) -> torch.Tensor:
    """One launch over every expert's row blocks: out[pair, :n_out] (see the module doc)."""
    assert a.stride(-1) == 1 and w.is_contiguous() and out.stride(-1) == 1
    E, _, K = w.shape
    bn, bk, warps, stages = GEMM_CFG[block_m]
    bk = min(bk, triton.next_power_of_2(K))
    clamp = gated and moe is not None and moe.swiglu_limit is not None
    grid = (block_expert.numel() * triton.cdiv(n_out, bn),)
    _moe_gemm_kernel[grid](
        a, w, b if b is not None else w, out, topw if topw is not None else w, sorted_ids,
        block_expert, out.shape[0], E, n_out, K, n_out if gated else 0,
        float(moe.swiglu_limit) if clamp else 0.0, float(moe.swiglu_alpha) if clamp else 0.0,
        a.stride(0), w.stride(0), w.stride(1), b.stride(0) if b is not None else 0, out.stride(0),
        A_DIV=a_div, GATED=gated, CLAMP=clamp, HAS_BIAS=b is not None, MUL_W=topw is not None,
        IEEE=a.dtype == torch.float32, BLOCK_M=block_m, BLOCK_N=bn, BLOCK_K=bk,
        num_warps=warps, num_stages=stages)
    return out


def fused_moe(x: torch.Tensor, rw: torch.Tensor, rb: torch.Tensor | None, wgu: torch.Tensor,
              bgu: torch.Tensor | None, wd: torch.Tensor, bd: torch.Tensor | None,
              moe: MoeConfig) -> torch.Tensor:
    """x [T, H] -> [T, H]; weights as flatserve.model.moe.MoeMLP keeps them."""
    T, H = x.shape
    k, E, I = moe.top_k, moe.num_experts, moe.intermediate_size
    w, ids = route(x, rw, rb, moe)  # [T, k]
    block_m = block_m_for(T * k, E, x.element_size())
    sorted_ids, block_expert = align_by_expert(ids, E, block_m)
    h = torch.empty(T * k, I, dtype=x.dtype, device=x.device)  # act(gate) * up, pair order
    grouped_gemm(x, wgu, bgu, h, sorted_ids, block_expert, block_m, k, I, gated=True, moe=moe)
    y = torch.empty(T * k, H, dtype=x.dtype, device=x.device)  # weighted expert outputs
    grouped_gemm(h, wd, bd, y, sorted_ids, block_expert, block_m, 1, H, topw=w.view(-1))
    return sum_topk(y, T, k, H)


@triton.jit
def _sum_topk_kernel(y_ptr, out_ptr, H, K: tl.constexpr, BLOCK_H: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = h < H
    acc = tl.zeros([BLOCK_H], tl.float32)
    for i in tl.static_range(K):
        acc += tl.load(y_ptr + (t * K + i) * H + h, mask=ok, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * H + h, acc.to(out_ptr.dtype.element_ty), mask=ok)


def sum_topk(y: torch.Tensor, T: int, k: int, H: int) -> torch.Tensor:
    """y [T * k, H] (token t's k weighted expert outputs in rows t k ..) -> [T, H], summed in
    fp32 and rounded once (as torch's sum(1), not bit-equal to it: the additions' order
    differs); one read of y. On an H100 at 32,768 tokens (benchmarks/dev/moe_gemm_sweep.py,
    2026-11-26): 0.41 vs torch's 0.43 ms for Qwen3-30B-A3B's top 8, 0.33 vs 0.41 ms for
    GPT-OSS-20B's top 4; both read y near the copy rate."""
    out = torch.empty(T, H, dtype=y.dtype, device=y.device)
    if T == 0:
        return out
    block = min(1024, triton.next_power_of_2(H))
    _sum_topk_kernel[(T, triton.cdiv(H, block))](y, out, H, K=k, BLOCK_H=block)
    return out
