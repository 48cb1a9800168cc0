// y[M, N] = x[M, K] @ W[N, K]^T with bf16 weights on CPUs without native bf16 arithmetic (AVX2 +
// FMA: AMD Zen 2/3, Intel before Sapphire Rapids), W packed once at load (flatserve/model/avx2.py).
//
// Why: without AMX / AVX512-BF16, torch's bf16 linear is emulated and slower than fp32, so the
// engine ran fp32 weights (1.24 GB for Gemma 3 270M, twice the bytes a decode step must read).
// Here the weights stay bf16 and are widened to fp32 in registers: bf16 -> fp32 is a 16-bit
// shift. The sums are fp32 FMAs; the result is rounded once (RNE) to x's dtype, as F.linear does.
//
// Packed layout [N/16][K][16]: a 16-column panel is one contiguous stream, each k step 32 bytes
// (one AVX2 load). Within a step the 32-bit lane j holds columns j (low half) and j + 8 (high
// half), so one shift and one mask give columns 0-7 and 8-15 as two fp32 vectors, in order.
// Micro-kernel: up to 6 rows x 16 columns, 12 accumulators, x broadcast from an fp32 copy.
// Decode-sized calls (M <= 16) read each panel from memory once: the 2-3 row blocks after the
// first find it in L1 / L2 (K = 640: 20 KB; K = 2,048: 64 KB). Prompt-sized calls take the
// rows in chunks of kRowChunk (96 rows x K fp32 stay in L2) with every panel streamed per chunk.
// The plain kernel (`linear_plain`) reads W [N, K] as stored: the tied LM head reads the
// embedding table in place (no 335 MB packed copy for Gemma 3 270M).
//
// Without AVX2 + FMA (other compile flags, other architectures) the same loops run in portable
// C++: same layout, same results up to the order of the fp32 sums.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <vector>

#include "cpu_math.h"
#include "greedy_avx2.h"

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define FLATSERVE_AVX2_GEMM 1
#endif

namespace {

constexpr int kMR = 6;           // rows of the packed micro-kernel: 12 of the 16 ymm registers
constexpr int64_t kRowChunk = 96;  // rows of x (fp32) kept in L2 while every panel streams by
// From this many rows a call is compute-bound: W is widened once into an fp32 copy (a few MB,
// freed after the call) and torch's fp32 GEMM (oneDNN / MKL, blocked for the caches) runs it.
// At 512 rows x Gemma's gate_up it ran ~2x this file's micro-kernel (benchmarks/dev/cpu_avx2_gemm.py),
// and the widening is ~5% of the GEMM's time.
constexpr int64_t kTorchRows = 128;

inline float bf16_to_f32(uint16_t h) {
  const uint32_t w = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &w, sizeof(f));
  return f;
}

// fp32 -> bf16 bits, rounded to nearest even (c10's rule for finite values; NaN stays NaN).
inline uint16_t f32_to_bf16(float f) {
  uint32_t w;
  std::memcpy(&w, &f, sizeof(w));
  if ((w & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((w >> 16) | 0x40);
  return static_cast<uint16_t>((w + 0x7fffu + ((w >> 16) & 1u)) >> 16);
}

// 16 fp32 outputs (a row's columns c..c+15) -> y[0..15] in y's dtype, bias (fp32) added first.
template <typename T>
inline void store16(const float* acc, const float* bias, T* y) {
  for (int j = 0; j < 16; ++j) {
    const float v = acc[j] + (bias ? bias[j] : 0.f);
    if constexpr (std::is_same_v<T, float>) y[j] = v;
    else { const uint16_t b = f32_to_bf16(v); std::memcpy(y + j, &b, 2); }
  }
}

#ifdef FLATSERVE_AVX2_GEMM
// Packed micro-kernel: rows x[0..MR) (row stride xs, fp32) times one panel w [K][16] -> acc
// [MR][16] (row r's 16 columns in order).
// Up to 3 rows the FMA chains (2 per row) are too few to hide the FMA latency (4-5 cycles):
// odd k steps then go to a second set of accumulators (S = 2), summed at the end.
template <int MR>
inline void panel_kernel(const float* x, int64_t xs, const uint16_t* w, int64_t K, float* acc) {
  constexpr int S = MR <= 3 ? 2 : 1;
  __m256 c0[S][MR], c1[S][MR];
  for (int s = 0; s < S; ++s)
    for (int r = 0; r < MR; ++r) c0[s][r] = c1[s][r] = _mm256_setzero_ps();
  const __m256i hi = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  auto step = [&](int64_t k, __m256* a0, __m256* a1) {
    const __m256i wv = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + k * 16));
    const __m256 w0 = _mm256_castsi256_ps(_mm256_slli_epi32(wv, 16));  // columns 0-7
    const __m256 w1 = _mm256_castsi256_ps(_mm256_and_si256(wv, hi));   // columns 8-15
    for (int r = 0; r < MR; ++r) {
      const __m256 xb = _mm256_broadcast_ss(x + r * xs + k);
      a0[r] = _mm256_fmadd_ps(xb, w0, a0[r]);
      a1[r] = _mm256_fmadd_ps(xb, w1, a1[r]);
    }
  };
  int64_t k = 0;
  for (; k + S <= K; k += S)
    for (int s = 0; s < S; ++s) step(k + s, c0[s], c1[s]);
  for (; k < K; ++k) step(k, c0[0], c1[0]);
  for (int r = 0; r < MR; ++r) {
    if constexpr (S == 2) {
      c0[0][r] = _mm256_add_ps(c0[0][r], c0[1][r]);
      c1[0][r] = _mm256_add_ps(c1[0][r], c1[1][r]);
    }
    _mm256_storeu_ps(acc + r * 16, c0[0][r]);
    _mm256_storeu_ps(acc + r * 16 + 8, c1[0][r]);
  }
}

using flatserve::hsum8;
using flatserve::widen8;

// Plain micro-kernel: MR rows of x times NB rows of W [N, K] (row stride K) -> out[r * ld + n]
// = x_r . w_n. MR x NB <= 12 accumulators, MR x vectors and one weight vector: 16 registers.
template <int MR, int NB>
inline void dot_kernel(const float* x, int64_t xs, const uint16_t* w, int64_t K, float* out,
                       int64_t ld) {
  __m256 a[MR][NB];
  for (int r = 0; r < MR; ++r)
    for (int n = 0; n < NB; ++n) a[r][n] = _mm256_setzero_ps();
  const int64_t K8 = K & ~int64_t{7};
  for (int64_t k = 0; k < K8; k += 8) {
    __m256 xv[MR];
    for (int r = 0; r < MR; ++r) xv[r] = _mm256_loadu_ps(x + r * xs + k);
    for (int n = 0; n < NB; ++n) {
      const __m256 wv = widen8(w + n * K + k);
      for (int r = 0; r < MR; ++r) a[r][n] = _mm256_fmadd_ps(xv[r], wv, a[r][n]);
    }
  }
  for (int r = 0; r < MR; ++r)
    for (int n = 0; n < NB; ++n) {
      float s = hsum8(a[r][n]);
      for (int64_t k = K8; k < K; ++k) s += x[r * xs + k] * bf16_to_f32(w[n * K + k]);
      out[r * ld + n] = s;
    }
}
#else
template <int MR>
inline void panel_kernel(const float* x, int64_t xs, const uint16_t* w, int64_t K, float* acc) {
  float c[MR][16] = {};
  for (int64_t k = 0; k < K; ++k) {
    float wf[16];
    for (int j = 0; j < 8; ++j) {  // lane j: column j low, column j + 8 high
      wf[j] = bf16_to_f32(w[k * 16 + 2 * j]);
      wf[j + 8] = bf16_to_f32(w[k * 16 + 2 * j + 1]);
    }
    for (int r = 0; r < MR; ++r)
      for (int j = 0; j < 16; ++j) c[r][j] += x[r * xs + k] * wf[j];
  }
  std::memcpy(acc, c, sizeof(c));
}

template <int MR, int NB>
inline void dot_kernel(const float* x, int64_t xs, const uint16_t* w, int64_t K, float* out,
                       int64_t ld) {
  for (int r = 0; r < MR; ++r)
    for (int n = 0; n < NB; ++n) {
      float s = 0.f;
      for (int64_t k = 0; k < K; ++k) s += x[r * xs + k] * bf16_to_f32(w[n * K + k]);
      out[r * ld + n] = s;
    }
}
#endif

void panel_rows(int64_t rows, const float* x, int64_t xs, const uint16_t* w, int64_t K, float* acc) {
  switch (rows) {
    case 6: panel_kernel<6>(x, xs, w, K, acc); break;
    case 5: panel_kernel<5>(x, xs, w, K, acc); break;
    case 4: panel_kernel<4>(x, xs, w, K, acc); break;
    case 3: panel_kernel<3>(x, xs, w, K, acc); break;
    case 2: panel_kernel<2>(x, xs, w, K, acc); break;
    default: panel_kernel<1>(x, xs, w, K, acc); break;
  }
}

// A grow-only fp32 buffer [rows, cols] per slot and thread, for the prompt-sized calls' copies
// (0: W widened, 1: the fp32 product, 2: x widened). Why: where the heap hands freed memory back
// to the OS (device.keep_freed_heap, off without native bf16) these multi-MB copies were faulted
// in page by page at every call: ~20 MB a call and ~0.7 GB a 512-token prompt step for Gemma 3
// 270M. Held, they cost the largest call's size once (~10 MB there, run_torch's column chunks).
// Raw memory wrapped per call (from_blob), not a held at::Tensor: a tensor made inside inference
// mode (an engine step) could not be written outside it (a test, another engine) and vice versa.
at::Tensor scratch(int slot, int64_t rows, int64_t cols) {
  struct Free { void operator()(float* p) const { std::free(p); } };
  thread_local std::unique_ptr<float[], Free> bufs[3];
  thread_local int64_t sizes[3] = {0, 0, 0};
  const int64_t n = std::max<int64_t>(rows * cols, 1);
  if (sizes[slot] < n) {
    bufs[slot].reset();  // the old one first: the peak holds one buffer, not two
    const size_t bytes = (static_cast<size_t>(n) * sizeof(float) + 63) / 64 * 64;
    bufs[slot].reset(static_cast<float*>(std::aligned_alloc(64, bytes)));
    TORCH_CHECK(bufs[slot], "avx2 linear: could not allocate ", bytes, " bytes of scratch");
    sizes[slot] = n;
  }
  return at::from_blob(bufs[slot].get(), {rows, cols}, at::TensorOptions().dtype(at::kFloat));
}

// x [M, K] as fp32, contiguous: the input itself when it already is, else a widened copy (in
// scratch slot 2 for prompt-sized calls, `held`).
at::Tensor as_f32(const at::Tensor& x, bool held = false) {
  if (x.scalar_type() == at::kFloat) return x.contiguous();
  if (!held) return x.to(at::kFloat).contiguous();
  at::Tensor out = scratch(2, x.size(0), x.size(1));
  out.copy_(x);
  return out;
}

std::vector<float> bias_f32(const at::Tensor& bias, int64_t N) {
  if (!bias.numel()) return {};
  TORCH_CHECK(bias.numel() == N, "avx2 linear: bias [N]");
  at::Tensor b = bias.to(at::kFloat).contiguous();
  return std::vector<float>(b.data_ptr<float>(), b.data_ptr<float>() + N);
}

// fp32 -> the value a bf16 store keeps (RNE), as fp32; x itself for fp32 outputs.
template <typename T>
inline float rnd(float v) {
  if constexpr (std::is_same_v<T, float>) return v;
  else return bf16_to_f32(f32_to_bf16(v));
}

// Gated epilogue (AVX2Linear.make_gated: panel 2p holds gate columns 16p.., panel 2p + 1 the up
// columns of the same outputs): y = act(gate) * up, each rounded to T as the separate gate_up
// store and act_and_mul (ops/csrc/fused_cpu.cpp, act_row) round them, with act_row's maths.
template <typename T>
inline void store16_gated(const float* g, const float* u, int act, T* y) {
  for (int j = 0; j < 16; ++j) {
    const float a = rnd<T>(g[j]);
    float v;
    if (act == 2) {  // GELU, tanh form: tanh(z) = 1 - 2 / (exp(2z) + 1)
      const float z = 0.7978845608028654f * (a + 0.044715f * a * a * a);
      v = 0.5f * a * (2.f - 2.f / (flatserve::exp_poly(2.f * z) + 1.f));
    } else {  // SiLU from e = exp(-|a|) <= 1 on both sides of 0
      const float e = flatserve::exp_poly(-std::fabs(a));
      const float r = 1.f / (1.f + e);
      v = a * (a >= 0.f ? r : e * r);
    }
    const float out = rnd<T>(rnd<T>(v) * rnd<T>(u[j]));
    if constexpr (std::is_same_v<T, float>) y[j] = out;
    else { const uint16_t b = f32_to_bf16(out); std::memcpy(y + j, &b, 2); }
  }
}

template <typename T>
void run_gated(const float* xf, int64_t M, int64_t K, const uint16_t* w, int64_t N, int act, T* y) {
  const int64_t P = N / 32, ldy = N / 2;  // output panels, output columns
  for (int64_t m0 = 0; m0 < M; m0 += kRowChunk) {
    const int64_t m1 = std::min(M, m0 + kRowChunk);
    at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
      alignas(32) float ga[kMR * 16], ua[kMR * 16];
      for (int64_t p = p0; p < p1; ++p) {
        const uint16_t* wg = w + 2 * p * K * 16;
        for (int64_t r = m0; r < m1; r += kMR) {
          const int64_t rows = std::min<int64_t>(kMR, m1 - r);
          panel_rows(rows, xf + r * K, K, wg, K, ga);
          panel_rows(rows, xf + r * K, K, wg + K * 16, K, ua);
          for (int64_t i = 0; i < rows; ++i)
            store16_gated<T>(ga + i * 16, ua + i * 16, act, y + (r + i) * ldy + p * 16);
        }
      }
    });
  }
}

// Packed W's panels [g0, g1) -> fp32 [16 (g1 - g0), K] (scratch slot 0), rows in packed column
// order (panel g's columns 16g..16g+15; gated: gate 16 | up 16 of the same outputs, as the
// packing left them).
at::Tensor widen(const uint16_t* w, int64_t g0, int64_t g1, int64_t K) {
  at::Tensor out = scratch(0, 16 * (g1 - g0), K);
  float* o = out.data_ptr<float>();
  at::parallel_for(g0, g1, 1, [&](int64_t a, int64_t b) {
    for (int64_t g = a; g < b; ++g)
      for (int64_t c = 0; c < 16; ++c) {
        const uint16_t* src = w + g * K * 16 + 2 * (c % 8) + c / 8;  // lane of column c
        float* dst = o + ((g - g0) * 16 + c) * K;
        for (int64_t k = 0; k < K; ++k) dst[k] = bf16_to_f32(src[k * 16]);
      }
  });
  return out;
}

// Columns a prompt-sized call widens and multiplies at a time: the held copies (scratch) then
// stay at 512 x K and M x 512 fp32 (5 and 1 MB for Gemma 3 270M's down at 512 rows, against 10.5
// and 8.4 MB for its whole gate_up), and each GEMM is still 512 wide.
constexpr int64_t kTorchCols = 512;

// A prompt-sized call through torch's fp32 GEMM on a widened copy of W, kTorchCols columns at a
// time, then this file's epilogues (bias and rounding, or the gated act(gate) * up) on the fp32
// result.
template <typename T>
void run_torch(const at::Tensor& xf, const uint16_t* w, int64_t N, const float* bias, int act, T* y) {
  const int64_t M = xf.size(0), K = xf.size(1), G = N / 16, step = kTorchCols / 16;
  for (int64_t g0 = 0; g0 < G; g0 += step) {
    const int64_t g1 = std::min(G, g0 + step), nc = 16 * (g1 - g0);
    at::Tensor c = scratch(1, M, nc);  // [M, nc] fp32, packed column order
    at::mm_out(c, xf, widen(w, g0, g1, K).t());
    const float* cp = c.data_ptr<float>();
    at::parallel_for(0, M, 16, [&](int64_t r0, int64_t r1) {
      for (int64_t r = r0; r < r1; ++r)
        for (int64_t p = 0; p < (act ? nc / 32 : nc / 16); ++p) {
          const float* cr = cp + r * nc;
          if (act) {  // p: a gate 16 | up 16 pair, 16 outputs
            store16_gated<T>(cr + 32 * p, cr + 32 * p + 16, act, y + r * (N / 2) + g0 * 8 + 16 * p);
          } else {
            const int64_t col = g0 * 16 + 16 * p;  // panel p's first output column
            store16<T>(cr + 16 * p, bias ? bias + col : nullptr, y + r * N + col);
          }
        }
    });
  }
}

template <typename T>
void run_packed(const float* xf, int64_t M, int64_t K, const uint16_t* w, int64_t N,
                const float* bias, T* y) {
  const int64_t G = N / 16;
  for (int64_t m0 = 0; m0 < M; m0 += kRowChunk) {
    const int64_t m1 = std::min(M, m0 + kRowChunk);
    // Panels split evenly over the threads: a decode call's whole weight is one stream each.
    at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
      alignas(32) float acc[kMR * 16];
      for (int64_t g = g0; g < g1; ++g) {
        const uint16_t* wp = w + g * K * 16;
        for (int64_t r = m0; r < m1; r += kMR) {
          const int64_t rows = std::min<int64_t>(kMR, m1 - r);
          panel_rows(rows, xf + r * K, K, wp, K, acc);
          for (int64_t i = 0; i < rows; ++i)
            store16<T>(acc + i * 16, bias ? bias + g * 16 : nullptr, y + (r + i) * N + g * 16);
        }
      }
    });
  }
}

// x rows (1-3) times 8 W rows -> out [rows][8]: 3 and 2 rows in two 4-column halves (12 / 8
// accumulators), one row in one pass of 8 (8 chains: a single one would wait on each FMA).
inline void dot_rows(int64_t rows, const float* x, int64_t K, const uint16_t* w, float* out) {
  if (rows == 3) {
    dot_kernel<3, 4>(x, K, w, K, out, 8);
    dot_kernel<3, 4>(x, K, w + 4 * K, K, out + 4, 8);
  } else if (rows == 2) {
    dot_kernel<2, 4>(x, K, w, K, out, 8);
    dot_kernel<2, 4>(x, K, w + 4 * K, K, out + 4, 8);
  } else {
    dot_kernel<1, 8>(x, K, w, K, out, 8);
  }
}

template <typename T>
void run_plain(const float* xf, int64_t M, int64_t K, const uint16_t* w, int64_t N,
               const float* bias, T* y) {
  constexpr int NB = 8, MR = 3;
  constexpr int64_t kCols = 64;  // W rows per task: 64 x K bf16 (80 KB at K = 640) from L2
  for (int64_t m0 = 0; m0 < M; m0 += kRowChunk) {
    const int64_t m1 = std::min(M, m0 + kRowChunk);
    at::parallel_for(0, (N + kCols - 1) / kCols, 1, [&](int64_t b0, int64_t b1) {
      alignas(32) float out[MR * NB];
      for (int64_t n0 = b0 * kCols; n0 < std::min(N, b1 * kCols); n0 += NB) {
        const int64_t nb = std::min<int64_t>(NB, N - n0);
        for (int64_t r = m0; r < m1; r += MR) {
          const int64_t rows = std::min<int64_t>(MR, m1 - r);
          const float* xr = xf + r * K;
          const uint16_t* wn = w + n0 * K;
          if (nb == NB) dot_rows(rows, xr, K, wn, out);
          else
            for (int64_t i = 0; i < rows; ++i)
              for (int64_t n = 0; n < nb; ++n) dot_kernel<1, 1>(xr + i * K, K, wn + n * K, K, out + i * NB + n, 1);
          for (int64_t i = 0; i < rows; ++i)
            for (int64_t n = 0; n < nb; ++n) {
              const float v = out[i * NB + n] + (bias ? bias[n0 + n] : 0.f);
              if constexpr (std::is_same_v<T, float>) y[(r + i) * N + n0 + n] = v;
              else { const uint16_t b = f32_to_bf16(v); std::memcpy(y + (r + i) * N + n0 + n, &b, 2); }
            }
        }
      }
    });
  }
}

void check_x(const at::Tensor& x, int64_t K, const char* what) {
  TORCH_CHECK(x.is_cpu() && x.dim() == 2 && x.size(1) == K, what, ": x [M, K] on the CPU, K = ", K);
  TORCH_CHECK(x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat,
              what, ": x must be bfloat16 or float32");
}

// x [M, K] (bf16 or fp32) @ packed W [N/16, K, 16] bf16 (+ bias [N]) -> [M, N] in x's dtype.
// act 1 / 2 (SiLU / GELU-tanh; W repacked by AVX2Linear.make_gated, no bias): act(gate) * up,
// [M, N / 2].
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& bias, int64_t act) {
  TORCH_CHECK(packed.scalar_type() == at::kBFloat16 && packed.dim() == 3 && packed.size(2) == 16 &&
              packed.is_contiguous(), "avx2 linear: packed W [N/16, K, 16] bf16, contiguous");
  const int64_t K = packed.size(1), N = packed.size(0) * 16, M = x.size(0);
  check_x(x, K, "avx2 linear");
  TORCH_CHECK(act >= 0 && act <= 2 && (act == 0 || (N % 32 == 0 && !bias.numel())),
              "avx2 linear: act 0, 1 (silu) or 2 (gelu-tanh); gated: N % 32 == 0, no bias");
  at::Tensor y = at::empty({M, act ? N / 2 : N}, x.options());
  if (M == 0) return y;
  const at::Tensor xf = as_f32(x, M >= kTorchRows);
  const auto* w = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  if (M >= kTorchRows) {
    const std::vector<float> b = bias_f32(bias, N);
    const float* bp = b.empty() ? nullptr : b.data();
    if (x.scalar_type() == at::kFloat) run_torch<float>(xf, w, N, bp, static_cast<int>(act), y.data_ptr<float>());
    else run_torch<at::BFloat16>(xf, w, N, bp, static_cast<int>(act), y.data_ptr<at::BFloat16>());
    return y;
  }
  if (act) {
    if (x.scalar_type() == at::kFloat) run_gated<float>(xf.data_ptr<float>(), M, K, w, N, act, y.data_ptr<float>());
    else run_gated<at::BFloat16>(xf.data_ptr<float>(), M, K, w, N, act, y.data_ptr<at::BFloat16>());
    return y;
  }
  const std::vector<float> b = bias_f32(bias, N);
  const float* bp = b.empty() ? nullptr : b.data();
  if (x.scalar_type() == at::kFloat) run_packed<float>(xf.data_ptr<float>(), M, K, w, N, bp, y.data_ptr<float>());
  else run_packed<at::BFloat16>(xf.data_ptr<float>(), M, K, w, N, bp, y.data_ptr<at::BFloat16>());
  return y;
}

// x [M, K] @ plain W [N, K]^T (bf16, read in place) (+ bias) -> [M, N] in x's dtype.
at::Tensor linear_plain(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias) {
  TORCH_CHECK(weight.scalar_type() == at::kBFloat16 && weight.dim() == 2 && weight.is_contiguous(),
              "avx2 linear_plain: W [N, K] bf16, contiguous");
  const int64_t N = weight.size(0), K = weight.size(1), M = x.size(0);
  check_x(x, K, "avx2 linear_plain");
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  const at::Tensor xf = as_f32(x);
  const std::vector<float> b = bias_f32(bias, N);
  const float* bp = b.empty() ? nullptr : b.data();
  const auto* w = reinterpret_cast<const uint16_t*>(weight.data_ptr());
  if (x.scalar_type() == at::kFloat) run_plain<float>(xf.data_ptr<float>(), M, K, w, N, bp, y.data_ptr<float>());
  else run_plain<at::BFloat16>(xf.data_ptr<float>(), M, K, w, N, bp, y.data_ptr<at::BFloat16>());
  return y;
}

bool vectorized() {
#ifdef FLATSERVE_AVX2_GEMM
  return true;
#else
  return false;
#endif
}

// The AMX kernel's greedy_candidates (amx_gemm_cpu.cpp) on AVX2 (flatserve/csrc/greedy_avx2.h):
// x [M <= 16, K] bf16; wq [N, K64] bytes q + 64 in greedy_head.greedy_layout's order; s, c [N]
// fp32; xabs [M] fp32 -> (offsets [M + 1], rows, union) int64, as there. qn [N] fp32 (|q_n|_2
// rounded up) bounds the first of the two stages (greedy_avx2.h rows).
std::vector<at::Tensor> greedy_candidates(const at::Tensor& x, const at::Tensor& wq, const at::Tensor& s,
                                          const at::Tensor& c, const at::Tensor& xabs, const at::Tensor& qn) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.size(0) <= 16 &&
              wq.dim() == 2 && wq.scalar_type() == at::kByte && wq.is_contiguous() &&
              wq.size(1) == (x.size(1) + 63) / 64 * 64 && wq.size(0) % 32 == 0,
              "avx2 greedy_candidates: x [M <= 16, K] bf16, wq [N % 32, K rounded up to 64] uint8; got x ",
              x.sizes(), ", wq ", wq.sizes());
  const int64_t M = x.size(0), K = x.size(1), N = wq.size(0), K64 = wq.size(1);
  TORCH_CHECK(s.numel() == N && c.numel() == N && qn.numel() == N && xabs.numel() == M && s.is_contiguous() &&
              c.is_contiguous() && qn.is_contiguous() && xabs.is_contiguous() && s.scalar_type() == at::kFloat &&
              c.scalar_type() == at::kFloat && qn.scalar_type() == at::kFloat && xabs.scalar_type() == at::kFloat,
              "avx2 greedy_candidates: s, c, qn [N] and xabs [M] fp32");
  std::vector<int64_t> offsets(M + 1, 0), rows, all;
#ifdef FLATSERVE_AVX2_GEMM
  namespace ga = flatserve::greedy_avx2;
  ga::X8 x8;
  const at::Tensor xf = x.to(at::kFloat).contiguous();
  ga::pack_x8(xf.data_ptr<float>(), M, K, K64, x8);
  const int64_t G = N / 32, P = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), G));
  std::vector<ga::Part> parts(P);
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p)
      ga::rows(wq.data_ptr<uint8_t>(), s.data_ptr<float>(), c.data_ptr<float>(), qn.data_ptr<float>(),
               xabs.data_ptr<float>(), x8, M, K64, G * p / P, G * (p + 1) / P, parts[p]);
  });
  for (int64_t t = 0; t < M; ++t) {
    float best = -INFINITY;
    for (const auto& part : parts) best = std::max(best, part.best[t]);
    const float thr = best - ga::tie_margin(best);
    for (const auto& part : parts)  // parts and their lists run in ascending row order
      for (const ga::Cand& cd : part.cand[t])
        if (cd.upper >= thr) rows.push_back(cd.n);
    offsets[t + 1] = static_cast<int64_t>(rows.size());
  }
  all = rows;
  std::sort(all.begin(), all.end());
  all.erase(std::unique(all.begin(), all.end()), all.end());
#else
  TORCH_CHECK(false, "avx2 greedy_candidates: this build has no AVX2 + FMA");
#endif
  auto opt = at::TensorOptions().dtype(at::kLong);
  return {torch::tensor(offsets, opt), torch::tensor(rows, opt), torch::tensor(all, opt)};
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("vectorized", &vectorized, "compiled with the AVX2 + FMA kernels (else portable C++)");
  mod.def("linear", &linear, "x [M, K] @ packed W [N/16, K, 16] bf16 (+ bias) -> [M, N] in x's dtype; "
          "act 1 / 2: gated, [M, N / 2]",
          py::arg("x"), py::arg("packed"), py::arg("bias"), py::arg("act") = 0);
  mod.def("linear_plain", &linear_plain, "x [M, K] @ plain W [N, K]^T bf16 (+ bias) -> [M, N]");
  mod.def("greedy_candidates", &greedy_candidates,
          "rows of a 7-bit weight copy that may hold each x row's bf16 argmax -> (offsets, rows, union)");
}

TORCH_LIBRARY_FRAGMENT(TORCH_EXTENSION_NAME, m) {
  m.def("avx2_linear(Tensor x, Tensor w_packed, Tensor bias, int act) -> Tensor", &linear);
}
