"""Probe: does a hand-written CUDA C++ one-row GEMV on the planar q4_0 weights
(flatserve/model/quant_planar.py) beat the Triton FMA GEMV (`quant_planar.qgemm`, `_fma_kernel`)
by a wide margin? No engine change: the kernels live here, compiled at run time by CuPy (NVRTC),
launched on torch's current stream, timed as benchmarks/dev/quant_gemm_gpu.py times (device time
per call inside a CUDA graph, the weights rotated over more than 2x the L2).

    PYTHONPATH=. python3 benchmarks/dev/gemv_cuda_probe.py [--shapes qkv,o] [--out DIR]
    .venv/bin/python benchmarks/dev/gemv_cuda_probe.py --cpu-check     # index logic, no GPU
    .venv/bin/python benchmarks/dev/gemv_cuda_probe.py --emit-src F.cu # for nvcc -Xptxas -v

out[n] = sum_k x[k] W[n, k], x bf16 [K], out bf16 [N], fp32 sums. Two kernel families:

fma_r{R}_u{U} (FMA, as the Triton kernel: exact products): a warp owns R weight rows and walks
  its K range, 8 blocks a step; 4 lanes a block, lane c takes the block's values 8c..8c+7
  (nibbles 2c and 2c+1 of its 4 code words: the words shifted right by 8c, then each nibble
  to q - 8 by one LOP3 into the mantissa of 2^23 / 2^19 and one FADD, as quant_planar._field),
  x as one 16-byte load a lane a step (a warp reads 512 contiguous bytes), the codes one 16-byte
  load (the block's 4 lanes the same 16 bytes), U steps of loads in flight, a shuffle sum at
  the end.
mma_rp{RP}_u{U} (tensor cores, mma.sync m16n8k16 bf16 -> fp32): a warp owns 2 RP rows; one
  mma pair takes 2 rows x 8 blocks: A row m = (row m // 8 of the pair, block m % 8), B column n
  = x of block n, so C's diagonal (C[m, m % 8]) holds the 16 block dot products. Lane (g, t)
  loads code word t of block g (a warp reads 128 contiguous bytes a row); nibbles to bf16 128 + q
  by one LOP3 per pair (magic 0x4300, exact), the products exact in the tensor cores, the 128 + 8
  offset taken off after the mma as 136 * sum(x over the block) (a table made with x), then
  d * (C - 136 sum x) into an fp32 accumulator per row (the useful lanes: t == g // 2). x is
  staged once per CTA into shared memory, bf16 in the fragments' order (16 bytes a lane a step),
  with the 136 * sum(x) table; CTAs optionally persistent over row tiles (one wave, so x is
  staged once per CTA).
Both: K optionally split over S CTAs (gridDim.y); the partials are written to a [S, N] fp32
buffer and the last CTA of each row tile (a counter per tile, reset after) adds them in split
order (the same bits whichever CTA is last) and writes bf16 out: one launch.

Correctness: each variant's output against a float64 reference on the dequantized weights
(quant_planar.to_blocks + qformats.dequantize), fresh random blocks and x per shape, out
poisoned with NaN first; also against qgemm's output.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, ".")

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
FMA_VARIANTS = [(r, u) for r in (1, 2, 4) for u in (2, 4)]
MMA_VARIANTS = [(rp, u) for rp in (1, 2, 4) for u in (1, 2, 4)]
BUILDS = {"": (), "_lb1": ("-DMINB=1",)}  # kernel name suffix -> NVRTC options (see LB in SRC)

# The shipped kernel's source comes first: its types, loads, conversions, FMA step (`step<R>`) and
# tensor-core step (`mma_step<RP>`) are what the variants here run: the probe measures the
# engine's arithmetic.
SHIPPED = Path(__file__).parents[2] / "flatserve" / "ops" / "csrc" / "q4_gemv_cuda.cu"
SRC = r"""
#ifdef MINB  // a variant build: __launch_bounds__(256, MINB), ptxas free to use more registers
#define LB __launch_bounds__(256, MINB)
#else
#define LB __launch_bounds__(256)
#endif
__device__ __forceinline__ float ldcg(const float* p) {
  float v; asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p)); return v;
}
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = 16; o; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ void finish(const float* red, int row0, int nrows, u16* out, float* part,
                                       int* cnt, int N, int tile, int* flag) {
  __syncthreads();
  const int S = gridDim.y;
  if (S == 1) {
    for (int i = threadIdx.x; i < nrows; i += blockDim.x) out[row0 + i] = f2bf(red[i]);
  } else {
    for (int i = threadIdx.x; i < nrows; i += blockDim.x) part[(size_t)blockIdx.y * N + row0 + i] = red[i];
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) *flag = atomicAdd(cnt + tile, 1) == S - 1;
    __syncthreads();
    if (*flag) {
      __threadfence();
      for (int i = threadIdx.x; i < nrows; i += blockDim.x) {
        float s = 0.f;
        for (int k = 0; k < S; ++k) s += ldcg(part + (size_t)k * N + row0 + i);
        out[row0 + i] = f2bf(s);
      }
      if (threadIdx.x == 0) cnt[tile] = 0;
    }
  }
  __syncthreads();
}

// ---- FMA: 4 lanes a block, lane c the values 8c..8c+7 ----
template <int R, int U>
__device__ __forceinline__ void fma_body(const u16* __restrict__ x, const U4* __restrict__ codes,
                                         const u16* __restrict__ scales, u16* out, float* part, int* cnt,
                                         int N, int nblk, int ntiles, int magic) {
  __shared__ float red[64];
  __shared__ int flag;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const int j = lane >> 2, c = lane & 3, sh = 8 * c;
  const u32 m0 = (u32)magic, m1 = (u32)magic - 0x2000000u;  // bits of 2^23, 2^19
  const int per = nblk / gridDim.y, kb0 = blockIdx.y * per, kend = kb0 + per;
  const int rows_cta = nw * R;
  for (int tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
    const int row = tile * rows_cta + warp * R;
    const U4* cp = codes + (size_t)row * nblk + j;
    const u16* sp = scales + (size_t)row * nblk + j;
    const u16* xp = x + j * 32 + c * 8;
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; ++r) acc[r] = 0.f;
    int kb = kb0;
    for (; kb + 8 * U <= kend; kb += 8 * U) {
      U4 xv[U], cv[U][R];
      u16 sv[U][R];
#pragma unroll
      for (int u = 0; u < U; ++u) {
        xv[u] = ldg128(xp + (size_t)(kb + 8 * u) * 32);
#pragma unroll
        for (int r = 0; r < R; ++r) {
          cv[u][r] = ldg128(cp + (size_t)r * nblk + kb + 8 * u);
          sv[u][r] = ldg16(sp + (size_t)r * nblk + kb + 8 * u);
        }
      }
#pragma unroll
      for (int u = 0; u < U; ++u) step<R>(xv[u], cv[u], sv[u], acc, sh, m0, m1);
    }
    for (; kb < kend; kb += 8) {
      U4 cv[R];
      u16 sv[R];
      const U4 xv = ldg128(xp + (size_t)kb * 32);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        cv[r] = ldg128(cp + (size_t)r * nblk + kb);
        sv[r] = ldg16(sp + (size_t)r * nblk + kb);
      }
      step<R>(xv, cv, sv, acc, sh, m0, m1);
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float v = warp_sum(acc[r]);
      if (lane == 0) red[warp * R + r] = v;
    }
    finish(red, tile * rows_cta, rows_cta, out, part, cnt, N, tile, &flag);
  }
}

// ---- MMA: a pair of rows x 8 blocks per mma pair, C's diagonal ----
template <int RP, int U>
__device__ __forceinline__ void mma_body(const u16* __restrict__ x, const u32* __restrict__ codes,
                                         const u16* __restrict__ scales, u16* out, float* part, int* cnt,
                                         int N, int nblk, int ntiles) {
  extern __shared__ U4 xs[];  // [per][4 lanes t] 8 bf16 each, then float corr[per]
  __shared__ float red[64];
  __shared__ int flag;
  const int per = nblk / gridDim.y, kb0 = blockIdx.y * per;
  float* corr = reinterpret_cast<float*>(xs + per * 4);
  stage_x(x + (size_t)kb0 * 32, per, per, xs, corr);  // the shipped staging (and its barrier)
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const bool odd = g & 1, useful = t == (g >> 1);
  const int rows_cta = nw * 2 * RP;
  for (int tile = blockIdx.x; tile < ntiles; tile += gridDim.x) {
    const int row = tile * rows_cta + warp * 2 * RP;
    const u32* cp = codes + ((size_t)row * nblk + kb0 + g) * 4 + t;
    const u16* sp = scales + (size_t)row * nblk + kb0 + g;
    float acc[2 * RP];
#pragma unroll
    for (int r = 0; r < 2 * RP; ++r) acc[r] = 0.f;
    int kb = 0;
    for (; kb + 8 * U <= per; kb += 8 * U) {
      u32 w[U][2 * RP];
      u16 sv[U][2 * RP];
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int r = 0; r < 2 * RP; ++r) {
          w[u][r] = ldg32(cp + ((size_t)r * nblk + kb + 8 * u) * 4);
          sv[u][r] = ldg16(sp + (size_t)r * nblk + kb + 8 * u);
        }
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const U4 xv = xs[(kb + 8 * u + g) * 4 + t];
        mma_step<RP>(w[u], sv[u], xv, corr[kb + 8 * u + g], acc, odd);
      }
    }
    for (; kb < per; kb += 8) {
      u32 w[2 * RP];
      u16 sv[2 * RP];
#pragma unroll
      for (int r = 0; r < 2 * RP; ++r) {
        w[r] = ldg32(cp + ((size_t)r * nblk + kb) * 4);
        sv[r] = ldg16(sp + (size_t)r * nblk + kb);
      }
      const U4 xv = xs[(kb + g) * 4 + t];
      mma_step<RP>(w, sv, xv, corr[kb + g], acc, odd);
    }
#pragma unroll
    for (int r = 0; r < 2 * RP; ++r) {
      const float v = warp_sum(useful ? acc[r] : 0.f);
      if (lane == 0) red[warp * 2 * RP + r] = v;
    }
    finish(red, tile * rows_cta, rows_cta, out, part, cnt, N, tile, &flag);
  }
}
"""

_FMA_INST = """
extern "C" __global__ void LB fma_r{R}_u{U}(const u16* x, const U4* codes,
    const u16* scales, u16* out, float* part, int* cnt, int N, int nblk, int ntiles, int magic) {{
  fma_body<{R}, {U}>(x, codes, scales, out, part, cnt, N, nblk, ntiles, magic);
}}
"""
_MMA_INST = """
extern "C" __global__ void LB mma_rp{RP}_u{U}(const u16* x, const u32* codes,
    const u16* scales, u16* out, float* part, int* cnt, int N, int nblk, int ntiles) {{
  mma_body<{RP}, {U}>(x, codes, scales, out, part, cnt, N, nblk, ntiles);
}}
"""


def source() -> str:
    return SHIPPED.read_text() + SRC + "".join(_FMA_INST.format(R=r, U=u) for r, u in FMA_VARIANTS) \
        + "".join(_MMA_INST.format(RP=rp, U=u) for rp, u in MMA_VARIANTS)


def kernel_names() -> list[str]:
    return [f"fma_r{r}_u{u}" for r, u in FMA_VARIANTS] + [f"mma_rp{rp}_u{u}" for rp, u in MMA_VARIANTS]


# ---------------------------------------------------------------------------------------------
# CPU check: the kernels' index logic emulated lane by lane in numpy (the mma by the PTX fragment
# layouts of m16n8k16), against the float64 reference on planar weights made by quant_planar.repack.

def _cpu_check() -> None:
    import numpy as np
    import torch

    from flatserve.model import quant_planar as qp
    from flatserve.model.qformats import FORMATS, dequantize

    fmt = FORMATS["q4_0"]
    rng = np.random.default_rng(0)
    n, k = 4, 512
    nblk = k // 32
    raw = torch.from_numpy(rng.integers(0, 256, (n * nblk, 18), dtype=np.uint8))
    raw[:, :2] = torch.from_numpy((rng.standard_normal(n * nblk) * 0.05).astype(np.float16)).view(torch.uint8).view(-1, 2)
    raw = raw.reshape(n, -1)
    p = qp.repack(raw, fmt)
    codes, scales, _ = qp._views(p, fmt)
    codes = codes.numpy().view(np.uint32).reshape(n, nblk, 4)
    scales = scales.numpy().astype(np.float64)
    xb = torch.randn(k).bfloat16()
    x = xb.float().numpy().astype(np.float64)
    xbits = xb.view(torch.int16).numpy().view(np.uint16).astype(np.uint32)
    ref = dequantize(raw, fmt, k).double().numpy() @ x

    def f32(bits):
        return np.array([bits], dtype=np.uint32).view(np.float32)[0].astype(np.float64)

    # fma: lane c of a block: words >> 8c, nibble fields with the 2^23 / 2^19 magics
    out = np.zeros(n)
    for r in range(n):
        for b in range(nblk):
            for c in range(4):
                xf = x[b * 32 + 8 * c: b * 32 + 8 * c + 8]
                t = 0.0
                for i in range(4):
                    ws = int(codes[r, b, i]) >> (8 * c)
                    fa = f32((ws & 0xF) | 0x4B000000) - 8388616.0
                    fb = f32((ws & 0xF0) | 0x49000000) - 524296.0
                    t += fa * xf[i] + fb * xf[4 + i]
                out[r] += scales[r, b] * t
    err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    print(f"cpu-check fma: rel err {err:.2e}")
    assert err < 1e-9, err

    # mma: staging, fragments, diagonal
    def bf(bits):  # 16-bit pattern -> float
        return np.array([(bits & 0xFFFF) << 16], dtype=np.uint32).view(np.float32)[0].astype(np.float64)

    xs = np.zeros((nblk, 4, 4), dtype=np.uint32)
    corr = np.zeros(nblk)
    for bb in range(nblk):
        v = xbits[bb * 32: bb * 32 + 32]
        corr[bb] = 136.0 * sum(bf(int(a)) for a in v)
        for t in range(4):
            xs[bb, t] = [v[t] | (v[16 + t] << 16), v[4 + t] | (v[20 + t] << 16),
                         v[8 + t] | (v[24 + t] << 16), v[12 + t] | (v[28 + t] << 16)]
    M, B = 0x000F000F, 0x43004300
    out = np.zeros(n)
    for pr in range(n // 2):
        r0 = 2 * pr
        acc = np.zeros((32, 2))
        for kb in range(0, nblk, 8):
            A = np.zeros((16, 16))
            Bm = np.zeros((16, 8))
            regs = {}
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                w0, w1 = int(codes[r0, kb + g, t]), int(codes[r0 + 1, kb + g, t])
                P = [((w0 >> (4 * i)) & M) | B for i in range(4)]
                Q = [((w1 >> (4 * i)) & M) | B for i in range(4)]
                xv = xs[kb + g, t]
                regs[lane] = (P, Q, xv)
            C = np.zeros((16, 8))
            for mm in range(2):  # mma j: A {P[2j], Q[2j], P[2j+1], Q[2j+1]}, B {xv[2j], xv[2j+1]}
                for lane in range(32):
                    g, t = lane >> 2, lane & 3
                    P, Q, xv = regs[lane]
                    a = [P[2 * mm], Q[2 * mm], P[2 * mm + 1], Q[2 * mm + 1]]
                    for i in range(8):  # a_i: reg i // 2, half i % 2
                        row = g + (8 if i in (2, 3, 6, 7) else 0)
                        col = 2 * t + (i & 1) + (8 if i >= 4 else 0)
                        A[row, col] = bf(a[i // 2] >> (16 * (i & 1)))
                    b = [int(xv[2 * mm]), int(xv[2 * mm + 1])]
                    for i in range(4):
                        Bm[2 * t + (i & 1) + (8 if i >= 2 else 0), g] = bf(b[i // 2] >> (16 * (i & 1)))
                C += A @ Bm
            for lane in range(32):
                g, t = lane >> 2, lane & 3
                c = [C[g, 2 * t], C[g, 2 * t + 1], C[g + 8, 2 * t], C[g + 8, 2 * t + 1]]
                v0, v1 = (c[1], c[3]) if g & 1 else (c[0], c[2])
                acc[lane, 0] += scales[r0, kb + g] * (v0 - corr[kb + g])
                acc[lane, 1] += scales[r0 + 1, kb + g] * (v1 - corr[kb + g])
        useful = [lane for lane in range(32) if (lane & 3) == ((lane >> 2) >> 1)]
        out[r0] = acc[useful, 0].sum()
        out[r0 + 1] = acc[useful, 1].sum()
    err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    print(f"cpu-check mma: rel err {err:.2e}")
    assert err < 1e-9, err


# ---------------------------------------------------------------------------------------------

def graph_us(fns: list, calls: int = 24, replays: int = 7, graph: bool = True) -> float:
    """Median device time of one call, in us: `calls` calls cycling through `fns` (each over its
    own copy of the weights, together over 2x the L2) captured in one CUDA graph and replayed
    (quant_gemm_gpu.graph_us's method); graph=False: the same calls launched back to back
    between two events (host launch time may then show)."""
    import torch

    for fn in fns:
        fn()
    torch.cuda.synchronize()
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for i in range(calls):
                fns[i % len(fns)]()
        g.replay()
        run = g.replay
    else:
        def run():
            for i in range(calls):
                fns[i % len(fns)]()
    ts = []
    for _ in range(replays):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / calls)
    return sorted(ts)[len(ts) // 2]


class Probe:
    def __init__(self) -> None:
        import cupy as cp
        import torch

        self.cp, self.torch = cp, torch
        t0 = time.time()
        self.kern = {}
        for suffix, opts in BUILDS.items():
            mod = cp.RawModule(code=source(), options=("-std=c++17", *opts))
            self.kern.update({name + suffix: mod.get_function(name) for name in kernel_names()})
        for kf in self.kern.values():  # load now (outside any capture)
            kf.attributes  # noqa: B018
        self.compile_s = time.time() - t0
        props = torch.cuda.get_device_properties(0)
        self.sms = props.multi_processor_count
        self.l2 = props.L2_cache_size

    def attrs(self, name: str) -> dict:
        a = self.kern[name].attributes
        return {"regs": a["num_regs"], "local_bytes": a["local_size_bytes"], "static_smem": a["shared_size_bytes"]}

    def occupancy(self, name: str, threads: int, smem: int) -> int:
        try:
            from cupy.cuda import driver
            return driver.occupancyMaxActiveBlocksPerMultiprocessor(self.kern[name].kernel.ptr, threads, smem)
        except Exception:  # noqa: BLE001 (estimate from the resource counts)
            a = self.attrs(name)
            regs_warp = -(-a["regs"] * 32 // 256) * 256
            warps = threads // 32
            by_regs = (65536 // regs_warp) // warps
            by_smem = (228 * 1024) // (smem + a["static_smem"] + 1024)
            return max(1, min(by_regs, by_smem, 64 // warps, 32))

    def launcher(self, cfg: dict, x, p, out, part, cnt, n: int, k: int):
        """A no-argument function launching cfg's kernel for out = x @ W(p)^T on torch's current
        stream."""
        import numpy as np

        cp = self.cp
        torch = self.torch
        nblk = k // 32
        kern = self.kern[cfg["name"]]
        codes = p.data_ptr()
        scales = codes + n * nblk * 16
        args = [np.uint64(x.data_ptr()), np.uint64(codes), np.uint64(scales), np.uint64(out.data_ptr()),
                np.uint64(part.data_ptr()), np.uint64(cnt.data_ptr()), np.int32(n), np.int32(nblk),
                np.int32(cfg["ntiles"])]
        if cfg["family"] == "fma":
            args.append(np.int32(0x4B000000))
        args = tuple(args)
        grid, block, smem = (cfg["grid_x"], cfg["splits"]), (cfg["warps"] * 32,), cfg["smem"]

        def fn() -> None:
            with cp.cuda.ExternalStream(torch.cuda.current_stream().cuda_stream):
                kern(grid, block, args, shared_mem=smem)
        return fn

    def configs(self, n: int, k: int) -> list[dict]:
        nblk = k // 32
        out = []
        for fam, variants, suffix in ((f, v, s) for f, v in (("fma", FMA_VARIANTS), ("mma", MMA_VARIANTS))
                                      for s in BUILDS):
            for a, u in variants:
                name = (f"fma_r{a}_u{u}" if fam == "fma" else f"mma_rp{a}_u{u}") + suffix
                rows_w = a if fam == "fma" else 2 * a
                for warps in (4, 8):
                    rows_cta = rows_w * warps
                    if n % rows_cta:
                        continue
                    ntiles = n // rows_cta
                    for splits in (1, 2, 4, 8):
                        per = nblk // splits
                        if nblk % splits or per % 8:
                            continue
                        smem = per * 68 if fam == "mma" else 0
                        if smem > 48 * 1024:
                            continue
                        for persist in ((False, True) if fam == "mma" else (False,)):
                            gx = ntiles
                            if persist:
                                occ = self.occupancy(name, warps * 32, smem)
                                gx = min(ntiles, max(1, occ * self.sms // splits))  # one wave in all
                                if gx == ntiles:
                                    continue
                            out.append(dict(name=name, family=fam, warps=warps, splits=splits, ntiles=ntiles,
                                            grid_x=gx, smem=smem, persist=persist,
                                            label=f"{name} w{warps} s{splits}{' persist' if persist else ''}"))
        return out


def _blocks(n: int, k: int):
    """Random q4_0 blocks uint8 [n, row_bytes] on CUDA: random codes, fp16 scales ~ N(0, 0.05)
    (as tests/model/test_qformats.random_blocks, made on the GPU)."""
    import torch

    nblk = k // 32
    raw = torch.randint(0, 256, (n * nblk, 18), dtype=torch.uint8, device="cuda")
    d = (torch.randn(n * nblk, device="cuda") * 0.05).to(torch.float16)
    raw[:, :2] = d.view(torch.uint8).view(-1, 2)
    return raw.view(n, nblk * 18)


def _reference(p, fmt, x, k: int):
    """float64 x @ W^T, W dequantized from the planar copy by the repo's own code."""
    import torch

    from flatserve.model import quant_planar as qp
    from flatserve.model.qformats import dequantize

    n = p.shape[0]
    ref = torch.empty(n, dtype=torch.float64, device=p.device)
    xd = x.double()
    for r in range(0, n, 16384):  # (the planar rows r.. are not p[r:]: to_blocks picks them)
        rows = torch.arange(r, min(n, r + 16384), device=p.device)
        w = dequantize(qp.to_blocks(p, fmt, rows), fmt, k)
        ref[r:r + 16384] = w.double() @ xd
    return ref


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--out", default=os.environ.get("OUT", ""), help="folder for results.json")
    ap.add_argument("--cpu-check", action="store_true")
    ap.add_argument("--emit-src", default="")
    ap.add_argument("--budget-s", type=float, default=240.0,
                    help="stop trying variants after this many seconds (the table still prints)")
    a = ap.parse_args()
    if a.emit_src:
        with open(a.emit_src, "w") as f:
            f.write(source())
        return
    if a.cpu_check:
        return _cpu_check()

    import torch

    from flatserve.bench.gpu import copy_bandwidth
    from flatserve.model import quant_planar as qp
    from flatserve.model.qformats import FORMATS

    fmt = FORMATS["q4_0"]
    t_start = time.time()
    pr = Probe()
    bw = copy_bandwidth()
    import cupy
    print(f"{torch.cuda.get_device_name()}  {pr.sms} SMs  L2 {pr.l2 >> 20} MiB  copy rate {bw / 1e9:.0f} GB/s  "
          f"torch {torch.__version__}  cupy {cupy.__version__}  NVRTC compile {pr.compile_s:.1f} s", flush=True)
    for name in pr.kern:
        print(f"  {name}: {pr.attrs(name)}", flush=True)

    # CUDA-graph capture of a CuPy launch on torch's capture stream
    n0, k0 = 256, 1024
    p0 = qp.repack(_blocks(n0, k0), fmt)
    x0 = torch.randn(k0, dtype=torch.bfloat16, device="cuda")
    o0 = torch.full((n0,), float("nan"), dtype=torch.bfloat16, device="cuda")
    part0 = torch.empty(8 * n0, dtype=torch.float32, device="cuda")
    cnt = torch.zeros(1 << 17, dtype=torch.int32, device="cuda")
    cfg0 = next(c for c in pr.configs(n0, k0) if c["name"] == "fma_r1_u2" and c["splits"] == 2)
    fn0 = pr.launcher(cfg0, x0, p0, o0, part0, cnt, n0, k0)
    fn0()
    torch.cuda.synchronize()
    use_graph = True
    try:
        o0.fill_(float("nan"))
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn0()
        g.replay()
        torch.cuda.synchronize()
        ok = not torch.isnan(o0.float()).any().item()
        print(f"CUDA graph capture of the CuPy launch: {'works' if ok else 'captured but the replay wrote nothing'}",
              flush=True)
        use_graph = ok
        del g
    except Exception as e:  # noqa: BLE001
        print(f"CUDA graph capture of the CuPy launch FAILED ({type(e).__name__}: {str(e)[:200]}); timing with "
              f"events over back-to-back launches instead", flush=True)
        use_graph = False
        torch.cuda.synchronize()

    results = {"device": torch.cuda.get_device_name(), "copy_GBps": bw / 1e9, "graph": use_graph,
               "attrs": {nm: pr.attrs(nm) for nm in pr.kern}, "shapes": {}}
    table = []
    names = a.shapes.split(",")
    for sname in names:
        n, k = SHAPES[sname]
        nbytes = n * fmt.row_bytes(k)
        floor = nbytes / bw * 1e6
        ps = [qp.repack(_blocks(n, k), fmt) for _ in range(max(1, -(-2 * pr.l2 // nbytes)))]
        x = torch.randn(k, dtype=torch.bfloat16, device="cuda")
        ref = _reference(ps[0], fmt, x, k)
        rn = ref.norm().item()
        out = torch.full((n,), float("nan"), dtype=torch.bfloat16, device="cuda")
        out_t = torch.full((1, n), float("nan"), dtype=torch.bfloat16, device="cuda")
        part = torch.empty(8 * n, dtype=torch.float32, device="cuda")
        x2 = x.view(1, k)
        qp.qgemm(x2, ps[0], fmt, out_t)
        torch.cuda.synchronize()
        tri = out_t[0].double()  # qgemm's output on copy 0 (out_t is overwritten by the timing below)
        err_t = ((tri - ref).norm() / rn).item()
        t_tri = graph_us([lambda p=p: qp.qgemm(x2, p, fmt, out_t) for p in ps], graph=True)
        print(f"\n== {sname} {n}x{k}: {len(ps)} copies of {nbytes / 1e6:.1f} MB, floor {floor:.1f} us | Triton "
              f"qgemm tiles {qp._tiles(x.device, n, k // 32, 1)}: {t_tri:.1f} us ({nbytes / t_tri / 1e3:.0f} GB/s), "
              f"rel err {err_t:.2e}", flush=True)
        rows = []
        t_shape = time.time()
        share = a.budget_s * (2 if sname == "lm_head" else 1) / sum(2 if s == "lm_head" else 1 for s in names)
        for cfg in pr.configs(n, k):
            if time.time() - t_shape > share:
                print(f"  (over this shape's share of --budget-s, {share:.0f} s: its remaining variants skipped)", flush=True)
                break
            out.fill_(float("nan"))
            cnt.zero_()
            try:
                fn = pr.launcher(cfg, x, ps[0], out, part, cnt, n, k)
                fn()
                torch.cuda.synchronize()
            except Exception as e:  # noqa: BLE001
                print(f"  {cfg['label']:32s} FAILED {type(e).__name__}: {str(e)[:160]}", flush=True)
                continue
            o = out.double()
            nan = torch.isnan(o).any().item()
            err = ((o - ref).norm() / rn).item()
            vs_t = ((o - tri).norm() / rn).item()
            ok = not nan and err < 4e-3
            t = float("nan")
            if ok:
                try:
                    t = graph_us([pr.launcher(cfg, x, p, out, part, cnt, n, k) for p in ps], graph=use_graph)
                except Exception as e:  # noqa: BLE001
                    print(f"  {cfg['label']:32s} timing FAILED {type(e).__name__}: {str(e)[:160]}", flush=True)
                    ok = False
            rows.append(dict(cfg, us=t, err=err, vs_triton=vs_t, nan=nan, ok=ok))
            print(f"  {cfg['label']:32s} grid {cfg['grid_x']:5d}x{cfg['splits']} {t:7.1f} us "
                  f"({nbytes / t / 1e3 if ok else 0:5.0f} GB/s)  err {err:.2e}  vs Triton {vs_t:.2e}"
                  f"{'  NaN' if nan else ''}{'' if ok else '  WRONG'}", flush=True)
        good = [r for r in rows if r["ok"]]
        best = min(good, key=lambda r: r["us"]) if good else None
        bfam = {f: min((r for r in good if r["family"] == f), key=lambda r: r["us"], default=None)
                for f in ("fma", "mma")}
        # the spread: Triton and each family's best timed again
        again = {"triton": graph_us([lambda p=p: qp.qgemm(x2, p, fmt, out_t) for p in ps], graph=True)}
        for f, r in bfam.items():
            if r is not None:
                again[r["label"]] = graph_us([pr.launcher(r, x, p, out, part, cnt, n, k) for p in ps], graph=use_graph)
        print(f"  timed again: " + "  ".join(f"{lab} {t:.1f} us" for lab, t in again.items()), flush=True)
        results["shapes"][sname] = {"n": n, "k": k, "bytes": nbytes, "floor_us": floor, "triton_us": t_tri,
                                    "triton_err": err_t, "again": again, "rows": rows}
        table.append((sname, n, k, nbytes, floor, t_tri, best, bfam))
        del ps, ref
        torch.cuda.empty_cache()

    if a.out:
        with open(os.path.join(a.out, "results.json"), "w") as f:
            json.dump(results, f, indent=1, default=str)
    print(f"\nq4_0, one row, device us per call ({'CUDA graphs' if use_graph else 'events, back-to-back launches'}), "
          f"floor = weight bytes / {bw / 1e9:.0f} GB/s copy rate")
    print(f"{'shape':8s} {'N x K':>12s} {'floor':>6s} {'Triton':>7s} {'GB/s':>5s} | {'best CUDA':>7s} {'GB/s':>5s} "
          f"{'x Triton':>8s}  variant | best fma  best mma")
    for sname, n, k, nbytes, floor, t_tri, best, bfam in table:
        if best is None:
            print(f"{sname:8s} no correct CUDA variant")
            continue
        fams = "  ".join(f"{bfam[f]['us']:7.1f}" if bfam[f] else "    n/a" for f in ("fma", "mma"))
        print(f"{sname:8s} {n:>6d}x{k:<5d} {floor:6.1f} {t_tri:7.1f} {nbytes / t_tri / 1e3:5.0f} | {best['us']:7.1f} "
              f"{nbytes / best['us'] / 1e3:5.0f} {t_tri / best['us']:8.2f}  {best['label']} | {fams}")
    for sname, *_rest, bfam in table:
        print(f"{sname:8s} best fma: " + "  best mma: ".join(
            f"{bfam[f]['label']} {bfam[f]['us']:.1f} us" if bfam[f] else "n/a" for f in ("fma", "mma")))
    print(f"total {time.time() - t_start:.0f} s")


if __name__ == "__main__":
    main()
