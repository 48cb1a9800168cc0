// Linears on GGUF block weights read in place (flatserve/model/quant.py): Q4_0, Q5_0, Q8_0, Q4_K,
// Q5_K, Q6_K, any row count (decode steps of 1-16 rows, prompt chunks of thousands).
//
// How (the scheme llama.cpp's CPU backend uses, written from its published block layouts):
// activations are quantized per 32 values to int16 with one fp32 scale (`quantize_act`), and each
// weight block is dotted against them in int16 -> int32, scaled once per 16 or 32 values. One
// weight row at a time is unpacked from its blocks into a common form that every format fits:
//
//   v[K] int8          the value codes (signed: q - 8, q - 16, q - 32; unsigned for Q4_K/Q5_K's
//                      q in 0..31, which fits int8 too)
//   sc[K/16] fp32      the scale of each 16 values (d, or d * sub-block scale)
//   mn[K/32] fp32      K formats' per-sub-block offsets (dmin * m), 0 elsewhere
//
//   y[m, n] = sum_b xd[m, b] * (sc[2b] * <v, xq>_{b, 0:16} + sc[2b+1] * <v, xq>_{b, 16:32})
//             - sum_b mn[b] * xs[m, b]                       (xs[m, b] = xd[m, b] * sum xq_b)
//
// The unpacked row (K bytes + K/8 floats) stays in L1 and serves every activation row of the
// call, so a 16-row decode step reads each weight block from memory once. AVX2 (+FMA, F16C):
// unpack and dot per 32 values in 256-bit registers, the weight codes sign-extended to int16 and
// multiplied by vpmaddwd. Without AVX2 the same arithmetic runs in plain C++ (its block dot in
// SSE2 on x86: quant_blocks.h dot_block). At the amx level every format takes AMX-INT8 tiles or
// their bits in AVX-512 lanes instead (tile_rows below); at
// the avx512 level the tiles' bits too, their integer dots in VNNI lanes (csrc/quant_vnni.h); at
// the avx2 and avxvnni levels the tiles' bits as well, in 256-bit lanes (csrc/quant_tiles_ymm.h:
// rows8, then the tiles, ymm_rows below). So the vector path above serves only the avx512 build's
// formats left off quant.ROWS16_FORMATS (an A/B switch) and, in plain C++, the portable build.
//
// Why int16 activation codes (llama.cpp uses int8): int8 codes (amax / 127 per step) cost the
// default GGUF 4 points of teacher-forced top-1 agreement (95.9% against its fp32 weights,
// tests/model/test_quant_fidelity.py); int16 codes (amax / 32639) err 256x less, as little as
// the two int8 passes (x, then what x's codes missed) this kernel ran before, for half their
// multiplies: one vpmaddwd per 16 products, where two passes took two vpmaddubsw + two vpmaddwd
// per 32. A product is at most 128 x 32639, so four of them (one int32 lane) stay below 2^24:
// exact in fp32. 32639 = 127 * 256 + 127, so a code splits into two signed bytes (the VNNI
// path of the avx512 and amx levels, csrc/quant_rows.h).
//
// A block's 32 codes are stored in the order 0-7, 16-23, 8-15, 24-31 (ACT_ORDER): vpmaddwd on
// the weights' unpacklo/unpackhi halves then leaves values 0-15 (one 16-value scale) in lanes
// 0-3 and 16-31 (the other) in lanes 4-7, so one conversion and one FMA scale both halves.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <algorithm>
#include <string>
#include <type_traits>
#include <vector>

#include "quant_blocks.h"
#include "quant_amx.h"
#include "quant_rows.h"
#include "quant_vnni.h"
#include "quant_tiles_ymm.h"
#include "greedy_q4.h"
#include "greedy_q8.h"
#include "greedy_q4t.h"

namespace greedy_q4 = flatserve::greedy_q4;

namespace {

using namespace flatserve::qblocks;

struct Acts {  // activations quantized per 32 values
  const int16_t* q;  // [M, K], each block in ACT_ORDER
  const float* d;    // [M, K/32]
  const float* s;    // [M, K/32]: d * sum of the block's codes
  int64_t K;
};

#if QG_AVX2
// MT activation rows (m0 ..) against one weight row -> out[MT]. The row is a source of blocks:
// `get(b, codes, scales)` and `mn` (the 32-value offsets, read after the loop); one dot for
// every source, so a row's bits do not depend on where its blocks were unpacked.
template <int MT, typename Row>
void dot_src(Row& w, const Acts& a, int64_t m0, bool mins, float* out) {
  const int64_t K = a.K, nb = K / 32;
  const int16_t* xq[MT];
  const float* xd[MT];
  for (int t = 0; t < MT; ++t) { xq[t] = a.q + (m0 + t) * K; xd[t] = a.d + (m0 + t) * nb; }
  __m256 acc[MT];
  for (int t = 0; t < MT; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m256i wv;
    float s0, s1;
    w.get(b, wv, s0, s1);
    const __m256 scv = _mm256_set_m128(_mm_set1_ps(s1), _mm_set1_ps(s0));
    // int16 weights [0-7 | 16-23] and [8-15 | 24-31]: each byte doubled, then shifted down signed
    const __m256i wa = _mm256_srai_epi16(_mm256_unpacklo_epi8(wv, wv), 8);
    const __m256i wb = _mm256_srai_epi16(_mm256_unpackhi_epi8(wv, wv), 8);
    for (int t = 0; t < MT; ++t) {
      const int16_t* x = xq[t] + 32 * b;
      const __m256i p = madd2(wa, ld(x), wb, ld(x + 16));
      // lanes 0-3: values 0-15, lanes 4-7: values 16-31 (ACT_ORDER), as scv's scales
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), _mm256_mul_ps(scv, _mm256_set1_ps(xd[t][b])), acc[t]);
    }
  }
  for (int t = 0; t < MT; ++t) {
    const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(acc[t]), _mm256_extractf128_ps(acc[t], 1));
    const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
    out[t] = _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
  }
  if (mins)  // K formats: nb is a multiple of 8; 8 lanes, not one latency-bound scalar chain
    for (int t = 0; t < MT; ++t) {
      const float* xs = a.s + (m0 + t) * nb;
      __m256 m = _mm256_setzero_ps();
      for (int64_t b = 0; b < nb; b += 8) m = _mm256_fmadd_ps(_mm256_loadu_ps(w.mn + b), _mm256_loadu_ps(xs + b), m);
      const __m128 m4 = _mm_add_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
      const __m128 m2 = _mm_add_ps(m4, _mm_movehl_ps(m4, m4));
      out[t] -= _mm_cvtss_f32(_mm_add_ss(m2, _mm_shuffle_ps(m2, m2, 1)));
    }
}

struct BufferedRow {  // a row unpacked into the common form (or a raw Q8_0 row)
  const Unpacked& u;
  const float* mn = u.mn;
  __attribute__((always_inline)) inline void get(int64_t b, __m256i& wv, float& s0, float& s1) const {
    if (u.raw) {
      const uint8_t* blk = u.raw + 34 * b;
      wv = ld(blk + 2);
      s0 = s1 = h2f(blk);
    } else {
      wv = ld(u.v + 32 * b);
      s0 = u.sc[2 * b], s1 = u.sc[2 * b + 1];
    }
  }
};

template <int MT>
void dot_rows(const Unpacked& w, const Acts& a, int64_t m0, bool mins, float* out) {
  BufferedRow r{w};
  dot_src<MT>(r, a, m0, mins, out);
}
#else
template <int MT>
void dot_rows(const Unpacked& w, const Acts& a, int64_t m0, bool mins, float* out) {
  const int64_t K = a.K, nb = K / 32;
  for (int t = 0; t < MT; ++t) {
    const int16_t* xq = a.q + (m0 + t) * K;
    const float* xd = a.d + (m0 + t) * nb;
    float acc = 0.f;
    for (int64_t b = 0; b < nb; ++b) {
      const int8_t* v = w.raw ? reinterpret_cast<const int8_t*>(w.raw + 34 * b + 2) : w.v + 32 * b;
      const float sc0 = w.raw ? h2f(w.raw + 34 * b) : w.sc[2 * b];
      const float sc1 = w.raw ? sc0 : w.sc[2 * b + 1];
      int32_t s0, s1;
      dot_block(v, xq + 32 * b, s0, s1);
      acc += xd[b] * (sc0 * float(s0) + sc1 * float(s1));
    }
    if (mins) {
      const float* xs = a.s + (m0 + t) * nb;
      float m = 0.f;
      for (int64_t b = 0; b < nb; ++b) m += w.mn[b] * xs[b];
      acc -= m;
    }
    out[t] = acc;
  }
}
#endif

template <typename T>
inline void store(T* p, float x) {
  if constexpr (std::is_same_v<T, float>) {
    *p = x;
  } else {
    *p = static_cast<T>(x);  // c10's conversions round to nearest even
  }
}

// Output rows a worker unpacks at a time: 16 rows of K = 2,048 are 32 KiB plus scales, so the
// block stays in L1/L2 while every activation tile passes over it.
constexpr int64_t NB = 16;

#if QG_AVX2
// M <= 4 rows: each weight row's blocks dotted from their stored bytes (DirectRow).
template <int fmt, typename T>
void gemm_direct(const Acts& a, int64_t M, const uint8_t* w, int64_t N, int64_t row_bytes, T* out,
                 int64_t ldo) {
  constexpr bool mins = known_layout(fmt).mins;
  at::parallel_for(0, (N + NB - 1) / NB, 1, [&](int64_t c0, int64_t c1) {
    std::vector<float> mn(a.K / 32);
    DirectRow<fmt> dr{nullptr, mn.data(), {}};
    float res[4];
    for (int64_t n = c0 * NB; n < std::min(N, c1 * NB); ++n) {
      dr.row = w + n * row_bytes;
      if (M == 1) dot_src<1>(dr, a, 0, mins, res);
      else if (M == 2) dot_src<2>(dr, a, 0, mins, res);
      else if (M == 3) dot_src<3>(dr, a, 0, mins, res);
      else dot_src<4>(dr, a, 0, mins, res);
      for (int t = 0; t < M; ++t) store(out + t * ldo + n, res[t]);
    }
  });
}
#endif

#if defined(__AVX512VNNI__)
// Weights over this many bytes take rows16's Prefetch (csrc/quant_blocks.h). At the amx level the
// default model's 178 MB Q8_0 LM head only: one-request decode steps alternated with and without
// it (`cpu_profile_step.py 1 --by-kernel`, 5 pairs, 2-core Xeon, 2026-11-27) put the head at
// 9.2-13.2 (median 11.0) against 12.1-13.4 (12.2) ms, while the layers' linears, which its caches
// held, ran 9-12% slower with it (`cpu_quant_ab.py`; an all-at-once prefetch then). At the avx512
// level every weight: on a 2-core Zen 4 with every format on rows16 (2026-11-28), one-request
// steps' layers took 7.0-7.4 ms with it against 10.4-15.2 without (and 7.4-11.0 on the AVX2
// kernels), at 8 and 16 requests no difference beyond the noise.
inline int64_t stream_bytes() {
#ifdef FLATSERVE_AMX
  if (flatserve::amx_available()) return 64 << 20;
#endif
  return 0;
}

// 16 weight rows at a time, four activation rows at a time, by VNNI byte dots (csrc/quant_rows.h
// rows16_b32 / rows16_k), the tiles' bits: at the amx level up to tile_rows rows, at the avx512
// level (AMD Zen 4) up to vnni_rows for the formats g_rows16_mask names.
template <int fmt, typename T>
void gemm_rows16(const Acts& a, int64_t M, const uint8_t* w, int64_t N, int64_t row_bytes, T* out, int64_t ldo) {
  const int64_t nb = a.K / 32;
  std::vector<int8_t> xv(M * nb * 64);
  std::vector<int32_t> xsum(M * nb * 2);
  for (int64_t m = 0; m < M; ++m) vnni_acts(a.q + m * a.K, nb, xv.data() + m * nb * 64, xsum.data() + m * nb * 2);
  const bool stream = N * row_bytes > stream_bytes();
  at::parallel_for(0, (N + 15) / 16, 1, [&](int64_t c0, int64_t c1) {
    alignas(64) float res[16];
    __m512 acc[4];
    const uint8_t* rows[16];
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t n0 = 16 * c, nn = std::min<int64_t>(16, N - n0);
      for (int64_t r = 0; r < 16; ++r) rows[r] = w + (n0 + std::min(r, nn - 1)) * row_bytes;  // past N: read, not stored
      Prefetch pf;  // the next 16 rows (contiguous), over this group's (M + 3) / 4 * nb blocks
      if (stream && c + 1 < c1)
        pf.spread(w + (n0 + 16) * row_bytes, std::min<int64_t>(16, N - n0 - 16) * row_bytes, (M + 3) / 4 * nb);
      for (int64_t m0 = 0; m0 < M; m0 += 4) {
        const int64_t ms = std::min<int64_t>(4, M - m0);
        const int8_t* xp[4];
        const int32_t* sp[4];
        const float *dp[4], *ssp[4];
        for (int64_t t = 0; t < 4; ++t) {
          const int64_t m = m0 + std::min(t, ms - 1);
          xp[t] = xv.data() + m * nb * 64, sp[t] = xsum.data() + m * nb * 2, dp[t] = a.d + m * nb, ssp[t] = a.s + m * nb;
        }
        if constexpr (known_layout(fmt).block == 32) {
          if (ms == 1) rows16_b32<fmt, 1>(rows, xp, sp, dp, nb, acc, pf);
          else if (ms == 2) rows16_b32<fmt, 2>(rows, xp, sp, dp, nb, acc, pf);
          else if (ms == 3) rows16_b32<fmt, 3>(rows, xp, sp, dp, nb, acc, pf);
          else rows16_b32<fmt, 4>(rows, xp, sp, dp, nb, acc, pf);
        } else {
          if (ms == 1) rows16_k<fmt, 1>(rows, xp, sp, dp, ssp, nb, acc, pf);
          else if (ms == 2) rows16_k<fmt, 2>(rows, xp, sp, dp, ssp, nb, acc, pf);
          else if (ms == 3) rows16_k<fmt, 3>(rows, xp, sp, dp, ssp, nb, acc, pf);
          else rows16_k<fmt, 4>(rows, xp, sp, dp, ssp, nb, acc, pf);
        }
        for (int64_t t = 0; t < ms; ++t) {
          _mm512_store_ps(res, acc[t]);
          for (int64_t r = 0; r < nn; ++r) store(out + (m0 + t) * ldo + n0 + r, res[r]);
        }
      }
    }
  });
}
#endif

#if defined(__AVX512VNNI__)
// gemm_rows16 for a run-time format.
template <typename T>
void rows16_any(int fmt, const Acts& a, int64_t M, const uint8_t* w, int64_t N, int64_t row_bytes, T* out,
                int64_t ldo) {
  switch (fmt) {
    case Q4_0: return gemm_rows16<Q4_0>(a, M, w, N, row_bytes, out, ldo);
    case Q5_0: return gemm_rows16<Q5_0>(a, M, w, N, row_bytes, out, ldo);
    case Q8_0: return gemm_rows16<Q8_0>(a, M, w, N, row_bytes, out, ldo);
    case Q4_K: return gemm_rows16<Q4_K>(a, M, w, N, row_bytes, out, ldo);
    case Q5_K: return gemm_rows16<Q5_K>(a, M, w, N, row_bytes, out, ldo);
    case Q6_K: return gemm_rows16<Q6_K>(a, M, w, N, row_bytes, out, ldo);
    case Q4_G: return gemm_rows16<Q4_G>(a, M, w, N, row_bytes, out, ldo);
  }
}
#endif

// gemm's `path`: AUTO picks by row count; ROWS and TILES force one (tests, benchmarks/dev).
enum Path : int64_t { AUTO = 0, ROWS = 1, TILES = 2 };

// Without AMX (the avx512 level: AMD Zen 4), the formats (a bit per GGML type) whose calls take
// the tiles' bits: rows16 at up to vnni_rows rows, the tiles in VNNI lanes above; the others take
// the AVX2 paths below. flatserve/model/quant.py sets it (set_rows16_formats; every format by
// default, quant.ROWS16_FORMATS says why). All of them until it is called. Bit min(type, 62):
// Q4_G's type is 100.
int64_t g_rows16_mask = -1;
// Activation rows a pass of the AVX2 vector path at 5+ rows: 8 or 4 (set_pass_rows: the A/B of
// benchmarks/dev/cpu_quant_row1.py --rows 16 --pass-rows 4,8). On a Zen 4 at 16 rows, 8 took the
// avx512 build's Q8_0 LM head 0.88-0.91x the time, q5_0 0.81-0.91x, q6_k 1.02-1.08x; in the AVX2
// build (forced; 16 vector registers) the head 0.94-1.0x, q5_0 0.92-0.97x, q6_k 1.06-1.09x: no
// clear gain there, and no AVX2-only CPU to check it on, so 4. Since the avx2 and avxvnni builds
// call rows8 and the tiles instead (ymm_rows), only the avx512 build's masked formats use it.
#if defined(__AVX512VL__)
int64_t g_pass_rows = 8;
#else
int64_t g_pass_rows = 4;
#endif

// At the amx level every format takes the AMX tiles (csrc/quant_amx.h) above tile_rows rows and
// rows16 at or below, the same bits either way. The tiles do 16 weight rows x 16 activation rows
// per instruction pair but cost a fixed unpack, transpose and 16-row scaling per weight group.
// Against the AVX2 vector path (`benchmarks/dev/cpu_quant_tiles.py`, 2-core Xeon with AMX,
// 2026-11-27): at 1 row rows16 0.42-0.61x, the tiles 2.0-2.3x; at 6 rows q4_k 640 x 2048 rows16
// 0.66x, tiles 0.81x, q5_0 4096 x 640 0.48x / 0.64x, but the Q8_0 head 0.74x / 0.63x; from 8
// rows the tiles lead (16 rows: 0.46-0.58x against rows16's 0.69-1.03x). Without tiles (the
// avx512 level) the same Xeon forced down put rows16 at 0.42-0.86x the vector path's time at
// 1-4 rows, 0.69-1.03x at 16; that level's split is vnni_rows, below.
inline int64_t tile_rows(int fmt) { return fmt == Q8_0 ? 4 : 6; }
// The same split at the avx512 level, rows16 against the tiles in VNNI lanes (csrc/quant_vnni.h),
// whose dots cost the same at 1-16 rows: on a 2-core Zen 4 (`benchmarks/dev/cpu_quant_tiles.py`,
// 8efa8c4, 2026-11-28) the Q8_0 LM head's tiles took 1.08-1.20x rows16's time at 6 rows and
// 0.87-0.95x at 8; the layers' q5_0 / q4_k / q6_k 0.95-1.43x at 6 rows, 0.77-1.09x at 8 and
// 0.41-0.69x at 16.
inline int64_t vnni_rows(int fmt) { return fmt == Q8_0 ? 6 : 8; }
// Below AVX-512 (the avx2 and avxvnni builds), rows8 up to this many rows and the tiles in 256-bit
// lanes above (csrc/quant_tiles_ymm.h), the same bits. rows8 against the tiles, ms a call, the
// default GGUF's shapes (`FLATSERVE_CPU_ISA=avxvnni benchmarks/dev/cpu_ymm_paths.py`, 2-core Zen 5,
// 2026-11-28, one sitting): q5_0 4,096 x 640 at 6 / 8 / 16 rows 0.34 / 0.40 / 0.80
// against 0.35 / 0.36 / 0.38; q4_k 640 x 2,048 0.26 / 0.29 / 0.57 against 0.27 / 0.28 / 0.30; Q8_0
// (no unpack in rows8) 640 x 1,024 0.08 / 0.12 at 8 / 12 rows against 0.09 / 0.10, the 262k x 640
// LM head 17.5 / 22.5 at 6 / 8 against 21.3 / 21.8.
inline int64_t ymm_rows(int fmt) { return fmt == Q8_0 ? 8 : 6; }

template <typename T>
void gemm_impl(const Acts& a, int64_t M, const uint8_t* w, int64_t N, int64_t row_bytes, int fmt,
               T* out, int64_t ldo, int64_t path = AUTO) {
  const Layout L = layout(fmt);
  const int64_t K = a.K;
  if (M == 0) return;  // the direct path's dot would read 4 rows of an empty activation buffer
#ifdef FLATSERVE_AMX
  if (flatserve::amx_available()) {
    if (path == TILES || (path == AUTO && M > tile_rows(fmt))) {
      flatserve::qamx::ActTiles tiles;
      flatserve::qamx::act_tiles(a.q, a.d, a.s, M, K, tiles);
      return flatserve::qamx::gemm(tiles, M, w, N, row_bytes, fmt, out, ldo, [](T* p, float x) { store(p, x); });
    }
    return rows16_any(fmt, a, M, w, N, row_bytes, out, ldo);
  }
#endif
#if defined(__AVX512VNNI__)
  if (path != AUTO || ((g_rows16_mask >> std::min(fmt, 62)) & 1) || !QG_AVX2) {
    if (path == TILES || (path == AUTO && M > vnni_rows(fmt))) {  // the tiles in VNNI lanes
      flatserve::qblocks::ActPairs pairs;
      flatserve::qblocks::act_pairs(a.q, a.d, a.s, M, K, pairs);
      return flatserve::qvnni::gemm(pairs, M, w, N, row_bytes, fmt, out, ldo, [](T* p, float x) { store(p, x); });
    }
    return rows16_any(fmt, a, M, w, N, row_bytes, out, ldo);
  }
#endif
#if QG_AVX2 && !defined(__AVX512VNNI__)
  // Below AVX-512 every call has the tiles' bits: the tiles in 256-bit lanes above ymm_rows rows,
  // rows8 at or below (csrc/quant_tiles_ymm.h).
  if (path == TILES || (path == AUTO && M > ymm_rows(fmt))) {
    flatserve::qblocks::ActPairs pairs;
    flatserve::qblocks::act_pairs(a.q, a.d, a.s, M, K, pairs);
    return flatserve::qymm::gemm(pairs, M, w, N, row_bytes, fmt, out, ldo, [](T* p, float x) { store(p, x); });
  }
  if (path == ROWS || path == AUTO)
    return flatserve::qymm::gemm_rows8_any(fmt, a.q, a.d, a.s, K, M, w, N, row_bytes, out, ldo,
                                           [](T* p, float x) { store(p, x); });
#endif
#if QG_AVX2
  if (M <= 4) {
    switch (fmt) {
      case Q4_0: return gemm_direct<Q4_0>(a, M, w, N, row_bytes, out, ldo);
      case Q5_0: return gemm_direct<Q5_0>(a, M, w, N, row_bytes, out, ldo);
      case Q8_0: return gemm_direct<Q8_0>(a, M, w, N, row_bytes, out, ldo);
      case Q4_K: return gemm_direct<Q4_K>(a, M, w, N, row_bytes, out, ldo);
      case Q5_K: return gemm_direct<Q5_K>(a, M, w, N, row_bytes, out, ldo);
      case Q6_K: return gemm_direct<Q6_K>(a, M, w, N, row_bytes, out, ldo);
      case Q4_G: return gemm_direct<Q4_G>(a, M, w, N, row_bytes, out, ldo);
    }
  }
#endif
  at::parallel_for(0, (N + NB - 1) / NB, 1, [&](int64_t c0, int64_t c1) {
    std::vector<int8_t> vbuf(NB * K);
    std::vector<float> scbuf(NB * K / 16), mnbuf(NB * K / 32, 0.f);
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t n0 = c * NB, nn = std::min(NB, N - n0);
      Unpacked rows[NB];
      for (int64_t r = 0; r < nn; ++r) {
        rows[r] = {vbuf.data() + r * K, scbuf.data() + r * K / 16, mnbuf.data() + r * K / 32};
        if (fmt == Q8_0)
          rows[r].raw = w + (n0 + r) * row_bytes;
        else
          unpack_row(w + (n0 + r) * row_bytes, L, fmt, K, rows[r]);
      }
      float res[8];
      int64_t m0 = 0;
      // g_pass_rows = 8: 8 activation rows a pass over each weight row, so a block's unpack and
      // scales serve twice the rows (each row's sums in the same order: the same bits). Measured
      // in docs/performance-cpu.md ("AVX-512 (AMD EPYC, Zen 4)").
      for (; g_pass_rows == 8 && m0 + 8 <= M; m0 += 8)
        for (int64_t r = 0; r < nn; ++r) {
          dot_rows<8>(rows[r], a, m0, L.mins, res);
          for (int t = 0; t < 8; ++t) store(out + (m0 + t) * ldo + n0 + r, res[t]);
        }
      for (; m0 + 4 <= M; m0 += 4)
        for (int64_t r = 0; r < nn; ++r) {
          dot_rows<4>(rows[r], a, m0, L.mins, res);
          for (int t = 0; t < 4; ++t) store(out + (m0 + t) * ldo + n0 + r, res[t]);
        }
      // 1-3 rows left: one dot for all of them, each row its own chain (single-row dots one
      // after the other were latency-bound).
      const int64_t rest = M - m0;
      if (rest > 0)
        for (int64_t r = 0; r < nn; ++r) {
          if (rest == 1) dot_rows<1>(rows[r], a, m0, L.mins, res);
          else if (rest == 2) dot_rows<2>(rows[r], a, m0, L.mins, res);
          else dot_rows<3>(rows[r], a, m0, L.mins, res);
          for (int t = 0; t < rest; ++t) store(out + (m0 + t) * ldo + n0 + r, res[t]);
        }
    }
  });
}

}  // namespace

// x [M, K] -> int16 codes [M, K] (each 32-value block in ACT_ORDER), scales and scaled sums
// [M, K / 32].
std::vector<at::Tensor> quantize_act(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.size(1) % 32 == 0, "quantize_act: x [M, K%32==0] contiguous");
  const int64_t M = x.size(0), K = x.size(1);
  auto q = at::empty({M, K}, x.options().dtype(at::kShort));
  auto d = at::empty({M, K / 32}, x.options().dtype(at::kFloat));
  auto s = at::empty({M, K / 32}, x.options().dtype(at::kFloat));
  if (x.scalar_type() == at::kFloat)
    quantize_rows(x.data_ptr<float>(), M, K, q.data_ptr<int16_t>(), d.data_ptr<float>(), s.data_ptr<float>());
  else if (x.scalar_type() == at::kBFloat16)
    quantize_rows(x.data_ptr<at::BFloat16>(), M, K, q.data_ptr<int16_t>(), d.data_ptr<float>(), s.data_ptr<float>());
  else if (x.scalar_type() == at::kHalf)
    quantize_rows(x.data_ptr<at::Half>(), M, K, q.data_ptr<int16_t>(), d.data_ptr<float>(), s.data_ptr<float>());
  else
    TORCH_CHECK(false, "quantize_act: float32, bfloat16 or float16 activations");
  return {q, d, s};
}

// out[:, col : col + N] = x @ W^T for W [N, K] stored as `fmt` blocks (uint8 [N, row_bytes]);
// x as quantize_act's codes.
void gemm(const at::Tensor& xq, const at::Tensor& xd, const at::Tensor& xs, const at::Tensor& w,
          int64_t fmt, at::Tensor& out, int64_t col, int64_t path) {
  const int64_t M = xq.size(0), K = xq.size(1), N = w.size(0);
  TORCH_CHECK(xq.scalar_type() == at::kShort && xq.is_contiguous() && xd.is_contiguous() && xs.is_contiguous() &&
              xd.size(0) == M && xd.size(1) == K / 32 && xs.sizes() == xd.sizes(),
              "quant gemm: activations as quantize_act returns them");
  const Layout L = layout(static_cast<int>(fmt));
  TORCH_CHECK(K % L.block == 0 && w.size(1) == K / L.block * L.type_size && w.is_contiguous() &&
              w.scalar_type() == at::kByte, "quant gemm: weight bytes do not match K = ", K);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == M && out.stride(1) == 1 && col + N <= out.size(1),
              "quant gemm: out [M, >= col + N] with unit column stride");
  const Acts a{xq.data_ptr<int16_t>(), xd.data_ptr<float>(), xs.data_ptr<float>(), K};
  const uint8_t* wp = w.data_ptr<uint8_t>();
  const int F = static_cast<int>(fmt);
  if (out.scalar_type() == at::kFloat)
    gemm_impl(a, M, wp, N, w.size(1), F, out.data_ptr<float>() + col, out.stride(0), path);
  else if (out.scalar_type() == at::kBFloat16)
    gemm_impl(a, M, wp, N, w.size(1), F, out.data_ptr<at::BFloat16>() + col, out.stride(0), path);
  else if (out.scalar_type() == at::kHalf)
    gemm_impl(a, M, wp, N, w.size(1), F, out.data_ptr<at::Half>() + col, out.stride(0), path);
  else
    TORCH_CHECK(false, "quant gemm: float32, bfloat16 or float16 output");
}

namespace {
// No fused multiply-add here: sc * v - mn rounded twice, as torch computes it.
template <typename T>
__attribute__((optimize("fp-contract=off"))) void dense_row(const int8_t* v, const float* sc,
                                                             const float* mn, bool mins, int64_t K, T* o) {
#if defined(__AVX512F__)
  // 16 values (one 16-value scale) a step, the same two roundings: the scalar loop, with c10's
  // conversion per value, took 2.1-2.5 ms for the default GGUF's 4096 x 640 gate_up in bf16 on a
  // 2-core Zen 4, half the time of the 256-row prompt GEMM it feeds.
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, c10::BFloat16>) {
    for (int64_t k = 0; k < K; k += 16) {
      const __m128i c = _mm_loadu_si128(reinterpret_cast<const __m128i*>(v + k));
      __m512 x = _mm512_mul_ps(_mm512_set1_ps(sc[k / 16]), _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(c)));
      if (mins) x = _mm512_sub_ps(x, _mm512_set1_ps(mn[k / 32]));
      if constexpr (std::is_same_v<T, float>) _mm512_storeu_ps(o + k, x);
      else _mm256_storeu_si256(reinterpret_cast<__m256i*>(o + k), flatserve::bf16_rne(x));
    }
    return;
  }
#endif
  for (int64_t k = 0; k < K; ++k) {
    const float x = sc[k / 16] * static_cast<float>(v[k]);
    o[k] = static_cast<T>(mins ? x - mn[k / 32] : x);
  }
}
}  // namespace

// W [N, K] stored as `fmt` blocks -> out [N, K] (fp32 / bf16 / fp16): the torch reference's
// arithmetic (d * sc first, then times the code, minus dmin * m), so fp32 results are its bits.
void dequant(const at::Tensor& w, int64_t fmt, at::Tensor& out) {
  const Layout L = layout(static_cast<int>(fmt));
  const int64_t N = w.size(0), K = out.size(1);
  TORCH_CHECK(out.size(0) == N && out.is_contiguous() && w.is_contiguous() &&
              w.size(1) == K / L.block * L.type_size, "quant dequant: shapes");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, out.scalar_type(), "dequant", [&] {
    scalar_t* o = out.data_ptr<scalar_t>();
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
      std::vector<int8_t> v(K);
      std::vector<float> sc(K / 16), mn(K / 32, 0.f);
      for (int64_t n = n0; n < n1; ++n) {
        unpack_row(w.data_ptr<uint8_t>() + n * w.size(1), L, static_cast<int>(fmt), K,
                   {v.data(), sc.data(), mn.data()});
        dense_row(v.data(), sc.data(), mn.data(), L.mins, K, o + n * K);
      }
    });
  });
}

// One packed linear (QuantLinear.pack): int64 header words nseg, K, N, then per segment fmt,
// rows, row_bytes, byte offset; the segments' blocks follow. x [T, K] -> x @ W^T (+ bias) [T, N]
// in x's dtype, on int16 activation codes: QuantLinear._int16's arithmetic and bits, in one
// call, so the C++ decoder stack (decoder_stack_cpu.cpp) can call it through the dispatcher
// with the AVX2 and AMX linears' signature. act must be 0: the stack applies act_and_mul.
at::Tensor quant_linear(const at::Tensor& x, const at::Tensor& packed, const at::Tensor& bias, int64_t act) {
  TORCH_CHECK(act == 0, "quant_linear: no fused activation (the stack calls act_and_mul)");
  TORCH_CHECK(x.is_cpu() && packed.is_cpu() && packed.scalar_type() == at::kByte && packed.dim() == 1 &&
              packed.is_contiguous() && packed.numel() >= 24, "quant_linear: a packed uint8 linear, CPU");
  const uint8_t* base = packed.data_ptr<uint8_t>();
  auto word = [&](int64_t i) {
    int64_t v;
    std::memcpy(&v, base + 8 * i, 8);
    return v;
  };
  const int64_t nseg = word(0), K = word(1), N = word(2);
  TORCH_CHECK(nseg >= 1 && packed.numel() >= 8 * (3 + 4 * nseg), "quant_linear: header");
  TORCH_CHECK(x.dim() == 2 && x.size(1) == K, "quant_linear: x [T, ", K, "]");
  TORCH_CHECK(!bias.numel() || (bias.numel() == N && bias.is_contiguous()), "quant_linear: bias [N]");
  const std::vector<at::Tensor> acts = quantize_act(x.contiguous());
  const Acts a{acts[0].data_ptr<int16_t>(), acts[1].data_ptr<float>(), acts[2].data_ptr<float>(), K};
  at::Tensor out = at::empty({x.size(0), N}, x.options());
  int64_t col = 0;
  for (int64_t i = 0; i < nseg; ++i) {
    const int64_t fmt = word(3 + 4 * i), rows = word(4 + 4 * i), row_bytes = word(5 + 4 * i),
                  off = word(6 + 4 * i);
    const Layout L = layout(static_cast<int>(fmt));
    TORCH_CHECK(row_bytes == K / L.block * L.type_size && off >= 0 && rows >= 0 && col + rows <= N &&
                off + rows * row_bytes <= packed.numel(), "quant_linear: segment ", i, " out of bounds");
    const uint8_t* wp = base + off;
    const int F = static_cast<int>(fmt);
    if (out.scalar_type() == at::kFloat)
      gemm_impl(a, x.size(0), wp, rows, row_bytes, F, out.data_ptr<float>() + col, N);
    else if (out.scalar_type() == at::kBFloat16)
      gemm_impl(a, x.size(0), wp, rows, row_bytes, F, out.data_ptr<at::BFloat16>() + col, N);
    else if (out.scalar_type() == at::kHalf)
      gemm_impl(a, x.size(0), wp, rows, row_bytes, F, out.data_ptr<at::Half>() + col, N);
    else
      TORCH_CHECK(false, "quant_linear: float32, bfloat16 or float16 x");
    col += rows;
  }
  TORCH_CHECK(col == N, "quant_linear: segments cover ", col, " of ", N, " rows");
  return bias.numel() ? out + bias : out;
}

#include "quant_greedy.h"  // the greedy heads' entry points (greedy_argmax and its passes)

void set_rows16_formats(int64_t mask) { g_rows16_mask = mask; }
void set_pass_rows(int64_t rows) { g_pass_rows = rows; }

std::string isa() {
#ifdef FLATSERVE_AMX
  if (flatserve::amx_available()) return "amx";
#endif
#if defined(__AVX512BW__)
  return "avx512";
#endif
#if defined(__AVXVNNI__)
  return "avxvnni";
#endif
  return QG_AVX2 ? "avx2" : "portable";
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("quantize_act", &quantize_act, "x [M, K] -> int16 codes, scales, scaled sums per 32 values",
        py::arg("x"));
  m.def("gemm", &gemm, "out[:, col:col+N] = x @ W^T, W as GGUF blocks read in place",
        py::arg("xq"), py::arg("xd"), py::arg("xs"), py::arg("w"), py::arg("fmt"), py::arg("out"),
        py::arg("col"), py::arg("path") = 0);
  m.def("dequant", &dequant, "W's blocks -> dense rows (the torch reference's bits in fp32)");
  m.def("quant_linear", &quant_linear, "x @ W^T (+ bias) for a packed linear (QuantLinear.pack)");
  m.def("greedy_q8_argmax", &greedy_q8_argmax,
        "row_argmax(x @ W^T) on a Q8_0 head, candidates from its int8 pass -> (tokens, candidates per token)");
  m.def("greedy_q8_prep", &greedy_q8_prep, "Q8_0 rows -> (block code sums int16, row L1 norms) for greedy_q8");
  m.def("greedy_q4t_argmax", &greedy_q4t_argmax,
        "x [M <= 8, K], Q8_0 head, its rows-in-lanes 4-bit copy -> (greedy tokens, candidate counts)");
  m.def("greedy_q4t_copy", &greedy_q4t_copy, "Q8_0 rows -> (codes, scales, wmax) for greedy_q4t_argmax");
  m.def("has_greedy_q8", &has_greedy_q8, "whether this build has the greedy passes (AVX2 and up)");
  m.def("isa", &isa, "the vector path compiled in");
  m.def("set_rows16_formats", &set_rows16_formats,
        "without AMX: the GGML types (a bit each) whose calls take rows16 (csrc/quant_rows.h)");
  m.def("set_pass_rows", &set_pass_rows, "activation rows a pass of the AVX2 kernels at 5+ rows: 8 or 4");
}

// For the C++ decoder stack, which calls it through torch's dispatcher (the op namespace is
// the module's name).
TORCH_LIBRARY_FRAGMENT(TORCH_EXTENSION_NAME, m) {
  m.def("quant_linear(Tensor x, Tensor w_packed, Tensor bias, int act) -> Tensor", &quant_linear);
}
