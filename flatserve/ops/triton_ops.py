"""Fused elementwise Triton kernels for the CUDA path; the torch layers are their reference.

Why: a decode step of a 28-layer model ran ~50 small kernels per layer (RMSNorm alone is 8:
cast, pow, mean, add, rsqrt, mul, cast, mul), ~1,500 launches at ~3 us each even inside a CUDA
graph, against a 1.2 ms memory floor (docs/performance-gpu.md). Each kernel here rounds where
the torch layer rounds (every bf16 op result), so outputs match the torch path bit for bit in
most rows; reduction order differs (a sum over D in one program vs torch's), so a rare row
differs by one bf16 ulp.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from flatserve.ops import pdl


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
                     HAS_RES: tl.constexpr, OFFSET: tl.constexpr, BLOCK: tl.constexpr,
                     PDL: tl.constexpr):
    pdl.sync(PDL)
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
                           num_warps=4 if block >= 2048 else 2, **pdl.launch(x.device, N))
    return y


@triton.jit
def _head_norm(x, inv, w, dt: tl.constexpr, OFFSET: tl.constexpr):
    """A q/k head's RMSNorm given 1 / rms: Gemma's x * inv * (1 + w) in fp32 with one rounding,
    else torch's w * round(x * inv), each product rounded to dt."""
    if OFFSET:
        return _round(x * inv * (1.0 + w), dt)
    return _round(w * _round(x * inv, dt), dt)


@triton.jit
def _qk_norm_rope_kernel(q_ptr, k_ptr, pos_ptr, cs_ptr, qw_ptr, kw_ptr,
                         stride_qt, stride_qh, stride_kt, stride_kh, table_len, Hq, eps,
                         v_ptr, kc_ptr, vc_ptr, slot_ptr, stride_vt, stride_vh,
                         stride_cb, stride_cs, stride_ch, Hkv,
                         NORM: tl.constexpr, OFFSET: tl.constexpr, HALF: tl.constexpr,
                         HALF_P: tl.constexpr, PASS: tl.constexpr, PASS_P: tl.constexpr,
                         STORE: tl.constexpr, BLOCK_SIZE: tl.constexpr, PDL: tl.constexpr):
    """One (token, head): dims [0, 2 HALF) rotate in two halves, [2 HALF, 2 HALF + PASS) pass
    through (partial rotary); each part is padded to a power of two (HALF_P, PASS_P) and masked,
    so any even head size runs (Phi-3's 96, half 48; 80, half 40). With STORE, the KV write of
    store_kv as well: each k head's result goes to k_cache at the token's slot, and Hkv more
    programs copy the v heads (slot < 0: nothing stored). The position, its cos / sin and the slot
    are loaded before the PDL wait: metadata and a fixed table, which no kernel of the step writes
    (unified_attention's rule)."""
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    ROT: tl.constexpr = 2 * HALF
    i = tl.arange(0, HALF_P)
    mi = i < HALF
    j = tl.arange(0, PASS_P)
    mj = j < PASS
    dt = q_ptr.dtype.element_ty
    pos = tl.load(pos_ptr + t)
    # Table [2, P, ROT] fp32, both halves equal; torch casts it to the model dtype first.
    cos = _round(tl.load(cs_ptr + pos * ROT + i, mask=mi, other=0.0), dt)
    sin = _round(tl.load(cs_ptr + table_len * ROT + pos * ROT + i, mask=mi, other=0.0), dt)
    dst = 0  # the cache row of this token's head (STORE)
    slot = 0
    if STORE:
        slot = tl.load(slot_ptr + t).to(tl.int64)
    pdl.sync(PDL)
    if STORE:
        hk = (h - Hq) % Hkv
        dst = (slot // BLOCK_SIZE) * stride_cb + (slot % BLOCK_SIZE) * stride_cs + hk * stride_ch
        if h >= Hq + Hkv:  # a v head: copied as it is
            if slot >= 0:
                src = v_ptr + t * stride_vt + hk * stride_vh
                vt = vc_ptr.dtype.element_ty
                tl.store(vc_ptr + dst + i, tl.load(src + i, mask=mi).to(vt), mask=mi)
                tl.store(vc_ptr + dst + HALF + i, tl.load(src + HALF + i, mask=mi).to(vt), mask=mi)
                if PASS > 0:
                    tl.store(vc_ptr + dst + ROT + j, tl.load(src + ROT + j, mask=mj).to(vt), mask=mj)
            return
    if h < Hq:
        base = q_ptr + t * stride_qt + h * stride_qh
        w_ptr = qw_ptr
    else:
        base = k_ptr + t * stride_kt + (h - Hq) * stride_kh
        w_ptr = kw_ptr
    x1 = tl.load(base + i, mask=mi, other=0.0).to(tl.float32)  # first half of the rotary dims
    x2 = tl.load(base + HALF + i, mask=mi, other=0.0).to(tl.float32)
    if NORM:  # per-head RMSNorm over all ROT + PASS dims
        ss = tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)
        if PASS > 0:
            xp = tl.load(base + ROT + j, mask=mj, other=0.0).to(tl.float32)
            ss += tl.sum(xp * xp, 0)
        inv = tl.rsqrt(ss / (ROT + PASS) + eps)
        w1 = tl.load(w_ptr + i, mask=mi, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + i, mask=mi, other=0.0).to(tl.float32)
        x1 = _head_norm(x1, inv, w1, dt, OFFSET)
        x2 = _head_norm(x2, inv, w2, dt, OFFSET)
        if PASS > 0:
            wp = tl.load(w_ptr + ROT + j, mask=mj, other=0.0).to(tl.float32)
            xp = _head_norm(xp, inv, wp, dt, OFFSET)
            tl.store(base + ROT + j, xp.to(dt), mask=mj)
    # x * cos + rotate_half(x) * sin with torch's three roundings per element. The launch turns
    # FP fusion off: with it, LLVM shrank these fp16 ops and contracted them into 4 fma.rn.f16
    # (one rounding for two; PTX for sm_90, Triton 3.9), so fp16 and fp32 keys were not torch's.
    o1 = _round(x1 * cos, dt) + _round(-x2 * sin, dt)
    o2 = _round(x2 * cos, dt) + _round(x1 * sin, dt)
    tl.store(base + i, _round(o1, dt).to(dt), mask=mi)
    tl.store(base + HALF + i, _round(o2, dt).to(dt), mask=mi)
    if STORE:
        if (h >= Hq) & (slot >= 0):  # this k head, as store_kv would copy it after this kernel
            kt = kc_ptr.dtype.element_ty
            tl.store(kc_ptr + dst + i, _round(o1, dt).to(dt).to(kt), mask=mi)
            tl.store(kc_ptr + dst + HALF + i, _round(o2, dt).to(dt).to(kt), mask=mi)
            if PASS > 0:  # the pass-through dims: normed above, else as loaded
                if not NORM:
                    xp = tl.load(base + ROT + j, mask=mj, other=0.0).to(tl.float32)
                tl.store(kc_ptr + dst + ROT + j, xp.to(dt).to(kt), mask=mj)


def rope_fits(head_dim: int, rotary_dim: int) -> tuple[bool, str]:
    """Any even rotary part of a head up to 512 dims (padded to powers of two in the kernel)."""
    if rotary_dim % 2 or rotary_dim > head_dim or head_dim > 512:
        return False, "rotary dims must be even and at most the head size (512 at most)"
    return True, ""


ROPE_STORES_KV = True  # qk_norm_rope takes `store` (Attention skips the backend's KV write)


def qk_norm_rope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                 q_w: torch.Tensor | None, k_w: torch.Tensor | None, eps: float, offset: bool,
                 store: tuple[torch.Tensor, ...] | None = None) -> None:
    """In place on q [T, Hq, D] and k [T, Hkv, D] (views into the qkv output): optional per-head
    RMSNorm, then neox rotary of the first R dims from the fp32 table cos_sin [2, P, R] at
    `positions` (R < D: partial rotary, the rest only normed). `store` = (v [T, Hkv, D], k_cache,
    v_cache [blocks, block_size, Hkv, D], slot_mapping [T]): also store_kv's write, in the same
    launch (one kernel fewer a layer: ~1.5 us at one row on an H100)."""
    T, Hq, D = q.shape
    Hkv, R = k.shape[1], cos_sin.shape[2]
    ok, why = rope_fits(D, R)
    if not ok or q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError(f"qk_norm_rope: head {D}, rotary {R}: {why or 'rows must be contiguous'}")
    assert cos_sin.dtype == torch.float32 and cos_sin.is_contiguous()
    if T == 0:
        return
    norm = q_w is not None
    half, rest = R // 2, D - R
    v, kc, vc, slots = store if store is not None else (k, k, k, positions)
    if store is not None:
        assert v.shape == k.shape and v.stride(-1) == 1 and kc.shape == vc.shape
        assert kc.stride() == vc.stride() and kc.stride(-1) == 1 and kc.shape[2:] == (Hkv, D)
        assert slots.shape == (T,)
    _qk_norm_rope_kernel[(T, Hq + Hkv * (2 if store is not None else 1))](
        q, k, positions, cos_sin, q_w if norm else q, k_w if norm else k,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), cos_sin.shape[1], Hq, eps,
        v, kc, vc, slots, v.stride(0), v.stride(1),
        *((kc.stride(0), kc.stride(1), kc.stride(2)) if store is not None else (0, 0, 0)), Hkv,
        NORM=norm, OFFSET=offset, HALF=half, HALF_P=triton.next_power_of_2(half), PASS=rest,
        PASS_P=triton.next_power_of_2(max(rest, 1)), STORE=store is not None,
        BLOCK_SIZE=kc.shape[1] if store is not None else 1, num_warps=1, enable_fp_fusion=False,
        **pdl.launch(q.device, T))


@triton.jit
def _act_mul_kernel(x_ptr, y_ptr, stride_x, stride_y, I, GELU: tl.constexpr, BLOCK: tl.constexpr,
                    PDL: tl.constexpr):
    pdl.sync(PDL)
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
                                                GELU=act != "silu", BLOCK=block, num_warps=4,
                                                **pdl.launch(x.device, T))
    return y
