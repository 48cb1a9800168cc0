"""Fused elementwise Triton kernels for the CUDA path; the torch layers are their reference.

Why: a decode step of a 28-layer model ran ~50 small kernels per layer (RMSNorm alone is 8:
cast, pow, mean, add, rsqrt, mul, cast, mul), ~1,500 launches at ~3 us each even inside a CUDA
graph, against a 1.2 ms memory floor (docs/benchmarks/gpu.md). Each kernel here rounds where
the torch layer rounds (every bf16 op result), so outputs match the torch path bit for bit in
most rows; reduction order differs (a sum over D in one program vs torch's), so a rare row
differs by one bf16 ulp.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _round(x, dtype: tl.constexpr):
    """Round an fp32 value to the model dtype and back (where a torch op would store it).

    bf16 by integer round-to-nearest-even on the bits: the same answer on every backend (the
    Triton interpreter truncates in `.to(tl.bfloat16)`); finite values only, as here."""
    if dtype == tl.bfloat16:
        b = x.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
        return b.to(tl.float32, bitcast=True)
    elif dtype == tl.float16:
        return x.to(tl.float16).to(tl.float32)
    else:
        return x


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, y_ptr, stride_x, stride_r, stride_y, N, eps,
                     HAS_RES: tl.constexpr, OFFSET: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    m = cols < N
    dt = y_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=m, other=0.0).to(tl.float32)
    if HAS_RES:  # residual += x (one rounding, as torch's add), then normalise the sum
        r = tl.load(res_ptr + row * stride_r + cols, mask=m, other=0.0).to(tl.float32)
        x = _round(x + r, dt)
        tl.store(res_ptr + row * stride_r + cols, x.to(dt), mask=m)  # exact: already rounded
    inv = tl.rsqrt(tl.sum(x * x, 0) / N + eps)
    w = tl.load(w_ptr + cols, mask=m, other=0.0).to(tl.float32)
    if OFFSET:  # Gemma: x * inv * (1 + w) in fp32, one rounding
        y = x * inv * (1.0 + w)
    else:  # Llama/Qwen: w * round(x * inv)
        y = w * _round(x * inv, dt)
    tl.store(y_ptr + row * stride_y + cols, _round(y, dt).to(dt), mask=m)


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, offset: bool,
             residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [N, H] (rows contiguous) -> [N, H]. With `residual`: residual += x in place first."""
    N, H = x.shape
    assert x.stride(-1) == 1 and (residual is None or residual.stride(-1) == 1)
    y = torch.empty(N, H, dtype=x.dtype, device=x.device)
    if N == 0:
        return y
    r = residual if residual is not None else x
    block = triton.next_power_of_2(H)
    _rms_norm_kernel[(N,)](x, r, w, y, x.stride(0), r.stride(0), y.stride(0), H, eps,
                           HAS_RES=residual is not None, OFFSET=offset, BLOCK=block,
                           num_warps=4 if block >= 2048 else 2)
    return y


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, pos_ptr, cs_ptr, qw_ptr, kw_ptr,
                         stride_qt, stride_qh, stride_kt, stride_kh, table_len, Hq, eps,
                         NORM: tl.constexpr, OFFSET: tl.constexpr, HALF: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    if h < Hq:
        base = q_ptr + t * stride_qt + h * stride_qh
        w_ptr = qw_ptr
    else:
        base = k_ptr + t * stride_kt + (h - Hq) * stride_kh
        w_ptr = kw_ptr
    dt = q_ptr.dtype.element_ty
    i = tl.arange(0, HALF)
    x1 = tl.load(base + i).to(tl.float32)  # first half of the head  [HALF]
    x2 = tl.load(base + HALF + i).to(tl.float32)
    if NORM:  # per-head RMSNorm over all 2 * HALF dims
        inv = tl.rsqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / (2 * HALF) + eps)
        w1 = tl.load(w_ptr + i).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + i).to(tl.float32)
        if OFFSET:
            x1 = _round(x1 * inv * (1.0 + w1), dt)
            x2 = _round(x2 * inv * (1.0 + w2), dt)
        else:
            x1 = _round(w1 * _round(x1 * inv, dt), dt)
            x2 = _round(w2 * _round(x2 * inv, dt), dt)
    pos = tl.load(pos_ptr + t)
    # Table [2, P, 2 * HALF] fp32, both halves equal; torch casts it to the model dtype first.
    cos = _round(tl.load(cs_ptr + pos * (2 * HALF) + i), dt)
    sin = _round(tl.load(cs_ptr + table_len * (2 * HALF) + pos * (2 * HALF) + i), dt)
    # x * cos + rotate_half(x) * sin with torch's three roundings per element.
    o1 = _round(x1 * cos, dt) + _round(-x2 * sin, dt)
    o2 = _round(x2 * cos, dt) + _round(x1 * sin, dt)
    tl.store(base + i, _round(o1, dt).to(dt))
    tl.store(base + HALF + i, _round(o2, dt).to(dt))


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                 q_w: torch.Tensor | None, k_w: torch.Tensor | None, eps: float, offset: bool) -> None:
    """In place on q [T, Hq, D] and k [T, Hkv, D] (views into the qkv output): optional per-head
    RMSNorm, then neox rotary from the fp32 table cos_sin [2, P, D] at `positions`."""
    T, Hq, D = q.shape
    Hkv = k.shape[1]
    assert q.stride(-1) == 1 and k.stride(-1) == 1 and D % 2 == 0 and (D // 2) & (D // 2 - 1) == 0
    assert cos_sin.dtype == torch.float32 and cos_sin.is_contiguous()
    if T == 0:
        return
    norm = q_w is not None
    _qk_norm_rope_kernel[(T, Hq + Hkv)](
        q, k, positions, cos_sin, q_w if norm else q, k_w if norm else k,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin.shape[1], Hq, eps,
        NORM=norm, OFFSET=offset, HALF=D // 2, num_warps=1)


@triton.jit
def _act_mul_kernel(x_ptr, y_ptr, stride_x, stride_y, I, GELU: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = c < I
    dt = y_ptr.dtype.element_ty
    g = tl.load(x_ptr + t * stride_x + c, mask=m, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + t * stride_x + I + c, mask=m, other=0.0).to(tl.float32)
    if GELU:  # tanh approximation; tanh(z) = 2 sigmoid(2z) - 1
        z = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        a = 0.5 * g * (1.0 + (2.0 * tl.sigmoid(2.0 * z) - 1.0))
    else:
        a = g * tl.sigmoid(g)
    tl.store(y_ptr + t * stride_y + c, _round(_round(a, dt) * u, dt).to(dt), mask=m)


ACTS = ("silu", "gelu_pytorch_tanh")


def fuse_gate_up(mlp: torch.nn.Module) -> bool:
    """No GEMM epilogue to fold the activation into on this path (cuBLAS linears)."""
    return False


def act_and_mul(x: torch.Tensor, act: str) -> torch.Tensor:
    """x [T, 2I] = gate | up -> act(gate) * up [T, I]."""
    T, two_i = x.shape
    assert x.stride(-1) == 1 and act in ACTS
    I = two_i // 2
    y = torch.empty(T, I, dtype=x.dtype, device=x.device)
    if T == 0:
        return y
    block = min(1024, triton.next_power_of_2(I))
    _act_mul_kernel[(T, triton.cdiv(I, block))](x, y, x.stride(0), y.stride(0), I,
                                                GELU=act != "silu", BLOCK=block, num_warps=4)
    return y
