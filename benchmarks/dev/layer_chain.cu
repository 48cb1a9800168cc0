// Prototype (benchmarks/dev/layer_chain.py): a decoder layer's four one-row q4_0 GEMVs (q|k|v,
// o, gate|up, down) for L layers in ONE persistent kernel, phases separated by a grid barrier,
// against one launch a GEMV. Appended to flatserve/ops/csrc/q4_gemv_cuda.cu by the driver (its
// helpers: ldg128, step, warp_sums, ...). Only the GEMVs: no norm, rope, attention or act, so it
// measures what not draining between the linears is worth.
//
// A warp's work in a phase is a flat list of items (task, group): tasks of R rows dealt round
// robin over the grid's warps, groups of U steps of 32 blocks; the register double buffer runs
// across task boundaries (a task of K = 4096 is only 2 groups), and the next phase's first item
// is loaded before the barrier. x of each phase is staged per CTA in shared memory (written by
// other CTAs in this launch, so read through L2, .cg), swizzled so a lane's four 16-byte reads of
// its block hit distinct banks.
struct Lin { const U4* codes; const u16* scales; int n, nblk; };
struct Layer { Lin l[4]; };

__device__ __forceinline__ U4 ldcg128(const void* p) {
  U4 v;
  asm volatile("ld.global.cg.v4.u32 {%0,%1,%2,%3}, [%4];"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// All CTAs of the grid meet, in two halves (the counter is zeroed before the launch; the target
// grows by the grid each barrier): arrive publishes this CTA's stores (one fence, by thread 0,
// after the CTA's barrier: a fence waits for its thread's loads in flight, so the next phase's
// weight loads are issued between arrive and wait, not before), wait spins until every CTA
// arrived.
__device__ __forceinline__ void arrive(u32* bar) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();
    atomicAdd(bar, 1u);
  }
}
__device__ __forceinline__ void wait_all(const u32* bar, u32 target) {
  if (threadIdx.x == 0) {
    u32 v;
    asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(bar) : "memory");
    while (v < target) {
      __nanosleep(32);
      asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(bar) : "memory");
    }
  }
  __syncthreads();
}

template <int R, int U>
struct CBuf { U4 c[U][R]; u16 s[U][R]; };

template <int R, int U>
struct Phase {
  const U4* codes;
  const u16* scales;
  int n, nblk, gpt, items, W, gw, lane;
  __device__ __forceinline__ Phase(const Lin& l, int W_, int gw_, int lane_)
      : codes(l.codes), scales(l.scales), n(l.n), nblk(l.nblk), W(W_), gw(gw_), lane(lane_) {
    gpt = nblk / (32 * U);
    const int tasks = (n + R - 1) / R;
    items = gw < tasks ? ((tasks - 1 - gw) / W + 1) * gpt : 0;
  }
  __device__ __forceinline__ int row0(int i) const { return (gw + (i / gpt) * W) * R; }
  __device__ __forceinline__ void load(int i, CBuf<R, U>& d) const {
    const int r0 = row0(i), kb = (i % gpt) * 32 * U + lane;
#pragma unroll
    for (int u = 0; u < U; ++u)
#pragma unroll
      for (int r = 0; r < R; ++r) {
        const size_t off = (size_t)min(r0 + r, n - 1) * nblk + kb + 32 * u;
        d.c[u][r] = ldg128(codes + off);
        d.s[u][r] = ldg16(scales + off);
      }
  }
};

// x [nblk * 32] bf16 -> xs: block b's 16-byte chunk c at b * 4 + (c ^ ((b >> 1) & 3)). A thread's
// loads 8 at a time, then their stores, so the staging is a round trip per 8 loads, not per load.
__device__ __forceinline__ void stage(const u16* x, int nblk, U4* xs) {
  const int n = nblk * 4;
  for (int j0 = 0; j0 * 128 < n; j0 += 8) {  // rounds of 8 loads a thread (more spill registers)
    U4 v[8];
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int i = threadIdx.x + (j0 + j) * 128;
      if (i < n) v[j] = ldcg128(x + (size_t)i * 8);
    }
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      const int i = threadIdx.x + (j0 + j) * 128, b = i >> 2, c = i & 3;
      if (i < n) xs[b * 4 + (c ^ ((b >> 1) & 3))] = v[j];
    }
  }
  __syncthreads();
}

__device__ __forceinline__ unsigned long long now_ns() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %globaltimer;" : "=l"(t));
  return t;
}

template <int R, int U>
__device__ __forceinline__ void run_phase(const Phase<R, U>& P, const U4* xs, u16* out, CBuf<R, U>& a,
                                          u32 m0, u32 m1) {
  CBuf<R, U> b;
  float acc[R];
#pragma unroll
  for (int r = 0; r < R; ++r) acc[r] = 0.f;
  const int sw = (P.lane >> 1) & 3;
  auto run = [&](int i, const CBuf<R, U>& d) {
    const int g = i % P.gpt;
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const U4* q = xs + (size_t)(g * 32 * U + 32 * u + P.lane) * 4;
      const U4 xv[4] = {q[0 ^ sw], q[1 ^ sw], q[2 ^ sw], q[3 ^ sw]};
      step<R>(xv, d.c[u], d.s[u], acc, m0, m1);
    }
    if (g == P.gpt - 1) {
      warp_sums<R>(acc);
      const int r0 = P.row0(i);
#pragma unroll
      for (int r = 0; r < R; ++r) {
        if (P.lane == 0 && r0 + r < P.n) out[r0 + r] = f2bf(acc[r]);
        acc[r] = 0.f;
      }
    }
  };
  int i = 0;
  for (; i + 1 < P.items; i += 2) {
    P.load(i + 1, b);
    run(i, a);
    if (i + 2 < P.items) P.load(i + 2, a);
    run(i + 1, b);
  }
  if (i < P.items) run(i, a);
}

// bufs: x (layer input, [4096]), y0 (q|k|v out), y1 (o out), y2 (gate|up out), y3 (down out =
// next layer's x: the driver passes y3 == x). Phase inputs: x, y0[:K_o], y1, y2[:K_down].
// R per phase: q|k|v 2 (6144 rows: 3,072 tasks ~ 2.9 rounds of 1,056 warps on 132 SMs at 2 CTAs
// of 4 warps), the others 4.
template <int RQ, int R, int U>
__device__ __forceinline__ void chain(const Layer* layers, int nl, u16* x, u16* y0, u16* y1, u16* y2,
                                      u32* bar, int magic, int mode,
                                      unsigned long long* ts) {
  extern __shared__ U4 xs[];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int W = gridDim.x * (blockDim.x >> 5), gw = blockIdx.x * (blockDim.x >> 5) + warp;
  const u32 m0 = (u32)magic, m1 = (u32)magic - 0x2000000u;
  u32 target = 0;
  // One phase: the first item's weights loaded between the previous phase's arrive and the wait
  // for every CTA, then x staged, then the GEMV (mode 1: the barriers and staging only).
#define PHASE(RR, IDX, IN, OUT)                                                                  \
  {                                                                                              \
    Phase<RR, U> P(L.l[IDX], W, gw, lane);                                                       \
    CBuf<RR, U> a;                                                                               \
    const bool sync = (li || IDX) && mode != 3;                                                  \
    if (sync) arrive(bar);                                                                       \
    if (P.items && mode != 2) P.load(0, a);                                                      \
    if (sync) wait_all(bar, target += gridDim.x);                                                \
    if (P.items && mode == 2) P.load(0, a);                                                      \
    unsigned long long* t = ts + ((size_t)(li * 4 + IDX) * gridDim.x + blockIdx.x) * 3;          \
    if (ts && threadIdx.x == 0) t[0] = now_ns();                                                 \
    stage(IN, P.nblk, xs);                                                                       \
    if (ts && threadIdx.x == 0) t[1] = now_ns();                                                 \
    if (mode != 1) run_phase(P, xs, OUT, a, m0, m1);                                             \
    if (ts && threadIdx.x == 0) t[2] = now_ns();                                                 \
  }
  for (int li = 0; li < nl; ++li) {
    const Layer& L = layers[li];
    PHASE(RQ, 0, x, y0)
    PHASE(R, 1, y0, y1)
    PHASE(R, 2, y1, y2)
    PHASE(R, 3, y2, x)
  }
#undef PHASE
}

#define CHAIN_KERNEL(RQ, R, U)                                                                       \
  extern "C" __global__ void __launch_bounds__(128, 1) q4_chain_q##RQ##_r##R##_u##U(                 \
      const Layer* layers, int nl, u16* x, u16* y0, u16* y1, u16* y2, u32* bar, int magic,         \
      int mode, unsigned long long* ts) {                                                          \
    chain<RQ, R, U>(layers, nl, x, y0, y1, y2, bar, magic, mode, ts);                                         \
  }
CHAIN_KERNEL(2, 4, 1)
CHAIN_KERNEL(4, 4, 1)
CHAIN_KERNEL(2, 2, 1)
CHAIN_KERNEL(2, 2, 2)
CHAIN_KERNEL(2, 4, 2)
