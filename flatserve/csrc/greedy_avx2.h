// The greedy head's candidate pass on AVX2 (ops/csrc/avx2_gemm_cpu.cpp, greedy_candidates): the
// AMX pass of greedy_amx.h with vpmaddubsw in place of the tile unit, for CPUs without AMX. The
// copy, its layout and the bound are the same (flatserve/model/greedy_head.py): W row n as bytes
// u = q + 64 (|q| <= 63), x_t split as sx_t (256 xh + xl) with xh, xl in [-128, 127]; u . xh and
// u . xl are exact in int32 (a vpmaddubsw pair is at most 2 x 127 x 128 = 32512: no int16
// saturation, which is why the copy has 7 bits), and the float steps on them are the AMX pass's
// (two conversions, 256 h + l, sx s_n, the product), which the bound covers.
//
// Why: on AVX2 the bf16 head of Gemma 3 270M (335 MB) is half of a one-stream decode step's
// bytes; the copy is 171 MB. At 1-16 tokens the pass and the rescoring took 0.64-0.74x the bf16
// head's time (20.4 vs 28.9 ms at one token, 51 vs 80 at 16; benchmarks/dev/cpu_greedy_head.py,
// 2-core AMD EPYC, 2026-11-26): 12 integer ops per token per 64 weights, against 16 FMAs.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>

namespace flatserve::greedy_avx2 {

constexpr int kMaxTokens = 16;
constexpr int kGreedyX = 32639;  // |x^| <= 127 * 256 + 127, as greedy_amx.h

struct Cand {
  int32_t n;
  float upper;
};

struct Part {  // one thread's share of the rows
  float best[kMaxTokens];
  std::vector<Cand> cand[kMaxTokens];
};

// 2^-6 of |lo|: below lo by this much, a value's bf16 rounding is below lo's (greedy_amx.h).
inline float tie_margin(float lo) { return std::fabs(lo) * 0x1p-6f + 1e-30f; }

// x [M, K] fp32 -> per token xh, xl [K64] (zero past K), sx, the offsets 64 sum xh and 64 sum xl,
// and 63 E_t rounded up: pack_x8's arithmetic (greedy_amx.h), in a plain layout; and e2, |x_t -
// 256 sx xh_t|_2 rounded up, for the first stage's bound (xh alone: rows, below). A token with a
// NaN or infinity gets e63 = NaN: its bounds compare false and it gets no candidate.
struct X8 {
  std::vector<int8_t> xh, xl;  // [M][K64]
  float sx[kMaxTokens] = {}, e63[kMaxTokens] = {}, e2[kMaxTokens] = {};
  int32_t offh[kMaxTokens] = {}, offl[kMaxTokens] = {};
};

inline void pack_x8(const float* x, int64_t M, int64_t K, int64_t K64, X8& out) {
  out.xh.assign(M * K64, 0);
  out.xl.assign(M * K64, 0);
  for (int64_t t = 0; t < M; ++t) {
    const float* xt = x + t * K;
    float mx = 0.f;
    bool finite = true;
    for (int64_t k = 0; k < K; ++k) {
      finite = finite && std::isfinite(xt[k]);
      mx = std::max(mx, std::fabs(xt[k]));
    }
    if (!finite) {
      out.e63[t] = out.e2[t] = NAN;
      continue;
    }
    const float sx = mx > 0.f ? mx / kGreedyX : 1.f;
    double e = 0.0, e2 = 0.0;  // |x - sx x^|_1, |x - 256 sx xh|_2^2
    int32_t sh = 0, sl = 0;
    for (int64_t k = 0; k < K; ++k) {
      const int q = std::clamp(static_cast<int>(std::nearbyint(xt[k] / sx)), -kGreedyX, kGreedyX);
      const int h = (q + 128) >> 8, l = q - 256 * h;  // floor: l in [-128, 127], h in [-128, 127]
      out.xh[t * K64 + k] = static_cast<int8_t>(h);
      out.xl[t * K64 + k] = static_cast<int8_t>(l);
      sh += h;
      sl += l;
      e += std::fabs(static_cast<double>(xt[k]) - static_cast<double>(sx) * q);
      const double r = static_cast<double>(xt[k]) - static_cast<double>(sx) * 256 * h;
      e2 += r * r;
    }
    out.sx[t] = sx;
    out.offh[t] = 64 * sh;
    out.offl[t] = 64 * sl;
    out.e63[t] = static_cast<float>(63.0 * e * (1 + 0x1p-20));  // covers the rounding to float
    // rounded up for its own sum and for the kernel's two fp32 products s_n (e2 |q_n|_2)
    out.e2[t] = static_cast<float>(std::sqrt(e2) * (1 + 0x1p-18));
  }
}

inline int32_t hsum(__m256i v) {
  const __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  const __m128i s2 = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  return _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32(s2, 0xB1)));
}

// sum_kb u . x_t over one row's pieces (w: the row's first 64 bytes, the next piece 2,048 bytes on)
// for TT tokens (x: their [K64] rows, K64 apart), into out[0..TT). The tokens' accumulators stay
// in registers (TT <= 8: 8 + the two weight vectors + ones of 16 ymm); each weight piece is loaded
// once per tile, from L1 after the first tile.
template <int TT>
inline void dots(const uint8_t* w, int64_t KS, const int8_t* x, int64_t K64, int32_t* out) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[TT];
  for (int t = 0; t < TT; ++t) acc[t] = _mm256_setzero_si256();
  for (int64_t kb = 0; kb < KS; ++kb) {
    const __m256i u0 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + kb * 2048));
    const __m256i u1 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + kb * 2048 + 32));
    for (int t = 0; t < TT; ++t) {  // u8 x s8 pairs to int16, then pairs of those to int32
      const int8_t* p = x + t * K64 + kb * 64;
      const __m256i a = _mm256_maddubs_epi16(u0, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
      const __m256i b = _mm256_maddubs_epi16(u1, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p + 32)));
      acc[t] = _mm256_add_epi32(acc[t], _mm256_add_epi32(_mm256_madd_epi16(a, ones), _mm256_madd_epi16(b, ones)));
    }
  }
  for (int t = 0; t < TT; ++t) out[t] = hsum(acc[t]);
}

inline void dots_all(const uint8_t* w, int64_t KS, const int8_t* x, int64_t K64, int64_t M, int32_t* out) {
  int64_t t = 0;
  for (; t + 8 <= M; t += 8) dots<8>(w, KS, x + t * K64, K64, out + t);
  if (M - t >= 4) dots<4>(w, KS, x + t * K64, K64, out + t), t += 4;
  if (M - t >= 2) dots<2>(w, KS, x + t * K64, K64, out + t), t += 2;
  if (M - t >= 1) dots<1>(w, KS, x + t * K64, K64, out + t);
}

// Groups g0..g1 of 32 rows ([N/32][K64/64][32 rows][64 k], greedy_head.greedy_layout): each row's
// bounds, the running best lower bound per token and every row whose upper bound reaches the
// threshold of the groups before it (filtered against the final one by the caller).
// Two stages: every row against xh alone (x ~= x' = 256 sx xh: half the integer work of u . xh
// and u . xl), and only a row whose first-stage upper bound reaches the threshold gets u . xl and
// the full bound (the one pack_x8 describes). The first stage's bound takes s_n (x - x') . q_n <=
// s_n |x - x'|_2 |q_n|_2 (qn: |q_n|_2 rounded up, greedy_head.py) where the full one has 63 s_n
// |x - x^|_1: with 63 |x - x'|_1 ~45% of the default model's rows passed the first stage, with the
// 2-norms 0.3-0.7% (700-1,800 of 262k per token, against 150-280 candidates after the second;
// real hidden states, float64, 2026-11-27). Both intervals hold the head's logit, so either lower
// bound may set the threshold.
inline void rows(const uint8_t* wq, const float* s, const float* c, const float* qn, const float* xabs,
                 const X8& x8, int64_t M, int64_t K64, int64_t g0, int64_t g1, Part& out) {
  const int64_t KS = K64 / 64;
  float best[kMaxTokens], thr[kMaxTokens];
  for (int t = 0; t < kMaxTokens; ++t) best[t] = thr[t] = -INFINITY;
  int32_t hs[kMaxTokens], ls[1];
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* wg = wq + g * 32 * K64;
    for (int r = 0; r < 32; ++r) {
      const int64_t n = g * 32 + r;
      const uint8_t* w = wg + r * 64;
      dots_all(w, KS, x8.xh.data(), K64, M, hs);
      for (int64_t t = 0; t < M; ++t) {
        // q . x^ = 256 (u . xh - 64 sum xh) + (u . xl - 64 sum xl), the differences exact in int32
        const float hi = static_cast<float>(hs[t] - x8.offh[t]);
        const float sxs = x8.sx[t] * s[n];
        const float coarse = (256.f * hi) * sxs;  // 256 hi: exact (|hi| < 2^24)
        const float cb = std::fma(xabs[t], c[n], s[n] * (x8.e2[t] * qn[n]));
        best[t] = std::max(best[t], coarse - cb);  // NaN (a bad token) never wins
        if (!(coarse + cb >= thr[t])) continue;
        dots<1>(w, KS, x8.xl.data() + t * K64, K64, ls);
        const float lo = static_cast<float>(ls[0] - x8.offl[t]);
        const float approx = std::fma(256.f, hi, lo) * sxs;
        const float bound = std::fma(xabs[t], c[n], x8.e63[t] * s[n]);
        const float upper = approx + bound;
        best[t] = std::max(best[t], approx - bound);
        if (upper >= thr[t]) out.cand[t].push_back({static_cast<int32_t>(n), upper});
      }
    }
    for (int64_t t = 0; t < M; ++t) thr[t] = best[t] - tie_margin(best[t]);
  }
  for (int64_t t = 0; t < M; ++t) out.best[t] = best[t];
}

}  // namespace flatserve::greedy_avx2
#endif
