// q4_ks and q4_ksx, the one-row q4_0 GEMVs that split K over a CTA's warps (and over a cluster's
// CTAs): included at the end of q4_gemv_cuda.cu, whose types, loads, conversions, FMA step and
// packed-fp16 step (step_h2, x_pairs) they use; one NVRTC program (flatserve/model/cuda_gemv.py).

// q4_ks (one row, K <= 4,096: nblk <= 128; cuda_gemv.choose takes it from 40 x the SMs rows):
// many small warps each issuing all its loads at once, the shape a plain read needs on an H200
// (benchmarks/dev/read_floor.py: 14.2 MB read in 5.3 us at 16 CTAs of 128 threads an SM with 2
// loads a thread, 7.0-8.7 at 2 CTAs, the FMA kernel's occupancy). A CTA owns RT = 8 rows and its
// 4 warps the 4 slices of 32 blocks (lane l: block l of its warp's slice); a lane issues its RT
// rows' 16 bytes before the PDL wait, then loads its block's x (kept in registers across the
// rows). Each lane sums its block's 32 products and scales them (as step()); a butterfly over the
// lanes leaves each row's sum on 32 / RT lanes; the 4 warps add theirs in order in shared memory.
// On an H200, us a call against the kernels before it (benchmarks/dev/gemv_kernels.py, fp32
// products): q|k|v 6.5 / 6.8, gate|up 21.6 / 23.7, the LM head 85.5 / 94.0. Fewer rows and K up
// to 32,768 take q4_ksx below (o and down of Llama-3-8B); for down a loop over slices inside one
// CTA took 15.3-18.1 us and one CTA of 14 warps 14.9, against the FMA kernel's 13.5-13.9.

// v[RT]: this lane's partial for each of RT rows -> v[0] = row (lane / (32 / RT))'s sum over the
// warp, on the 32 / RT lanes of that row.
template <int RT>
__device__ __forceinline__ float row_sums(float (&v)[RT], int lane) {
  int n = RT;
#pragma unroll
  for (int o = 16; o >= 32 / RT && n > 1; o >>= 1, n >>= 1) {  // halve the rows a lane holds
    const bool up = lane & o;
#pragma unroll
    for (int i = 0; i < n / 2; ++i) {
      const float send = up ? v[i] : v[i + n / 2], keep = up ? v[i + n / 2] : v[i];
      v[i] = keep + __shfl_xor_sync(0xffffffffu, send, o);
    }
  }
#pragma unroll
  for (int o = 32 / RT / 2; o; o >>= 1) v[0] += __shfl_xor_sync(0xffffffffu, v[0], o);
  return v[0];
}

// act(g) of a gated MLP, as triton_ops._act_mul_kernel: 1 SiLU, 2 GELU (tanh approximation).
template <int GLU>
__device__ __forceinline__ float act(float g) {
  if (GLU == 1) return g * (1.f / (1.f + __expf(-g)));
  const float z = 0.7978845608028654f * (g + 0.044715f * g * g * g);
  return 0.5f * g * (1.f + (2.f * (1.f / (1.f + __expf(-2.f * z))) - 1.f));
}

// x (a lane's 32 values, 4 chunks) -> bf16(x * w) in place, and -> the sum of x^2 (fp32).
__device__ __forceinline__ float norm_in(U4 (&xv)[4], const U4 (&wv)[4]) {
  float ss = 0.f;
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    u32 hv[4] = {xv[c].x, xv[c].y, xv[c].z, xv[c].w};
    const u32 wk[4] = {wv[c].x, wv[c].y, wv[c].z, wv[c].w};
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const float lo = bf_lo(hv[i]), hi = bf_hi(hv[i]);
      ss = fmaf(lo, lo, fmaf(hi, hi, ss));
      hv[i] = (u32)f2bf(lo * bf_lo(wk[i])) | ((u32)f2bf(hi * bf_hi(wk[i])) << 16);
    }
    xv[c] = U4{hv[0], hv[1], hv[2], hv[3]};
  }
  return ss;
}

// A lane's block of x against its RT rows' blocks, then the lanes' sums per row (row_sums: row
// r's sum lands in lane r * 32 / RT of each warp).
template <int RT, bool H2>
__device__ __forceinline__ float ks_sums(const U4 (&xv)[4], const U4 (&c)[RT], const u16 (&sc)[RT],
                                         u32 m0, u32 m1, int lane) {
  float acc[RT];
  if (H2) {
    u32 xh[16];
    const float k = x_pairs(xv, xh);
    const u32 hm = m0 ^ 0x2F006400u;  // fp16 (1024, 1024) in a register: LOP3 takes one immediate
#pragma unroll
    for (int r = 0; r < RT; ++r) acc[r] = step_h2(xh, c[r], sc[r], hm, k);
  } else {
#pragma unroll
    for (int r = 0; r < RT; ++r) {
      acc[r] = 0.f;
      step<1>(xv, &c[r], &sc[r], &acc[r], m0, m1);
    }
  }
  return row_sums<RT>(acc, lane);
}

// NORM (cuda_stack.py's one-token decoder step): x is the residual stream h, and the kernel is the
// RMSNorm before the linear too: out = rsqrt(mean(h^2) + eps) * (W (h * nw)). Each CTA covers all
// of K (nblk <= 32 x its warps), so its lanes' sums of h^2 meet in the shared-memory sum it already
// does: no extra pass, no extra barrier, and the norm weights load before the PDL wait. (The
// reference rounds h / rms to bf16 before * nw; here the scale comes after the sum, in fp32.)
// MODE 2 (the GEMV after a NOUT one, gemv() above): x is already bf16(h * nw), and the CTA sums
// the NOUT kernel's nparts partials of h^2 (each thread a fixed share, in order) for the scale
// instead of h^2 over x: the same norm, none of its elementwise work here. MODE 1 is NORM.
// GLU (with MODE 1 or 2, the gate|up linear): a CTA's first RT / 2 rows are gate rows j.., the rest the
// up rows N / 2 + j..; it stores act(gate) * up (N / 2 outputs) with the bits of the linear
// followed by _act_mul_kernel. res: added to each output (the residual add; not with GLU).
template <int RT, int MODE, int GLU, bool H2>
__device__ __forceinline__ void ks_gemv(const u16* __restrict__ x, const U4* __restrict__ codes,
                                        const u16* __restrict__ scales, u16* __restrict__ out,
                                        int N, int nblk, int magic, int pdl, const u16* res,
                                        const u16* __restrict__ nw, float eps, const float* part,
                                        int nparts) {
  constexpr bool NORM = MODE == 1;
  constexpr int OUT = GLU ? RT / 2 : RT;  // outputs a CTA
  __shared__ float red[4][RT], ssq[4];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int kb = warp * 32 + lane, row0 = blockIdx.x * OUT, nout = GLU ? N / 2 : N;
  const bool in = kb < nblk;  // blocks past nblk: x 0, the row's last block
  const int bk = in ? kb : nblk - 1;
  const u32 m0 = (u32)magic, m1 = (u32)magic - 0x2000000u;
  U4 c[RT], wv[4] = {};
  u16 sc[RT];
#pragma unroll
  for (int r = 0; r < RT; ++r) {  // rows past the end read the last one
    const int j = min(row0 + r % OUT, nout - 1);
    const size_t off = (size_t)(GLU && r >= OUT ? nout + j : j) * nblk + bk;
    c[r] = ldg128(codes + off);
    sc[r] = ldg16(scales + off);
  }
  if (NORM && in) {
    const U4* q = reinterpret_cast<const U4*>(nw) + (size_t)kb * 4;
    wv[0] = ldg128(q), wv[1] = ldg128(q + 1), wv[2] = ldg128(q + 2), wv[3] = ldg128(q + 3);
  }
  // A store that needs every weight word, never taken, ahead of the wait: its branch ends the
  // loads' basic block. Without it ptxas put all of q4_ks's weight loads after
  // griddepcontrol.wait (SASS), none in flight across it. A compiler that folds threadIdx.x ==
  // 1024 under the 128-thread bound would undo this: benchmarks/dev/pdl_sass_check.sh counts the
  // loads on either side of the wait, per kernel (NVRTC 13.0 on an H200: 16 before, 2026-11-29).
  u32 h = 0;
#pragma unroll
  for (int r = 0; r < RT; ++r) h ^= c[r].x ^ c[r].y ^ c[r].z ^ c[r].w ^ sc[r];
#pragma unroll
  for (int i = 0; i < 4; ++i) h ^= wv[i].x ^ wv[i].y ^ wv[i].z ^ wv[i].w;
  if (threadIdx.x == 1024) red[0][0] = __uint_as_float(h);
  if (pdl) pdl_sync();
  U4 xv[4] = {};
  if (in) {
    const U4* q = reinterpret_cast<const U4*>(x) + (size_t)kb * 4;
    xv[0] = ldx128(q), xv[1] = ldx128(q + 1), xv[2] = ldx128(q + 2), xv[3] = ldx128(q + 3);
  }
  if (MODE) {
    float ss = 0.f;
    if (NORM) ss = norm_in(xv, wv);
    else
      for (int i = threadIdx.x; i < nparts; i += 128) ss += ldxf(part + i);
#pragma unroll
    for (int o = 16; o; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if (lane == 0) ssq[warp] = ss;
  }
  const float v = ks_sums<RT, H2>(xv, c, sc, m0, m1, lane);
  if ((lane & (32 / RT - 1)) == 0) red[warp][lane / (32 / RT)] = v;
  __syncthreads();
  const int t = threadIdx.x;
  if (t >= OUT || row0 + t >= nout) return;
  const float sum = ((red[0][t] + red[1][t]) + red[2][t]) + red[3][t];  // the warps' sums in order
  const float scale = MODE ? rsqrtf((((ssq[0] + ssq[1]) + ssq[2]) + ssq[3]) / (float)(nblk * 32) + eps) : 1.f;
  if (GLU) {
    const float up = ((red[0][t + OUT] + red[1][t + OUT]) + red[2][t + OUT]) + red[3][t + OUT];
    const float g = bf_round(sum * scale), u = bf_round(up * scale);
    out[row0 + t] = f2bf(bf_round(act<GLU>(g)) * u);
  } else {
    out[row0 + t] = out_value(sum * scale, res, row0 + t);
  }
}

// Thread block clusters (sm_90): this CTA's rank and the cluster's size, the cluster barrier
// (arrive and wait: release / acquire by default; the first arrive relaxed), and a store into
// rank 0's shared memory. Below sm_90 a CTA is a cluster of one: the barrier is the CTA's.
__device__ __forceinline__ void cluster_place(u32& rank, u32& size) {
  rank = 0, size = 1;
#if __CUDA_ARCH__ >= 900
  asm volatile("mov.u32 %0, %%cluster_ctarank;" : "=r"(rank));
  asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(size));
#endif
}
__device__ __forceinline__ void cluster_arrive_relaxed() {
#if __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.relaxed.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_sync_parts() {  // the arrive (release) and wait (acquire)
#if __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.arrive.aligned;" ::: "memory");
  asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
#else
  __syncthreads();
#endif
}
__device__ __forceinline__ void cluster_wait() {
#if __CUDA_ARCH__ >= 900
  asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void st_rank0(float* p, float v) {  // p: this CTA's copy of the variable
#if __CUDA_ARCH__ >= 900
  u32 a;
  asm volatile("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
  asm volatile("mapa.shared::cluster.u32 %0, %0, 0;" : "+r"(a));
  asm volatile("st.shared::cluster.f32 [%0], %1;" :: "r"(a), "f"(v) : "memory");
#else
  *p = v;
#endif
}

// ksx: q4_ks split along K over a cluster of S CTAs (S = ceil(nblk / 128) <= 8, the cluster launch
// attribute; cuda_gemv.choose), for the linears q4_ks cannot cover: K > 4,096 (Llama-3-8B's
// down, 448 blocks: S = 4) and the residual GEMVs that hand the norm on (o, down: NOUT). CTA rank
// s takes blocks 128 s .. 128 s + 127 of RT rows, as q4_ks takes all of them; the ranks' warp
// sums meet in rank 0's shared memory (st.shared::cluster, one cluster barrier), which adds them
// in rank order, then stores as gemv() does: out_value (res), and with NOUT hw = bf16(h * nw)
// and part[CTA group] = the sum of h^2 over its RT rows (q4_ks MODE 2's input, n / RT of them).
// Each CTA loads its weights before the PDL wait as q4_ks does. The first cluster arrive is made
// there too: no CTA stores into rank 0 before every CTA of the cluster has started.
// On an H200 (one call each, raw docs/benchmarks/raw/gpu_h200_q4_0_ksx/): the b1 Llama-3-8B q4_0
// forward 1.77 against 1.84 ms with the FMA kernel for o and down (step_breakdown.py), though
// alone, back to back in a CUDA graph, down takes 14.5 against 13.5 us and o 5.4 against 5.2 with
// the hand-off (gemv_kernels.py --fused): in the forward its weights are in flight before the
// kernel ahead ends, as q4_ks's are. 16 rows a CTA (q4_ks and q4_ksx) made the forward 2.05
// against 1.85 ms at 8.
template <int RT, bool NOUT, bool H2>
__device__ __forceinline__ void ksx_gemv(const u16* __restrict__ x, const U4* __restrict__ codes,
                                         const u16* __restrict__ scales, u16* __restrict__ out, int N,
                                         int nblk, int magic, int pdl, const u16* res,
                                         const u16* __restrict__ nw, u16* __restrict__ hw,
                                         float* __restrict__ part) {
  __shared__ float red[8][4][RT];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  u32 s, S;  // this CTA's rank in its cluster, the cluster's CTAs
  cluster_place(s, S);
  const int row0 = (int)(blockIdx.x / S) * RT, kb = (int)s * 128 + warp * 32 + lane;
  const bool in = kb < nblk;  // blocks past nblk: x 0, the row's last block
  const int bk = in ? kb : nblk - 1;
  const u32 m0 = (u32)magic, m1 = (u32)magic - 0x2000000u;
  U4 c[RT];
  u16 sc[RT];
#pragma unroll
  for (int r = 0; r < RT; ++r) {  // rows past the end read the last one
    const size_t off = (size_t)min(row0 + r, N - 1) * nblk + bk;
    c[r] = ldg128(codes + off);
    sc[r] = ldg16(scales + off);
  }
  u32 h = 0;  // as q4_ks: a never-taken store that needs every weight word ends the loads' block
#pragma unroll
  for (int r = 0; r < RT; ++r) h ^= c[r].x ^ c[r].y ^ c[r].z ^ c[r].w ^ sc[r];
  if (threadIdx.x == 1024) red[0][0][0] = __uint_as_float(h);
  cluster_arrive_relaxed();
  if (pdl) pdl_sync();
  U4 xv[4] = {};
  if (in) {
    const U4* q = reinterpret_cast<const U4*>(x) + (size_t)kb * 4;
    xv[0] = ldx128(q), xv[1] = ldx128(q + 1), xv[2] = ldx128(q + 2), xv[3] = ldx128(q + 3);
  }
  const float v = ks_sums<RT, H2>(xv, c, sc, m0, m1, lane);
  cluster_wait();  // every CTA of the cluster has started: rank 0's shared memory is there
  if ((lane & (32 / RT - 1)) == 0) st_rank0(&red[s][warp][lane / (32 / RT)], v);
  cluster_sync_parts();
  const int t = threadIdx.x;
  if (s != 0 || t >= 32) return;
  float sum = 0.f, f = 0.f;
  for (u32 j = 0; j < S; ++j)  // the ranks in order, each one's warps in order
    if (t < RT) sum += ((red[j][0][t] + red[j][1][t]) + red[j][2][t]) + red[j][3][t];
  if (t < RT && row0 + t < N) {
    const u16 o = out_value(sum, res, row0 + t);
    out[row0 + t] = o;
    if (NOUT) {
      f = bf2f(o);
      hw[row0 + t] = f2bf(f * bf2f(ldg16(nw + row0 + t)));
    }
  }
  if (!NOUT) return;
  float ss = f * f;  // every row is < N here (N % RT == 0)
#pragma unroll
  for (int o = RT / 2; o; o >>= 1) ss += __shfl_xor_sync(0xffffffffu, ss, o);
  if (t == 0) part[blockIdx.x / S] = ss;
}
#define KSX_KERNEL(NAME, RT, NOUT)                                                                  \
  extern "C" __global__ void __launch_bounds__(128) NAME(GEMV_ARGS) {                              \
    ksx_gemv<RT, NOUT, false>(x, codes, scales, out, N, nblk, magic, pdl, res, nw, hw, part);     \
  }                                                                                                \
  extern "C" __global__ void __launch_bounds__(128) NAME##_h2(GEMV_ARGS) {                         \
    ksx_gemv<RT, NOUT, true>(x, codes, scales, out, N, nblk, magic, pdl, res, nw, hw, part);      \
  }
KSX_KERNEL(q4_ksx_rt8, 8, false)
KSX_KERNEL(q4_ksx_nout_rt8, 8, true)

#define KS_KERNEL(NAME, RT, MODE, GLU)                                                              \
  extern "C" __global__ void __launch_bounds__(128) NAME(GEMV_ARGS) {                              \
    ks_gemv<RT, MODE, GLU, false>(x, codes, scales, out, N, nblk, magic, pdl, res, nw, eps, part,  \
                                  nparts);                                                         \
  }                                                                                                \
  extern "C" __global__ void __launch_bounds__(128) NAME##_h2(GEMV_ARGS) {                         \
    ks_gemv<RT, MODE, GLU, true>(x, codes, scales, out, N, nblk, magic, pdl, res, nw, eps, part,   \
                                 nparts);                                                          \
  }
KS_KERNEL(q4_ks_rt8, 8, 0, 0)
KS_KERNEL(q4_ks_norm_rt8, 8, 1, 0)
KS_KERNEL(q4_ks_norm_silu_rt8, 8, 1, 1)
KS_KERNEL(q4_ks_norm_gelu_rt8, 8, 1, 2)
KS_KERNEL(q4_ks_scaled_rt8, 8, 2, 0)
KS_KERNEL(q4_ks_scaled_silu_rt8, 8, 2, 1)
KS_KERNEL(q4_ks_scaled_gelu_rt8, 8, 2, 2)
