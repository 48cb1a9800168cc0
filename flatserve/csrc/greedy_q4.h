// The quantized LM head's greedy candidate pass (flatserve/model/greedy_q4.py says what and why):
// a 4-bit copy of the head, one fp16 scale per 32 weights (d, codes c in [-7, 7], |w - d c| <=
// d / 2), dotted with x as the head sees it (its int16 codes, xr = xd * xq) requantized to one
// scale per token (XPack below), so
//
//   |head(x)_n - A_n| <= sum_b d_nb (|xr_b|_1 / 2 + 7 E_b) + fp32 rounding (`slack`)  =: B_n
//
// A row n can hold the argmax only if U_n = A_n + B_n reaches the largest exactly computed
// logit v (less a bf16 tie margin). v comes from the pass itself: whenever a row's A_n is the
// best so far (a few dozen times per thread), that row is scored on the Q8_0 head with the
// head's own dot (`exact`). Against v, not against the best lower bound max(A - B), because the
// candidate count is steep in the margin: on the default model's real hidden states the d / 2
// bound keeps ~119k of 262k rows against max(A - B) (an offline float64 check of 24 decode rows),
// ~3k (max 4.9k) against v (benchmarks/dev/cpu_greedy_head.py --gguf, 2026-11-26).
//
// Only the ISA-specific block dot differs between the builds; A's summation order is free (the
// slack covers any order), the exact rescoring is the head's.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <c10/util/Half.h>

#include "quant_blocks.h"

namespace flatserve::greedy_q4 {

using flatserve::qblocks::h2f;

constexpr int kMaxTokens = 16;
constexpr int kMaxX = 32767;  // |x'|

struct Cand {
  int32_t n;
  float upper;
};

struct Part {  // one thread's rows
  float v[kMaxTokens];      // the largest exact logit it computed, per token
  std::vector<Cand> cand[kMaxTokens];
};

// 2^-6 of |v|: a logit this far below v has a bf16 rounding below v's (as greedy_avx2.h).
inline float tie_margin(float v) { return std::fabs(v) * 0x1p-6f + 1e-30f; }

// x as the pass reads it. The head's codes have one scale per 32 values; a scale per block
// would cost the pass a multiply per block per token, so x is requantized once per token:
// xr = xd * xq (the head's view of x, exact in double) ~= sx * x', x' int16 in ACT_ORDER like
// the head's codes. |xr - sx x'|_1 per block (E_b) joins the bound: B_n = sum_b d_nb
// (|xr_b|_1 / 2 + 7 E_b); each value errs by at most max |x| / 65534, small against the |xr_b|_1
// / 2 of the copy's own error (an int8 x' would add about as much again: max / mean |x| is ~22
// in the default model's hidden states).
struct XPack {
  int64_t M = 0, K = 0, nb = 0, nbp = 0, nb8 = 0;  // nbp: nb rounded up to even; nb8: to 8
  std::vector<int16_t> xq;      // [M][32 nbp], each block in ACT_ORDER, zero past K
  std::vector<int16_t> xn;      // the same codes in value order (the AVX-512 pass's)
  std::vector<float> corr, xa;  // [M][nb8]: 8 sum_b x' (the codes' +8), |xr_b|_1 / 2 + 7 E_b
  float sx[kMaxTokens] = {}, slack[kMaxTokens] = {};
};

// The fp32 rounding of a pass's A and of the head's logit for one token: nb blocks, every |W| and
// |W4| at most wmax, l1 = sum_k (|xr_k| + the error of the pass's x codes). Each term of either dot
// is at most 3.3 wmax |x| (greedy_q4's A: d_b (|u . x'| + |8 sum x'|) <= 23 d |x'|, the offset
// subtracted in float; the head's: wmax |xr|) and rounds at most nb + 5
// times, so (nb + 16) 2^-23 x 4.5 wmax l1 covers both (greedy_q4t's A, offset exact in int32,
// has smaller terms).
inline float slack(int64_t nb, double wmax, double l1) {
  return static_cast<float>((nb + 16) * 0x1p-23 * 4.5 * wmax * l1 * (1 + 0x1p-20)) + 1e-30f;
}

// q [M, K] int16 codes in ACT_ORDER per block, d [M, K / 32] their scales -> XPack. wmax bounds
// every |W| and |W4|; slack: the fp32 rounding of A and of the head's logit (greedy_q4.py).
inline void pack_x(const int16_t* q, const float* d, int64_t M, int64_t K, double wmax, XPack& x) {
  x.M = M, x.K = K, x.nb = K / 32, x.nbp = (x.nb + 1) / 2 * 2, x.nb8 = (x.nb + 7) / 8 * 8;
  const int64_t KP = 32 * x.nbp;
  x.xq.assign(M * KP, 0), x.xn.assign(M * KP, 0), x.corr.assign(M * x.nb8, 0.f), x.xa.assign(M * x.nb8, 0.f);
  std::vector<double> xr(K);
  for (int64_t t = 0; t < M; ++t) {
    double mx = 0.0, l1 = 0.0;
    for (int64_t k = 0; k < K; ++k) {  // position order: the value order does not matter here
      xr[k] = static_cast<double>(d[t * x.nb + k / 32]) * q[t * K + k];
      mx = std::max(mx, std::fabs(xr[k]));
    }
    const float sx = mx > 0.0 ? static_cast<float>(mx / kMaxX) : 1.f;
    for (int64_t b = 0; b < x.nb; ++b) {
      double e = 0.0, a = 0.0;
      int32_t sum = 0;
      for (int64_t k = 32 * b; k < 32 * b + 32; ++k) {
        const int c = std::clamp(static_cast<int>(std::nearbyint(xr[k] / sx)), -kMaxX, kMaxX);
        x.xq[t * KP + k] = static_cast<int16_t>(c);
        sum += c, a += std::fabs(xr[k]), e += std::fabs(xr[k] - static_cast<double>(sx) * c);
      }
      x.corr[t * x.nb8 + b] = static_cast<float>(8 * sum);  // |8 sum| < 2^24: exact
      x.xa[t * x.nb8 + b] = static_cast<float>((a / 2 + 7 * e) * (1 + 0x1p-20));
      l1 += a + e;
    }
    x.sx[t] = sx;
    for (int64_t k = 0; k < KP; ++k)  // ACT_ORDER is its own inverse
      x.xn[t * KP + k - k % 32 + qblocks::act_value(static_cast<int>(k % 32))] = x.xq[t * KP + k];
    x.slack[t] = slack(x.nb, wmax, l1);
  }
}

#if QG_AVX2
inline float hsum8(__m256 v) {
  const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  return _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
}

// sum_b d_b v_b (both zero-padded to nb8).
inline float dot_d(const float* d, const float* v, int64_t nb8) {
  __m256 s = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb8; b += 8) s = _mm256_fmadd_ps(_mm256_loadu_ps(d + b), _mm256_loadu_ps(v + b), s);
  return hsum8(s);
}

// Tokens t0 .. t0 + MT of one copy row: sum_b d_b (u_b . x'_b). A pair of blocks is 32 bytes
// (block 2i in the low nibbles, 2i + 1 in the high ones), so one load and two masks give 64 codes
// u = c + 8; zero-extended to int16 by unpacklo/hi (values 0-7 | 16-23 and 8-15 | 24-31: ACT_ORDER)
// for vpmaddwd, as the head dots its codes. Two multiplies per block per token, as the head: a
// vpmaddubsw pair on x split into bytes took four, and 9.8 against the head's 7.4 cycles a block
// at one token (L2-resident rows, 2-core EPYC); this, 9.5 against 7.7 in the same sitting. Per lane 4 |u x'| <= 2^21: exact in fp32.
#if !defined(__AVX512BW__)
template <int MT>
inline void dot_u(const XPack& x, const uint8_t* row, const float* d, int64_t t0, float* out) {
  const int64_t KP = 32 * x.nbp;
  const __m256i m4 = _mm256_set1_epi8(0x0F), zero = _mm256_setzero_si256();
  __m256 acc[2][MT];  // even and odd blocks apart: at one token a single chain of K / 32 FMAs
  for (int t = 0; t < MT; ++t) acc[0][t] = acc[1][t] = _mm256_setzero_ps();  // is latency-bound
  for (int64_t b = 0; b < x.nbp; b += 2) {
    const __m256i raw = qblocks::ld(row + 16 * b);
    const __m256i u[2] = {_mm256_and_si256(raw, m4), _mm256_and_si256(_mm256_srli_epi16(raw, 4), m4)};
    for (int j = 0; j < 2; ++j) {
      const __m256i wa = _mm256_unpacklo_epi8(u[j], zero), wb = _mm256_unpackhi_epi8(u[j], zero);
      const __m256 db = _mm256_set1_ps(d[b + j]);
      for (int t = 0; t < MT; ++t) {
        const int16_t* xp = x.xq.data() + (t0 + t) * KP + 32 * (b + j);
        const __m256i p = qblocks::madd2(wa, qblocks::ld(xp), wb, qblocks::ld(xp + 16));
        acc[j][t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(p), db, acc[j][t]);
      }
    }
  }
  for (int t = 0; t < MT; ++t) out[t] = hsum8(_mm256_add_ps(acc[0][t], acc[1][t]));
}
#endif

#if defined(__AVX512BW__)
// dot_u with a block in one 512-bit register: the codes zero-extended to int16 in value order,
// one vpmaddwd per block and token against x' in value order (xn). Per lane the same exact
// integer pairs; a block's 32 values in one step instead of two unpacks, two multiplies and an
// add per 16-value half (the AVX2 loop spends ~10 ops a block, 3 of them shuffles; this ~6, 1).
template <int MT>
inline void dot_u(const XPack& x, const uint8_t* row, const float* d, int64_t t0, float* out) {
  const int64_t KP = 32 * x.nbp;
  const __m256i m4 = _mm256_set1_epi8(0x0F);
  __m512 acc[2][MT];
  for (int t = 0; t < MT; ++t) acc[0][t] = acc[1][t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < x.nbp; b += 2) {
    const __m256i raw = qblocks::ld(row + 16 * b);
    const __m512i u[2] = {_mm512_cvtepu8_epi16(_mm256_and_si256(raw, m4)),
                          _mm512_cvtepu8_epi16(_mm256_and_si256(_mm256_srli_epi16(raw, 4), m4))};
    for (int j = 0; j < 2; ++j) {
      const __m512 db = _mm512_set1_ps(d[b + j]);
      for (int t = 0; t < MT; ++t) {
        const __m512i p = _mm512_madd_epi16(u[j], _mm512_loadu_si512(x.xn.data() + (t0 + t) * KP + 32 * (b + j)));
        acc[j][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(p), db, acc[j][t]);
      }
    }
  }
  for (int t = 0; t < MT; ++t) out[t] = _mm512_reduce_add_ps(_mm512_add_ps(acc[0][t], acc[1][t]));
}
#endif

// One copy row -> A[t] and B[t] for every token.
inline void row_ab(const XPack& x, const uint8_t* row, float* d, float* A, float* B) {
  const uint8_t* sc = row + 16 * x.nbp;
  int64_t b = 0;
  for (; b + 8 <= x.nbp; b += 8)
    _mm256_storeu_ps(d + b, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(sc + 2 * b))));
  for (; b < x.nbp; ++b) d[b] = h2f(sc + 2 * b);
  float s[kMaxTokens];
  int64_t t = 0;
  for (; t + 4 <= x.M; t += 4) dot_u<4>(x, row, d, t, s + t);
  const int64_t rest = x.M - t;
  if (rest == 1) dot_u<1>(x, row, d, t, s + t);
  else if (rest == 2) dot_u<2>(x, row, d, t, s + t);
  else if (rest == 3) dot_u<3>(x, row, d, t, s + t);
  for (t = 0; t < x.M; ++t) {
    A[t] = (s[t] - dot_d(d, x.corr.data() + t * x.nb8, x.nb8)) * x.sx[t];
    B[t] = dot_d(d, x.xa.data() + t * x.nb8, x.nb8);
  }
}
#else
inline void row_ab(const XPack& x, const uint8_t* row, float* d, float* A, float* B) {
  const uint8_t* sc = row + 16 * x.nbp;
  const int64_t KP = 32 * x.nbp;
  for (int64_t b = 0; b < x.nbp; ++b) d[b] = h2f(sc + 2 * b);
  for (int64_t t = 0; t < x.M; ++t) {
    float acc = 0.f, bnd = 0.f;
    for (int64_t b = 0; b < x.nbp; ++b) {
      int32_t s = 0;
      for (int pos = 0; pos < 32; ++pos) {  // position pos holds value act_value(pos)
        const int j = pos < 8 || pos >= 24 ? pos : pos < 16 ? pos + 8 : pos - 8;
        const uint8_t byte = row[16 * (b & ~int64_t{1}) + j];
        const int c = static_cast<int>(b & 1 ? byte >> 4 : byte & 15) - 8;
        s += c * x.xq[t * KP + 32 * b + pos];
      }
      acc += d[b] * static_cast<float>(s);
      bnd += d[b] * x.xa[t * x.nb8 + b];
    }
    A[t] = acc * x.sx[t];
    B[t] = bnd;
  }
}
#endif

// One Q8_0 block (34 bytes at blk) -> its 4-bit codes c[32] (value order) and fp16 scale bits;
// returns max |W| of the block. Exact in double: W = D q and d c are exact there, so the check
// |W - d c| <= d / 2 is too. The copy's scale d = max |W| / 7 rounded up to fp16 (7 d >= max |W|).
inline double quantize_block(const uint8_t* blk, uint16_t& bits, int c[32]) {
  const double D = h2f(blk);
  int qmax = 0;
  for (int j = 0; j < 32; ++j) qmax = std::max(qmax, std::abs(static_cast<int>(static_cast<int8_t>(blk[2 + j]))));
  const double amax = std::fabs(D) * qmax;
  at::Half h(static_cast<float>(amax / 7));
  std::memcpy(&bits, &h, 2);
  if (static_cast<double>(static_cast<float>(h)) * 7 < amax) ++bits;  // round up: 7 d >= max |W|
  const double d = h2f(reinterpret_cast<const uint8_t*>(&bits));
  TORCH_CHECK(std::isfinite(d), "greedy_q4: a block scale overflows fp16");
  for (int j = 0; j < 32; ++j) {
    const double w = D * static_cast<int8_t>(blk[2 + j]);
    c[j] = d > 0 ? std::clamp(static_cast<int>(std::nearbyint(w / d)), -7, 7) : 0;
    TORCH_CHECK(std::fabs(w - d * c[j]) <= d / 2, "greedy_q4: a code errs over d / 2");
  }
  return amax;
}

// Q8_0 rows [N, nb * 34] -> the copy [N, 18 nbp] (greedy_q4.py's layout); returns max |W| (W4's
// are at most that times 1 + 2^-10).
inline double quantize_rows(const uint8_t* q8, int64_t n0, int64_t n1, int64_t nb, uint8_t* copy) {
  const int64_t nbp = (nb + 1) / 2 * 2;
  double wmax = 0.0;
  for (int64_t n = n0; n < n1; ++n) {
    uint8_t* row = copy + n * 18 * nbp;
    std::memset(row, 0x88, 16 * nbp);  // c = 0 (a padding block's codes)
    std::memset(row + 16 * nbp, 0, 2 * nbp);
    for (int64_t b = 0; b < nb; ++b) {
      uint16_t bits;
      int c[32];
      wmax = std::max(wmax, quantize_block(q8 + (n * nb + b) * 34, bits, c));
      std::memcpy(row + 16 * nbp + 2 * b, &bits, 2);
      for (int j = 0; j < 32; ++j) {
        uint8_t& byte = row[16 * (b & ~int64_t{1}) + j];
        byte = b & 1 ? static_cast<uint8_t>((byte & 0x0F) | ((c[j] + 8) << 4)) : static_cast<uint8_t>((byte & 0xF0) | (c[j] + 8));
      }
    }
  }
  return wmax;
}

// Rows n0..n1: each row's A and U per token, the running v (a row whose A is the best so far is
// scored exactly: `exact(n, t)`, the head's fp32 logit) and every row whose U reaches v less the
// tie margin (filtered against the final v by the caller).
template <typename Exact>
void rows(const XPack& a, const uint8_t* copy, int64_t row_bytes, int64_t n0, int64_t n1, Exact&& exact,
          Part& out) {
  std::vector<float> d(std::max(a.nb8, a.nbp), 0.f);
  float A[kMaxTokens], B[kMaxTokens], bestA[kMaxTokens];
  for (int t = 0; t < kMaxTokens; ++t) out.v[t] = bestA[t] = -INFINITY;
  for (int64_t n = n0; n < n1; ++n) {
    row_ab(a, copy + n * row_bytes, d.data(), A, B);
    for (int64_t t = 0; t < a.M; ++t) {
      if (A[t] > bestA[t]) {
        bestA[t] = A[t];
        out.v[t] = std::max(out.v[t], exact(n, t));
      }
      // B's own fp32 sum ((nb8 + 3) 2^-24 relative, under 2^-15 for nb8 <= 512: K <= 16384)
      // and U's two additions, rounded up; `slack` covers A's and the head's dots
      const float U = A[t] + B[t] * (1 + 0x1p-14f) + a.slack[t];
      if (U + std::fabs(U) * 0x1p-20f >= out.v[t] - tie_margin(out.v[t]))
        out.cand[t].push_back({static_cast<int32_t>(n), U});
    }
  }
}

}  // namespace flatserve::greedy_q4
