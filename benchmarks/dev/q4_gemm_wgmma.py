"""Experiment (not wired into the engine): a mixed-input q4_0 GEMM on Hopper's wgmma, W
dequantized straight into the instruction's register operand, for the offline run's 256-512-row
decode steps, where the engine dequantizes the whole weight to HBM and calls cuBLAS (1.5-1.6x
bf16's time there; the Triton fused GEMM 2.2x: docs/performance-gpu.md).

    out [M, N] = x [M, K] @ W^T,  W planar q4_0 (quant_planar.repack), x and out bf16

Shape of the kernel (sm_90a, NVRTC through cuda_gemv._Api):
- a CTA = 2 warpgroups = 128 weight rows (64 each) x BM tokens; acc^T [64, BM] fp32 a warpgroup
  (wgmma m64nBMk16: W the left operand in registers, x^T the right from shared memory);
- x: BM x 64 bf16 a step (two q4_0 blocks of K) by cp.async into STAGES shared buffers, 128-byte
  swizzled (16-byte chunk c of row r at c ^ (r & 7)), the wgmma's K-major B layout;
- W: each thread loads the 8 code bytes its fragment needs (words 2 (t & 1), +1 of a block: the
  planar layout puts value 4 s + w in nibble s of word w, so a fragment's column pairs are
  (word w, word w + 1) at one nibble) and the two scales, two steps ahead in registers, and makes
  bf16(d * (q - 8)) in fp32 (the reference's bits) into the A registers, two buffers;
- per step: the wgmmas of step s are issued and committed, then wait_group(1) retires step s - 1,
  so step s + 1's dequantization runs under step s's tensor-core work; a stage is refilled D =
  STAGES - 2 steps ahead, once a CTA barrier says both warpgroups retired its step.

    PYTHONPATH=. python3 benchmarks/dev/q4_gemm_wgmma.py [--check-only] [--source out.cu]

`--source` writes the generated CUDA (for `nvcc -arch=sm_90a -cubin` on a machine with no GPU).
Status (2026-11-29): built by NVCC 13.0 for sm_90a (234 / 190 registers at BM 256 / 128, no
spills; in the SASS no instruction writes a group's A registers between its HGMMAs and the
WARPGROUP.DEPBAR that retires them), not yet run on a GPU: `--check-only` first (the error
against dequantize + cuBLAS at 100 / 256 / 512 rows), then the timings.
"""
from __future__ import annotations

import argparse
import ctypes
import sys

sys.path.insert(0, ".")

_HEAD = r"""
typedef unsigned int u32;
typedef unsigned long long u64;
typedef unsigned short u16;

__device__ __forceinline__ u32 smem_u32(const void* p) {
  return (u32)__cvta_generic_to_shared(p);
}
__device__ __forceinline__ void cp16(u32 dst, const void* src, int bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" :: "r"(dst), "l"(src), "r"(bytes));
}
__device__ __forceinline__ uint2 ldg64(const void* p) {
  uint2 v;
  asm volatile("ld.global.nc.v2.u32 {%0, %1}, [%2];" : "=r"(v.x), "=r"(v.y) : "l"(p));
  return v;
}
__device__ __forceinline__ float h2f(u16 h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
__device__ __forceinline__ u32 bf2(float lo, float hi) {
  u32 d;
  asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}
// q (a nibble) -> q - 8 in fp32, exactly: the nibble in the mantissa of 2^23, less 2^23 + 8
__device__ __forceinline__ float qf(u32 q) { return __uint_as_float(0x4B000000u | q) - 8388616.0f; }

// K-major B, 128-byte swizzle: start >> 4 | LBO (unused: 1) << 16 | SBO (8 rows x 128 B) >> 4 << 32 |
// swizzle mode 1 << 62
__device__ __forceinline__ u64 desc(u32 addr) {
  return (u64)((addr & 0x3FFFF) >> 4) | ((u64)1 << 16) | ((u64)(1024 >> 4) << 32) | ((u64)1 << 62);
}
"""

_KERNEL = r"""
// grid (N / 128, ceil(M / BM)), 256 threads; smem STAGES x BM x 128 bytes, 1024-aligned.
extern "C" __global__ void __launch_bounds__(256, 1)
q4_wgmma_bm{BM}(const u16* __restrict__ x, const uint4* __restrict__ codes, const u16* __restrict__ scales,
              u16* __restrict__ out, int M, int N, int nblk) {
  constexpr int BM = {BM}, STAGES = {STAGES}, D = STAGES - 2, NACC = BM / 2;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = (unsigned char*)(((size_t)smem_raw + 1023) & ~(size_t)1023);
  const int tid = threadIdx.x, wg = tid >> 7, warp = (tid >> 5) & 3, lane = tid & 31;
  const int g = lane >> 2, t = lane & 3;
  const int m0 = blockIdx.y * BM, K = nblk * 32, steps = nblk / 2;
  const int row0 = blockIdx.x * 128 + wg * 64 + warp * 16 + g;  // and row0 + 8
  const unsigned char* cb = (const unsigned char*)codes;

  // x: step k's tile into stage k % STAGES (every thread BM / 32 chunks of 16 bytes)
  auto fill = [&](int k) {
    if (k < steps) {
      const u32 base = smem_u32(smem + (k % STAGES) * BM * 128);
#pragma unroll
      for (int i = 0; i < BM / 32; ++i) {
        const int id = tid + 256 * i, r = id >> 3, c = id & 7;
        const int m = m0 + r;
        const u16* src = x + (size_t)min(m, M - 1) * K + k * 64 + c * 8;
        cp16(base + r * 128 + ((c ^ (r & 7)) << 4), src, m < M ? 16 : 0);
      }
    }
    asm volatile("cp.async.commit_group;");
  };
  // W: step k's code words (2 rows x 2 blocks x words 2 (t & 1), +1) and scales, two steps ahead
  // (one step of wgmmas, ~0.5 us at BM = 256, is under a DRAM round trip)
  struct Wk { uint2 cw[2][2]; u16 sc[2][2]; };
  auto load_w = [&](int k, Wk& w) {
    if (k >= steps) return;
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        const size_t blk = (size_t)(row0 + 8 * r) * nblk + 2 * k + b;
        w.cw[r][b] = ldg64(cb + blk * 16 + 8 * (t & 1));
        w.sc[r][b] = __ldg(scales + blk);
      }
  };
  // A fragments of a step's 4 k16 slices: a[j][0..3] = (row g, cols 2t, 2t + 1), (row g + 8,
  // the same), (row g, cols + 8), (row g + 8, cols + 8); slice j = block j / 2, half j % 2
  auto dequant = [&](const Wk& w, u32 (&a)[4][4]) {
#pragma unroll
    for (int r = 0; r < 2; ++r)
#pragma unroll
      for (int b = 0; b < 2; ++b) {
        const float d = h2f(w.sc[r][b]);
        const u32 w0 = w.cw[r][b].x, w1 = w.cw[r][b].y;
#pragma unroll
        for (int h = 0; h < 2; ++h)
#pragma unroll
          for (int e = 0; e < 2; ++e) {  // e: cols + 8 e (nibble + 2 e)
            const int s = 4 * h + (t >> 1) + 2 * e;
            const u32 q0 = (w0 >> (4 * s)) & 0xF, q1 = (w1 >> (4 * s)) & 0xF;
            a[2 * b + h][r + 2 * e] = bf2(d * qf(q0), d * qf(q1));
          }
      }
  };
  float acc[NACC];
#pragma unroll
  for (int i = 0; i < NACC; ++i) acc[i] = 0.f;
  // Two A buffers, static (a dynamic index let the compiler write one register set that the
  // previous step's wgmmas were still reading). fence(): the registers stay live until after
  // the wait that retires their wgmmas, so they are not reused while the tensor cores read them.
  u32 a0[4][4], a1[4][4];
  auto fence = [](u32 (&a)[4][4]) {
#pragma unroll
    for (int j = 0; j < 4; ++j)
      asm volatile("" : "+r"(a[j][0]), "+r"(a[j][1]), "+r"(a[j][2]), "+r"(a[j][3]) :: "memory");
  };
  auto step = [&](int k, Wk& w, u32 (&a)[4][4], u32 (&prev)[4][4]) {
    asm volatile("cp.async.wait_group %0;" :: "n"(D - 1));
    asm volatile("fence.proxy.async.shared::cta;");
    __syncthreads();  // step k's x is in; both warpgroups retired step k - 2 (its stage refills now)
    fill(k + D);
    dequant(w, a);  // a's last wgmmas (step k - 2) retired at step k - 1's wait
    load_w(k + 2, w);
    const u32 base = smem_u32(smem + (k % STAGES) * BM * 128);
    FENCE_ACC(acc);
    asm volatile("wgmma.fence.sync.aligned;");
#pragma unroll
    for (int j = 0; j < 4; ++j) WGMMA(acc, a[j], desc(base + 32 * j));
    asm volatile("wgmma.commit_group.sync.aligned;");
    asm volatile("wgmma.wait_group.sync.aligned 1;");  // retires step k - 1
    FENCE_ACC(acc);
    fence(prev);
    fence(a);
  };
  Wk we, wo;  // even and odd steps' weights
  for (int k = 0; k < D; ++k) fill(k);
  load_w(0, we);
  load_w(1, wo);
  for (int k = 0; k < steps; k += 2) {  // steps is even (the launcher asks K % 128 == 0)
    step(k, we, a0, a1);
    step(k + 1, wo, a1, a0);
  }
  asm volatile("wgmma.wait_group.sync.aligned 0;");
  FENCE_ACC(acc);
  // acc^T: element (row 16 warp + g (+8), token 8 j + 2 t (+1)) at acc[4 j + {0, 1, 2, 3}]
  const int n = row0;
#pragma unroll
  for (int j = 0; j < BM / 8; ++j) {
    const int m = m0 + 8 * j + 2 * t;
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int mm = m + (q & 1), nn = n + 8 * (q >> 1);
      if (mm < M) {
        u32 bits = bf2(acc[4 * j + q], 0.f) & 0xFFFFu;
        out[(size_t)mm * N + nn] = (u16)bits;
      }
    }
  }
}
"""


def _wgmma_macro(bm: int) -> str:
    """#define WGMMA(acc, a, db): one wgmma m64n{bm}k16 bf16 -> fp32, A from 4 registers; and
    FENCE_ACC(acc): an empty asm that reads and writes every accumulator (their registers stay put
    around the asynchronous wgmmas, as CUTLASS's warpgroup_fence_operand)."""
    n = bm // 2
    outs = ", ".join(f"%{i}" for i in range(n))
    # scale-d is a predicate (true: d += a b); then scale-a, scale-b, transpose-b (K-major B: 0)
    asm = ("{ .reg .pred p; setp.ne.b32 p, %" + str(n + 5) + ", 0; "
           f"wgmma.mma_async.sync.aligned.m64n{bm}k16.f32.bf16.bf16 {{{outs}}}, "
           f"{{%{n}, %{n + 1}, %{n + 2}, %{n + 3}}}, %{n + 4}, p, 1, 1, 0; }}")
    cons = ", ".join(f'"+f"(acc[{i}])' for i in range(n))
    return (f'#define WGMMA(acc, a, db) asm volatile("{asm}" : {cons} : '
            f'"r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1))\n'
            f'#define FENCE_ACC(acc) asm volatile("" : {cons} :: "memory")\n')


def source() -> str:
    """The module: the helpers, then one kernel per CONFIGS entry."""
    return _HEAD + "".join(_wgmma_macro(bm) + _KERNEL.replace("{BM}", str(bm)).replace("{STAGES}", str(st))
                           + "#undef WGMMA\n#undef FENCE_ACC\n" for bm, st in CONFIGS)


CONFIGS = ((128, 6), (256, 4))  # (BM, STAGES): x's stages are 16 / 32 KB


def smem_bytes(bm: int, stages: int) -> int:
    return stages * bm * 128 + 1024


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--check-only", action="store_true")
    ap.add_argument("--source", default=None, help="write the generated CUDA source here and stop")
    args = ap.parse_args()
    if args.source:
        with open(args.source, "w") as f:
            f.write(source())
        return
    import torch

    from benchmarks.dev.quant_gemm_gpu import SHAPES, copies, graph_us, random_blocks
    from flatserve.model import cuda_gemv
    from flatserve.model import quant_planar as qp
    from flatserve.model.qformats import FORMATS

    api = cuda_gemv._Api()
    torch.zeros(1, device="cuda")
    cubin = api.compile("sm_90a", source().encode())
    mod = ctypes.c_void_p()
    api.check(api.cuda.cuModuleLoadData(ctypes.byref(mod), cubin), "cuModuleLoadData")
    kern = {}
    for bm, st in CONFIGS:
        f = ctypes.c_void_p()
        api.check(api.cuda.cuModuleGetFunction(ctypes.byref(f), mod, f"q4_wgmma_bm{bm}".encode()), "get")
        api.check(api.cuda.cuFuncSetAttribute(f, 8, smem_bytes(bm, st)), "max dynamic smem")
        kern[bm] = (f, st)

    def launch(bm: int, x: torch.Tensor, p: torch.Tensor, out: torch.Tensor) -> None:
        (m, k), n = x.shape, p.shape[0]
        assert n % 128 == 0 and k % 128 == 0 and x.is_contiguous() and out.is_contiguous()
        codes, scales, nblk = qp._views(p, FORMATS["q4_0"])
        f, st = kern[bm]
        vals = [ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(codes.data_ptr()),
                ctypes.c_void_p(scales.data_ptr()), ctypes.c_void_p(out.data_ptr()),
                ctypes.c_int(m), ctypes.c_int(n), ctypes.c_int(nblk)]
        params = (ctypes.c_void_p * len(vals))(*[ctypes.addressof(v) for v in vals])
        stream = ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)
        api.check(api.cuda.cuLaunchKernel(f, n // 128, -(-m // bm), 1, 256, 1, 1, smem_bytes(bm, st), stream,
                                          params, None), "cuLaunchKernel")

    fmt = FORMATS["q4_0"]
    print(torch.cuda.get_device_name(), flush=True)
    for name, (n, k) in SHAPES.items():
        ps = copies(lambda: qp.repack(random_blocks(n, k, fmt, "cuda"), fmt), n * fmt.row_bytes(k))
        dn = copies(lambda: torch.randn(n, k, dtype=torch.bfloat16, device="cuda"), 2 * n * k)
        for m in (100, 256, 512) if args.check_only else (256, 512, 1024):
            x = torch.randn(m, k, dtype=torch.bfloat16, device="cuda")
            ref, out = (torch.empty(m, n, dtype=torch.bfloat16, device="cuda") for _ in range(2))
            qp.GEMM = False  # above 32 rows: dequantize + cuBLAS, the reference's dequantized bits
            qp.qgemm(x, ps[0], fmt, ref)
            line = f"{name:8s} M={m:4d}"
            if not args.check_only:
                line += f" bf16 {graph_us([lambda d=d: torch.mm(x, d.t(), out=out) for d in dn]):7.1f}"
                line += f" deq+mm {graph_us([lambda p=p: qp.qgemm(x, p, fmt, out) for p in ps]):7.1f}"
            qp.GEMM = True
            for bm in kern:
                out.fill_(float("nan"))
                launch(bm, x, ps[0], out)
                torch.cuda.synchronize()
                err = ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()
                line += f" | bm{bm} err {err:.1e}"
                if not args.check_only and err < 1e-2:
                    line += f" {graph_us([lambda p=p, bm=bm: launch(bm, x, p, out) for p in ps]):7.1f}"
            print(line, flush=True)


if __name__ == "__main__":
    main()
