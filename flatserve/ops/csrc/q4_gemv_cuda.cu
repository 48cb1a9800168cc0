// One-row GEMV on the planar q4_0 weights (flatserve/model/quant_planar.py): out[n] = sum_k x[k]
// W[n, k], x and out bf16, fp32 sums. Compiled at run time by NVRTC (flatserve/model/cuda_gemv.py):
// no header, so the conversions are PTX.
//
// Why CUDA C++ and not Triton: the Triton FMA GEMV (quant_planar._fma_kernel) with the same
// arithmetic ran 1.4-1.6x slower on an H100 (L1/TEX-bound at 84%: its x loads came in 8-byte
// pieces spread over 8 lines a warp); benchmarks/dev/gemv_cuda_probe.py, raw
// docs/benchmarks/raw/gpu_h100_q4_0_cuda_probe/.
//
// Layout (q4_gemv_r*): a warp owns R weight rows and walks the whole K, 32 blocks a step: lane
// l takes block l of the step, so each code load of a warp is 512 contiguous bytes of one row and
// a lane's x is its block's 64 bytes (four 16-byte loads, shared by the R rows). Each nibble
// becomes q - 8 exactly by one LOP3 into the mantissa of 2^23 (2^19) and one FADD, as
// quant_planar._field; a lane sums its block's 32 products in fp32 FMAs, then scales; the lanes'
// sums meet in a shuffle tree at the end. Until 2026-11-29 a step was 8 blocks, lane (j, c) =
// (lane / 4, lane % 4) taking values 8c..8c+7 of block j, so a load was 128 bytes of a row, each
// 16-byte piece loaded by its block's 4 lanes: on an H200 o took 5.6 and down 15.0 us a call
// against 4.9 and 13.5 now, the b1 forward of Llama-3-8B 2.34-2.39 against 2.30-2.31 ms
// (docs/benchmarks/raw/gpu_h200_q4_0_gemv_seq/).
//
// Loads: groups of U steps, in two register buffers, so group g + 1's loads are in flight while
// group g's FMAs run (`pipelined`). Before (e99cf1e) a warp issued a group's loads and then waited
// for them: one DRAM round trip a group with nothing in flight during the FMAs, and Nsight
// Compute put down's GEMV at 35% of DRAM throughput with no eligible warp half the cycles (H200,
// raw docs/benchmarks/raw/gpu_h200_q4_0_gemv_pipelined/). The row-sequential kernel takes U = 2
// (U = 4, R = 8 with U = 1, or x loaded a group ahead with the codes, +64-117 registers, were
// slower: fewer warps; down 13.5 -> 14.8-17.8 us with x ahead, H200); the mma kernel U = 2
// or 4 (cuda_gemv.py picks: 4 where the grid still fits one wave at its occupancy, else 2).
// Holding the in-flight weights in shared memory instead (a cp.async ring, then a cp.async.bulk
// ring on mbarriers) was slower both times: docs/benchmarks/raw/gpu_h100_q4_0_gemv_staged/,
// gpu_h200_q4_0_gemv_ring/.
//
// Launched with programmatic dependent launch (pdl = 1, sm_90; flatserve/ops/pdl.py), a warp
// issues its first step's weight loads, then waits for the kernel before it (griddepcontrol.wait)
// and only then reads x.
//
// q4_mma_rp2 (the linears of >= 40 x SMs rows: q|k|v, gate|up, the LM head of Llama-3-8B) runs the
// products on the tensor cores instead (mma.sync m16n8k16, bf16 -> fp32): a warp owns 2 pairs of
// rows; one mma pair takes 2 rows x 8 blocks: A row m = (row m / 8 of the pair, block m % 8), B
// column n = x of block n, so C's diagonal holds the 16 block dot products. Lane (g, t) loads
// code word t of block g; nibbles become bf16 128 + q by one LOP3 (exact), the products are
// exact, and the 128 + 8 offset comes off after the mma as 136 sum(x over the block), from a
// table each CTA builds with x in shared memory (in the fragments' order). That subtraction
// cancels: the sums carry ~1e-4 relative error against the FMA kernel's ~1e-7, still far under
// the bf16 output's rounding (4e-3). Per call on an H100 (benchmarks/dev/gemv_cuda_probe.py):
// gate|up 28.7 against 31.7 us, the LM head 108.7 against 124.0, q|k|v 8.8 against 9.5.
typedef unsigned int u32;
typedef unsigned short u16;
struct alignas(16) U4 { u32 x, y, z, w; };

__device__ __forceinline__ U4 ldg128(const void* p) {
  U4 v;
  asm("ld.global.nc.v4.u32 {%0,%1,%2,%3}, [%4];" : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
// x, written by the kernel before under PDL: a coherent load (no .nc), volatile. ptxas treats .nc
// loads as invariant for the whole kernel and may move them above griddepcontrol.wait: one build
// of q4_ks read x before its wait (SASS: the LDG.E.128.CONSTANT of x ahead of ACQBULK), a race
// with the kernel writing x. Plain loads stay after the wait in SASS, and volatile keeps NVVM
// from hoisting the asm above pdl_sync's.
__device__ __forceinline__ U4 ldx128(const void* p) {
  U4 v;
  asm volatile("ld.global.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
__device__ __forceinline__ u16 ldx16(const u16* p) {  // as ldx128: a residual an earlier kernel wrote
  u16 v;
  asm volatile("ld.global.u16 %0, [%1];" : "=h"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ float ldxf(const float* p) {  // as ldx128: a partial an earlier kernel wrote
  float v;
  asm volatile("ld.global.f32 %0, [%1];" : "=f"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ u32 ldg32(const u32* p) {
  u32 v;
  asm("ld.global.nc.u32 %0, [%1];" : "=r"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ u16 ldg16(const u16* p) {
  u16 v;
  asm("ld.global.nc.u16 %0, [%1];" : "=h"(v) : "l"(p));
  return v;
}
__device__ __forceinline__ float h2f(u16 h) {  // fp16 scale -> fp32
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}
__device__ __forceinline__ u16 f2bf(float f) {  // fp32 -> bf16, round to nearest even
  u16 h;
  asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
  return h;
}
__device__ __forceinline__ float bf_lo(u32 v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf_hi(u32 v) { return __uint_as_float(v & 0xffff0000u); }
__device__ __forceinline__ float bf2f(u16 h) { return __uint_as_float((u32)h << 16); }
__device__ __forceinline__ float bf_round(float f) { return bf2f(f2bf(f)); }

// A row's output: its sum rounded to bf16 (the linear's output), plus res[row] where res is set
// (the decoder's residual add, cuda_stack.py), rounded again: the bits of the linear, then the add.
__device__ __forceinline__ u16 out_value(float sum, const u16* res, int row) {
  return res ? f2bf(bf_round(sum) + bf2f(ldx16(res + row))) : f2bf(sum);
}

__device__ __forceinline__ U4 ldg(const U4* p) { return ldg128(p); }
__device__ __forceinline__ u32 ldg(const u32* p) { return ldg32(p); }

// U steps (B blocks each) of R rows' codes and scales, from block kb on: cp[r] / sp[r] point at
// this lane's part of the row's first block, S elements of T a block (a U4 of 4 code words: gemv;
// one u32 word of 4: the mma kernel).
template <int R, int U, int S, typename T, int B = 8>
__device__ __forceinline__ void load_weights(const T* const* cp, const u16* const* sp, int kb,
                                             T (&cv)[U][R], u16 (&sv)[U][R]) {
#pragma unroll
  for (int u = 0; u < U; ++u) {
#pragma unroll
    for (int r = 0; r < R; ++r) {
      cv[u][r] = ldg(cp[r] + (size_t)(kb + B * u) * S);
      sv[u][r] = ldg16(sp[r] + kb + B * u);
    }
  }
}

// Groups 0 .. full - 1 of U steps: run(k, buffer) for group k's first block, with that group's
// loads (load(k, buffer)) issued one group ahead into the other buffer; group 0 is already in a.
template <typename Buf, typename Load, typename Run>
__device__ __forceinline__ void pipelined(int full, int stride, Buf& a, Buf& b, Load load, Run run) {
  int g = 0;
  for (; g + 1 < full; g += 2) {
    load((g + 1) * stride, b);
    run(g * stride, a);
    if (g + 2 < full) load((g + 2) * stride, a);
    run((g + 1) * stride, b);
  }
  if (g < full) run(g * stride, a);
}

// Each of n sums over the warp's 32 lanes (a shuffle tree; every lane ends with the totals).
template <int n>
__device__ __forceinline__ void warp_sums(float* v) {
#pragma unroll
  for (int r = 0; r < n; ++r)
#pragma unroll
    for (int o = 16; o; o >>= 1) v[r] += __shfl_xor_sync(0xffffffffu, v[r], o);
}

// The PDL handshake (a no-op below sm_90, where pdl is 0): wait for the previous kernel's
// writes, then let the next kernel launch.
__device__ __forceinline__ void pdl_sync() {
#if __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}

// One step's products: this lane's block of x (32 bf16 in 4 chunks xv), each row's 4 code words
// cv[r] and fp16 scale sv[r]; the block's 32 products summed, then scaled into acc[r].
template <int R>
__device__ __forceinline__ void step(const U4 (&xv)[4], const U4* cv, const u16* sv, float* acc,
                                     u32 m0, u32 m1) {
#pragma unroll
  for (int r = 0; r < R; ++r) {
    const u32 w[4] = {cv[r].x, cv[r].y, cv[r].z, cv[r].w};
    float t = 0.f;
#pragma unroll
    for (int c = 0; c < 4; ++c) {  // values 8c .. 8c + 7: x chunk xv[c], nibbles 2c and 2c + 1
      const float xf[8] = {bf_lo(xv[c].x), bf_hi(xv[c].x), bf_lo(xv[c].y), bf_hi(xv[c].y),
                           bf_lo(xv[c].z), bf_hi(xv[c].z), bf_lo(xv[c].w), bf_hi(xv[c].w)};
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const u32 v = w[i] >> (8 * c);
        t = fmaf(__uint_as_float((v & 0xFu) | m0) - 8388616.f, xf[i], t);
        t = fmaf(__uint_as_float((v & 0xF0u) | m1) - 524296.f, xf[4 + i], t);
      }
    }
    acc[r] = fmaf(h2f(sv[r]), t, acc[r]);
  }
}

// H2 (the default for q4_ks and the FMA kernel; FLATSERVE_GEMV_H2=0 keeps the fp32 products, =ks
// keeps them in the FMA kernel): the products in packed fp16 on the CUDA cores, two values an
// instruction. A code word's nibbles s and s + 4 (values 4s + w and 4s + w + 16 of the block, w
// the word) land in the two halves' mantissas of 1024 by one LOP3 each (s = 0, 1; the word >> 8
// for s = 2, 3), one HFMA2 makes (q - 8) / 8 of them (exact), one more adds x * that into an fp16
// pair of sums: 13 instructions for 8 weights where step() takes ~26 (SASS of q4_ks_rt8: 829
// against 1,121 a thread; q4_gemv_r4_u2 3,004 against 3,717). x's block is scaled by a power of
// two into [2^10, 2^11) at its largest |value| and packed into the same value pairs once a lane
// (x_pairs; the FMA kernel: once a step for its R rows), so no fp16 sum can overflow (8 products
// of at most 2^11) whatever the residual stream holds; the two halves of two sums (words 0-1,
// 2-3: 8 products each) meet in fp32 with the scale, 8 and the power of two taken back. Each
// HFMA2 rounds to fp16 (2^-11 of the partial sum), so a block's sum is within 2^-8 of its sum
// |term| (tests/model/test_cuda_gemv.py's bound); measured against the fp32 products, ~17% of the
// bf16 outputs differ, by at most ~3.6e-3 of the largest output (6e-3 at the LM head).
// On an H200 (benchmarks/dev/gemv_kernels.py; raw docs/benchmarks/raw/gpu_h200_q4_0_gemv_h2/), a
// call against the fp32 products: q|k|v 5.6 / 6.5 us, gate|up 18.2 / 21.8, the LM head 68.8 /
// 87.8, o 5.0 / 5.2, down 13.7 / 14.1. The b1 Llama-3-8B forward (step_breakdown.py, one call):
// 1.81 ms, 1.84 with the fp32 products in the FMA kernel, 1.99 with them everywhere. The prescale
// costs ~0.13 ms of it (1.68 ms with x converted unscaled, which can overflow); its max is not
// the part that costs: a tree of max.u16x2 on |x|'s bits gave the same 1.81 ms as this chain of
// 32 FMNMX, the instruction count the same too.
__device__ __forceinline__ u32 hfma2(u32 a, u32 b, u32 c) {
  u32 d;
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}
__device__ __forceinline__ u32 f2h2(float lo, float hi) {  // -> fp16 pair {lo, hi}
  u32 d;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}
__device__ __forceinline__ float h2sum(u32 v) {  // fp16 pair -> lo + hi in fp32
  return h2f((u16)(v & 0xffffu)) + h2f((u16)(v >> 16));
}
__device__ __forceinline__ float xval(const U4 (&xv)[4], int j) {  // value j of a lane's 32 bf16
  const U4 c = xv[j / 8];
  const u32 w = (j % 8) / 2 == 0 ? c.x : (j % 8) / 2 == 1 ? c.y : (j % 8) / 2 == 2 ? c.z : c.w;
  return j % 2 ? bf_hi(w) : bf_lo(w);
}
// xh[4 i + w] = {x[w + 4 i], x[w + 4 i + 16]} * 2^e: the values nibble pair i of code word w holds,
// 2^e putting the block's largest |x| in [2^10, 2^11) (1 for a block of zeros); -> 8 / 2^e.
__device__ __forceinline__ float x_pairs(const U4 (&xv)[4], u32 (&xh)[16]) {
  float m = 0.f;
#pragma unroll
  for (int j = 0; j < 32; ++j) m = fmaxf(m, fabsf(xval(xv, j)));
  const int ex = (int)(__float_as_uint(m) >> 23);  // m >= 0: its biased exponent (255: inf / nan)
  const int e = ex ? min(137 - ex, 126) : 0;  // 2^(ex - 127 + e) = 2^10 (126: 2^e a float)
  const float up = __uint_as_float((u32)(127 + e) << 23);
#pragma unroll
  for (int i = 0; i < 4; ++i)
#pragma unroll
    for (int w = 0; w < 4; ++w)
      xh[4 * i + w] = f2h2(xval(xv, w + 4 * i) * up, xval(xv, w + 4 * i + 16) * up);
  return __uint_as_float((u32)(127 - e + 3) << 23);
}
// One row's block: 4 code words c, fp16 scale s -> its 32 products summed and scaled (k: x_pairs').
__device__ __forceinline__ float step_h2(const u32 (&xh)[16], const U4& c, u16 s, u32 hm, float k) {
  const u32 w[4] = {c.x, c.y, c.z, c.w};
  u32 a[2] = {0u, 0u};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const u32 v = w[j], t = w[j] >> 8;
    // (1024 + q) / 8 - 129 and (1024 + 16 q) / 128 - 9: both (q - 8) / 8, exact in fp16
    const u32 q0 = hfma2((v & 0x000F000Fu) | hm, 0x30003000u, 0xD808D808u);
    const u32 q1 = hfma2((v & 0x00F000F0u) | hm, 0x20002000u, 0xC880C880u);
    const u32 q2 = hfma2((t & 0x000F000Fu) | hm, 0x30003000u, 0xD808D808u);
    const u32 q3 = hfma2((t & 0x00F000F0u) | hm, 0x20002000u, 0xC880C880u);
    u32& acc = a[j / 2];
    acc = hfma2(xh[j], q0, acc);
    acc = hfma2(xh[4 + j], q1, acc);
    acc = hfma2(xh[8 + j], q2, acc);
    acc = hfma2(xh[12 + j], q3, acc);
  }
  return (k * h2f(s)) * (h2sum(a[0]) + h2sum(a[1]));
}
// step() in either form: H2 packs the lane's x once for its R rows (gemv's `_h2` kernels).
template <int R, bool H2>
__device__ __forceinline__ void step_any(const U4 (&xv)[4], const U4* cv, const u16* sv, float* acc,
                                         u32 m0, u32 m1) {
  if (!H2) return step<R>(xv, cv, sv, acc, m0, m1);
  u32 xh[16];
  const float k = x_pairs(xv, xh);
  const u32 hm = m0 ^ 0x2F006400u;  // fp16 (1024, 1024) in a register: LOP3 takes one immediate
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] += step_h2(xh, cv[r], sv[r], hm, k);
}

// x [nblk * 32] bf16 (16-byte aligned), codes [N][nblk] x 16 bytes, scales [N][nblk] fp16, out [N]
// bf16. magic: the bits of 2^23 (a kernel argument: a constant mask and magic would both be
// immediates, and LOP3 takes one). Rows past N read row N - 1 and store nothing; blocks past nblk
// (the last step when nblk % 32 != 0) read x as 0 and the row's last block's codes.
// NOUT (cuda_stack.py's hand-off to the next RMSNorm): besides out = h (the residual stream),
// the kernel stores hw = bf16(h * nw) (nw: the next norm's weight) and part[CTA] = the sum of h^2
// over the CTA's rows, so the GEMV after it takes hw as its x and only scales its sums by
// rsqrt(sum(part) / K + eps) (q4_ks's MODE 2): the elementwise half of the norm runs once here,
// per row, instead of in each of the next GEMV's CTAs. Needs N % (4 R) == 0 (cuda_gemv.gemv).
template <int R, int U, bool NOUT = false, bool H2 = false>
__device__ __forceinline__ void gemv(const u16* __restrict__ x, const U4* __restrict__ codes,
                                     const u16* __restrict__ scales, u16* __restrict__ out, int N,
                                     int nblk, int magic, int pdl, const u16* res,
                                     const u16* __restrict__ nw = nullptr, u16* __restrict__ hw = nullptr,
                                     float* __restrict__ part = nullptr) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int row0 = (blockIdx.x * (blockDim.x >> 5) + warp) * R;
  const u32 m0 = (u32)magic, m1 = (u32)magic - 0x2000000u;  // bits of 2^23, 2^19
  const U4* cp[R];
  const u16* sp[R];
#pragma unroll
  for (int r = 0; r < R; ++r) {  // rows past N read row N - 1 (a warp past the end too)
    const size_t n = (size_t)min(row0 + r, N - 1);
    cp[r] = codes + n * nblk + lane;
    sp[r] = scales + n * nblk + lane;
  }
  struct Buf { U4 c[U][R]; u16 s[U][R]; } a, b;
  const int full = nblk / (32 * U);
  // The first group's weights are loaded before the PDL wait: they arrive while the kernel
  // before ends. (Prefetching each warp's whole rows into L2 there instead made a Llama-3-8B
  // q4_0 forward slower on an H100: 3.25 against 3.08-3.15 ms without PDL.)
  if (full) load_weights<R, U, 1, U4, 32>(cp, sp, 0, a.c, a.s);
  u16 nwv[R];
#pragma unroll
  for (int r = 0; r < R; ++r) nwv[r] = NOUT ? ldg16(nw + min(row0 + r, N - 1)) : 0;
  if (pdl) pdl_sync();  // every warp, the ones past N too: nothing below runs before the last kernel ends
  if (row0 >= N) return;  // a whole warp past the end: no CTA-wide barrier below
  const U4* xp = reinterpret_cast<const U4*>(x) + lane * 4;  // this lane's block: 4 x 16 bytes
  float acc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = 0.f;
  pipelined(full, 32 * U, a, b, [&](int k, Buf& d) { load_weights<R, U, 1, U4, 32>(cp, sp, k, d.c, d.s); },
            [&](int k, const Buf& d) {
#pragma unroll
              for (int u = 0; u < U; ++u) {
                const U4* q = xp + (size_t)(k + 32 * u) * 4;
                const U4 xv[4] = {ldx128(q), ldx128(q + 1), ldx128(q + 2), ldx128(q + 3)};
                step_any<R, H2>(xv, d.c[u], d.s[u], acc, m0, m1);
              }
            });
  for (int kb = full * 32 * U; kb < nblk; kb += 32) {  // single steps; past nblk: x 0, the last block
    const bool in = kb + lane < nblk;
    const int bk = in ? kb : nblk - 1 - lane;
    U4 xv[4] = {}, cv[R];
    u16 sv[R];
    if (in) {
      const U4* q = xp + (size_t)kb * 4;
      xv[0] = ldx128(q), xv[1] = ldx128(q + 1), xv[2] = ldx128(q + 2), xv[3] = ldx128(q + 3);
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      cv[r] = ldg128(cp[r] + bk);
      sv[r] = ldg16(sp[r] + bk);
    }
    step_any<R, H2>(xv, cv, sv, acc, m0, m1);
  }
  warp_sums<R>(acc);
  if (!NOUT) {
#pragma unroll
    for (int r = 0; r < R; ++r)
      if (lane == 0 && row0 + r < N) out[row0 + r] = out_value(acc[r], res, row0 + r);
    return;
  }
  __shared__ float ps[4];
  float ss = 0.f;
  if (lane == 0) {
#pragma unroll
    for (int r = 0; r < R; ++r) {  // every row is < N here (N % (4 R) == 0)
      const u16 h = out_value(acc[r], res, row0 + r);
      const float f = bf2f(h);
      out[row0 + r] = h;
      hw[row0 + r] = f2bf(f * bf2f(nwv[r]));
      ss = fmaf(f, f, ss);
    }
    ps[warp] = ss;
  }
  __syncthreads();
  if (threadIdx.x == 0) part[blockIdx.x] = ((ps[0] + ps[1]) + ps[2]) + ps[3];
}

// Every kernel takes the same arguments (cuda_gemv.gemv): x, codes, scales, out, N, nblk, magic,
// pdl, then res (added to each output where not null); nw (q4_ks NORM's norm weight, or the next
// norm's for NOUT) and eps (q4_ks MODE 1 and 2); hw and part (NOUT's outputs; part is MODE 2's
// input, nparts long).
#define GEMV_ARGS                                                                                  \
  const u16 *x, const U4 *codes, const u16 *scales, u16 *out, int N, int nblk, int magic, int pdl, \
      const u16 *res, const u16 *nw, float eps, u16 *hw, float *part, int nparts

// 4 warps a CTA; ptxas may use up to 255 registers (1 CTA an SM at the least). sm_90 builds
// (NVCC 13, -Xptxas -v): r1_u2 90, r2_u2 114, r4_u2 208, mma_u2 124, mma_u4 141 registers.
#define GEMV_KERNEL(R, U)                                                                            \
  extern "C" __global__ void __launch_bounds__(128, 1) q4_gemv_r##R##_u##U(GEMV_ARGS) {           \
    gemv<R, U>(x, codes, scales, out, N, nblk, magic, pdl, res);                                  \
  }                                                                                                \
  extern "C" __global__ void __launch_bounds__(128, 1) q4_gemv_r##R##_u##U##_h2(GEMV_ARGS) {      \
    gemv<R, U, false, true>(x, codes, scales, out, N, nblk, magic, pdl, res);                     \
  }
GEMV_KERNEL(1, 2)
GEMV_KERNEL(2, 2)
GEMV_KERNEL(4, 2)
#define GEMV_NOUT_KERNEL(R)                                                                          \
  extern "C" __global__ void __launch_bounds__(128, 1) q4_gemv_r##R##_u2_nout(GEMV_ARGS) {        \
    gemv<R, 2, true>(x, codes, scales, out, N, nblk, magic, pdl, res, nw, hw, part);              \
  }                                                                                                \
  extern "C" __global__ void __launch_bounds__(128, 1) q4_gemv_r##R##_u2_nout_h2(GEMV_ARGS) {     \
    gemv<R, 2, true, true>(x, codes, scales, out, N, nblk, magic, pdl, res, nw, hw, part);        \
  }
GEMV_NOUT_KERNEL(1)
GEMV_NOUT_KERNEL(2)
GEMV_NOUT_KERNEL(4)

__device__ __forceinline__ void mma_bf16(float& c0, float& c1, float& c2, float& c3, u32 a0, u32 a1,
                                         u32 a2, u32 a3, u32 b0, u32 b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
      "{%0,%1,%2,%3};"
      : "+f"(c0), "+f"(c1), "+f"(c2), "+f"(c3)
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// One step of RP row pairs: code words w (one a row), scales sv, this lane's x fragment xv and
// its block's 136 sum(x), into acc (the lanes whose C element is on the diagonal keep it).
template <int RP>
__device__ __forceinline__ void mma_step(const u32* w, const u16* sv, const U4& xv, float cr, float* acc,
                                         bool odd) {
  const u32 M = 0x000F000Fu, B = 0x43004300u;  // bf16 128 + q, nibbles k and k + 4 of a word
#pragma unroll
  for (int p = 0; p < RP; ++p) {
    const u32 w0 = w[2 * p], w1 = w[2 * p + 1];
    const u32 p0 = (w0 & M) | B, p1 = ((w0 >> 4) & M) | B, p2 = ((w0 >> 8) & M) | B,
              p3 = ((w0 >> 12) & M) | B;
    const u32 q0 = (w1 & M) | B, q1 = ((w1 >> 4) & M) | B, q2 = ((w1 >> 8) & M) | B,
              q3 = ((w1 >> 12) & M) | B;
    float c0 = 0.f, c1 = 0.f, c2 = 0.f, c3 = 0.f;
    mma_bf16(c0, c1, c2, c3, p0, q0, p1, q1, xv.x, xv.y);  // nibbles (0,4), (1,5)
    mma_bf16(c0, c1, c2, c3, p2, q2, p3, q3, xv.z, xv.w);  // nibbles (2,6), (3,7)
    const float v0 = odd ? c1 : c0, v1 = odd ? c3 : c2;
    acc[2 * p] = fmaf(h2f(sv[2 * p]), v0 - cr, acc[2 * p]);
    acc[2 * p + 1] = fmaf(h2f(sv[2 * p + 1]), v1 - cr, acc[2 * p + 1]);
  }
}

// x staged once per CTA: xs [nb8 blocks][4 lanes t] 8 bf16 in the B fragments' order, then
// corr [nb8] = 136 sum(x over the block); blocks past nblk are zeros (so they add 0).
__device__ __forceinline__ void stage_x(const u16* x, int nblk, int nb8, U4* xs, float* corr) {
  for (int bb = threadIdx.x; bb < nb8; bb += blockDim.x) {
    U4 v[4] = {};
    if (bb < nblk) {
      const U4* src = reinterpret_cast<const U4*>(x + (size_t)bb * 32);
      v[0] = ldx128(src), v[1] = ldx128(src + 1), v[2] = ldx128(src + 2), v[3] = ldx128(src + 3);
    }
    const u32 wv[16] = {v[0].x, v[0].y, v[0].z, v[0].w, v[1].x, v[1].y, v[1].z, v[1].w,
                        v[2].x, v[2].y, v[2].z, v[2].w, v[3].x, v[3].y, v[3].z, v[3].w};
    float s = 0.f;
#pragma unroll
    for (int i = 0; i < 16; ++i) s += bf_lo(wv[i]) + bf_hi(wv[i]);
#define XV(k) ((wv[(k) >> 1] >> (((k) & 1) * 16)) & 0xffffu)
#pragma unroll
    for (int t = 0; t < 4; ++t) {  // x(s, t) = x[4 s + t]; pairs (s, s + 4) for s = 0, 1, 2, 3
      U4 o;
      o.x = XV(t) | (XV(16 + t) << 16);
      o.y = XV(4 + t) | (XV(20 + t) << 16);
      o.z = XV(8 + t) | (XV(24 + t) << 16);
      o.w = XV(12 + t) | (XV(28 + t) << 16);
      xs[bb * 4 + t] = o;
    }
#undef XV
    corr[bb] = 136.f * s;
  }
  __syncthreads();
}

// codes as u32 words [N][nblk][4]; the rest as gemv(), in steps of 8 blocks. Dynamic shared
// memory: 68 bytes a block of nb8 = nblk rounded up to 8.
template <int RP, int U>
__device__ __forceinline__ void mma_gemv(const u16* __restrict__ x, const u32* __restrict__ codes,
                                         const u16* __restrict__ scales, u16* __restrict__ out, int N,
                                         int nblk, int pdl, const u16* res) {
  extern __shared__ U4 xs[];
  const int nb8 = (nblk + 7) & ~7;
  float* corr = reinterpret_cast<float*>(xs + nb8 * 4);
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, t = lane & 3;
  const bool odd = g & 1, useful = t == (g >> 1);
  const int row = (blockIdx.x * (blockDim.x >> 5) + warp) * 2 * RP;
  const u32* cp[2 * RP];
  const u16* sp[2 * RP];
#pragma unroll
  for (int r = 0; r < 2 * RP; ++r) {  // rows past N read row N - 1; this lane: word t of block g
    const size_t n = (size_t)min(row + r, N - 1);
    cp[r] = codes + (n * nblk + g) * 4 + t;
    sp[r] = scales + n * nblk + g;
  }
  struct Buf { u32 w[U][2 * RP]; u16 s[U][2 * RP]; } a, b;
  const int full = nblk / (8 * U);
  if (full) load_weights<2 * RP, U, 4>(cp, sp, 0, a.w, a.s);  // before the PDL wait, as gemv()
  if (pdl) pdl_sync();
  stage_x(x, nblk, nb8, xs, corr);
  if (row >= N) return;  // after the CTA's barrier
  float acc[2 * RP];
#pragma unroll
  for (int r = 0; r < 2 * RP; ++r) acc[r] = 0.f;
  pipelined(full, 8 * U, a, b, [&](int k, Buf& d) { load_weights<2 * RP, U, 4>(cp, sp, k, d.w, d.s); },
            [&](int k, const Buf& d) {
#pragma unroll
              for (int u = 0; u < U; ++u)
                mma_step<RP>(d.w[u], d.s[u], xs[(k + 8 * u + g) * 4 + t], corr[k + 8 * u + g], acc, odd);
            });
  for (int kb = full * 8 * U; kb < nblk; kb += 8) {  // single steps; a block past nblk reads the row's last block, x 0
    const int b = min(kb + g, nblk - 1) - g;  // from this lane's block g
    u32 wt[2 * RP];
    u16 st[2 * RP];
#pragma unroll
    for (int r = 0; r < 2 * RP; ++r) {
      wt[r] = ldg32(cp[r] + (long long)b * 4);
      st[r] = ldg16(sp[r] + b);
    }
    mma_step<RP>(wt, st, xs[(kb + g) * 4 + t], corr[kb + g], acc, odd);
  }
#pragma unroll
  for (int r = 0; r < 2 * RP; ++r) acc[r] = useful ? acc[r] : 0.f;  // off-diagonal lanes: 0
  warp_sums<2 * RP>(acc);
#pragma unroll
  for (int r = 0; r < 2 * RP; ++r)
    if (lane == 0 && row + r < N) out[row + r] = out_value(acc[r], res, row + r);
}

#define MMA_KERNEL(U)                                                                                \
  extern "C" __global__ void __launch_bounds__(128, 1) q4_mma_rp2_u##U(GEMV_ARGS) {             \
    mma_gemv<2, U>(x, reinterpret_cast<const u32*>(codes), scales, out, N, nblk, pdl, res);       \
  }
MMA_KERNEL(2)
MMA_KERNEL(4)

#include "q4_ks_cuda.cuh"  // q4_ks and q4_ksx
