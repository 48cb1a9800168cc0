// The quantized LM head's greedy candidate pass for a few tokens (flatserve/model/greedy_q4.py
// and greedy_q8.py say where it runs): a 4-bit copy of the head (codes c in [-7, 7], one fp16
// scale d per 32 weights: greedy_q4.h's quantize_block), laid out with 16 head rows in the
// vector lanes (one zmm with AVX-512 VNNI; two ymm at the AVX2 levels, V16 below), dotted with the
// head's own int16 activation codes q (scale xd_b per 32 values: xr = xd q exactly). Why: at one
// token greedy_q8.h's lanes are tokens, so all but one idle, and the head itself (rows16) takes
// 6.3-6.7 ms at one row where the 2-core Zen 4 reads its 178 MB in ~3.7 ms (48 GB/s;
// benchmarks/dev/cpu_greedy_head.py --gguf prints both): arithmetic bounds it (by our reading,
// sum16v's shuffle tree a block). The copy is 94 MB and needs no horizontal sum: a lane is a row
// from the first block to the last. A row-major copy (a row's blocks in a register, a horizontal
// sum a row) served the avx2 level until 2026-11-28: 5.5 ms at one row against this layout's 2.3-
// 2.8 on a 2-core Zen 5 forced to avx2 / avxvnni.
//
//   A_n = sum_b d_nb xd_b (u_nb . q_b - 8 sum q_b)      u = c + 8 (unsigned nibbles)
//   |head(x)_n - A_n| <= sum_b d_nb |xr_b|_1 / 2 + slack =: B_n
//
// since head(x)_n - A_n = (W - W4) . xr up to the fp32 rounding of both dots (`slack`: greedy_q4.h's
// bound, which covers these terms, each at most wmax |xr|). x is not requantized: int8
// codes (as greedy_q8.h's) add |W4_n|_1 E to the bound, and on the default model's hidden states
// (outlier channels ~22x the mean) a version built that way kept ~13k candidate rows a token
// against ~3k (2026-11-28, measured once with a scratch script; not kept). The first
// term is a dot of the row's scales with |xr_b|_1 / 2, 16 rows a vector: one FMA per block.
//
// Layout (G = ceil(N / 16) groups of 16 rows): codes [G][nb][4 vectors][16 lanes][4 bytes]. Vector
// j covers values 8j..8j+7 of row 16 G + r in lane r: bytes (B0, B1, B2, B3) = (u0 | u2 << 4, u4 |
// u6 << 4, u1 | u3 << 4, u5 | u7 << 4) (u_i: value 8j + i), so the lane AND 0x000F000F after a
// shift of 0, 4, 8 or 12 bits is the int16 pair (u0, u1), (u2, u3), (u4, u5) or (u6, u7) that one
// vpdpwssd multiplies with x's pair broadcast. Scales [G][nb][16] fp16. Rows past N: c = 0, d =
// 0, never candidates.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "greedy_q4.h"
#include "quant_blocks.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define FLATSERVE_GREEDY_Q4T 1
#include <immintrin.h>

namespace flatserve::greedy_q4t {

using greedy_q4::kMaxTokens;
using greedy_q4::Part;
using greedy_q4::tie_margin;

// The 16 lanes' operations: one zmm (AVX-512 VNNI), or two ymm at the AVX2 levels (lanes 0-7 and
// 8-15 of the same layout), whose dp is 256-bit vpdpwssd with AVX-VNNI, else vpmaddwd + vpaddd
// (the same exact int32). Each lane's operations are the same at every level.
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
struct V16 {
  using I = __m512i;
  using F = __m512;
  static I load(const uint8_t* p) { return _mm512_loadu_si512(p); }
  static I set1(int32_t v) { return _mm512_set1_epi32(v); }
  static I and_(I a, I b) { return _mm512_and_si512(a, b); }
  template <int S> static I srli(I a) { return _mm512_srli_epi32(a, S); }
  static I dp(I acc, I u, I x) { return _mm512_dpwssd_epi32(acc, u, x); }
  static F scales(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }
  static F cvt(I a) { return _mm512_cvtepi32_ps(a); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static F zero() { return _mm512_setzero_ps(); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F abs(F a) { return _mm512_abs_ps(a); }
  static void store(float* p, F a) { _mm512_storeu_ps(p, a); }
  static uint32_t gt(uint32_t m, F a, F b) { return _mm512_mask_cmp_ps_mask(m, a, b, _CMP_GT_OQ); }
  static uint32_t ge(uint32_t m, F a, F b) { return _mm512_mask_cmp_ps_mask(m, a, b, _CMP_GE_OQ); }
};
#else
struct V16 {
  struct I { __m256i lo, hi; };
  struct F { __m256 lo, hi; };
  static __m256i ld(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static I load(const uint8_t* p) { return {ld(p), ld(p + 32)}; }
  static I set1(int32_t v) { return {_mm256_set1_epi32(v), _mm256_set1_epi32(v)}; }
  static I and_(I a, I b) { return {_mm256_and_si256(a.lo, b.lo), _mm256_and_si256(a.hi, b.hi)}; }
  template <int S> static I srli(I a) { return {_mm256_srli_epi32(a.lo, S), _mm256_srli_epi32(a.hi, S)}; }
  static __m256i dp8(__m256i acc, __m256i u, __m256i x) {
#if defined(__AVXVNNI__)
    return _mm256_dpwssd_avx_epi32(acc, u, x);
#else
    return _mm256_add_epi32(acc, _mm256_madd_epi16(u, x));
#endif
  }
  static I dp(I acc, I u, I x) { return {dp8(acc.lo, u.lo, x.lo), dp8(acc.hi, u.hi, x.hi)}; }
  static F scales(const uint16_t* p) {
    return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
            _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
  }
  static F cvt(I a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
  static F set1(float v) { return {_mm256_set1_ps(v), _mm256_set1_ps(v)}; }
  static F zero() { return set1(0.f); }
  static F add(F a, F b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
  static F mul(F a, F b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
  static F fmadd(F a, F b, F c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
  static F abs(F a) {
    const __m256 m = _mm256_set1_ps(-0.f);
    return {_mm256_andnot_ps(m, a.lo), _mm256_andnot_ps(m, a.hi)};
  }
  static void store(float* p, F a) { _mm256_storeu_ps(p, a.lo), _mm256_storeu_ps(p + 8, a.hi); }
  static uint32_t cmp(uint32_t m, F a, F b, bool ge) {
    const __m256 lo = ge ? _mm256_cmp_ps(a.lo, b.lo, _CMP_GE_OQ) : _mm256_cmp_ps(a.lo, b.lo, _CMP_GT_OQ);
    const __m256 hi = ge ? _mm256_cmp_ps(a.hi, b.hi, _CMP_GE_OQ) : _mm256_cmp_ps(a.hi, b.hi, _CMP_GT_OQ);
    return m & (static_cast<uint32_t>(_mm256_movemask_ps(lo)) | static_cast<uint32_t>(_mm256_movemask_ps(hi)) << 8);
  }
  static uint32_t gt(uint32_t m, F a, F b) { return cmp(m, a, b, false); }
  static uint32_t ge(uint32_t m, F a, F b) { return cmp(m, a, b, true); }
};
#endif

constexpr int kMaxRows = 8;  // tokens a call

// Q8_0 rows of group g (rows 16 g ..) -> its codes and scales; returns max |W| of its rows.
inline double build_group(const uint8_t* w8, int64_t N, int64_t nb, int64_t g, uint8_t* codes, uint16_t* scales) {
  double wmax = 0.0;
  for (int r = 0; r < 16; ++r) {
    const int64_t n = 16 * g + r;
    for (int64_t b = 0; b < nb; ++b) {
      uint16_t bits = 0;
      int c[32] = {};
      if (n < N) wmax = std::max(wmax, greedy_q4::quantize_block(w8 + (n * nb + b) * 34, bits, c));
      scales[(g * nb + b) * 16 + r] = bits;
      uint8_t* cb = codes + (g * nb + b) * 256 + 4 * r;
      auto u = [&](int j, int i) { return static_cast<uint8_t>(c[8 * j + i] + 8); };
      for (int j = 0; j < 4; ++j) {
        cb[64 * j + 0] = static_cast<uint8_t>(u(j, 0) | u(j, 2) << 4);
        cb[64 * j + 1] = static_cast<uint8_t>(u(j, 4) | u(j, 6) << 4);
        cb[64 * j + 2] = static_cast<uint8_t>(u(j, 1) | u(j, 3) << 4);
        cb[64 * j + 3] = static_cast<uint8_t>(u(j, 5) | u(j, 7) << 4);
      }
    }
  }
  return wmax;
}

struct XPackT {
  int64_t M = 0, nb = 0;
  std::vector<int32_t> xw;   // [M][nb][16]: the head's codes of values (2p, 2p + 1), an int16 pair each
  std::vector<int32_t> off;  // [M][nb]: -8 sum q_b (the nibbles' +8)
  std::vector<float> h;      // [M][nb]: |xr_b|_1 / 2 rounded up
  float slack[kMaxTokens] = {};
};

// q [M, K] the head's int16 codes (ACT_ORDER per block: position a holds value act_value(a), an
// involution); wmax bounds every |W| of the head (and, times 1 + 2^-10, of the copy).
inline void pack_x(const int16_t* q, const float* d, int64_t M, int64_t K, double wmax, XPackT& x) {
  x.M = M, x.nb = K / 32;
  x.xw.assign(M * x.nb * 16, 0), x.off.assign(M * x.nb, 0), x.h.assign(M * x.nb, 0.f);
  for (int64_t t = 0; t < M; ++t) {
    double l1 = 0.0;
    for (int64_t b = 0; b < x.nb; ++b) {
      const int16_t* qb = q + t * K + 32 * b;
      int32_t sum = 0;
      int64_t a = 0;
      for (int k = 0; k < 32; k += 2) {
        const int16_t v0 = qb[qblocks::act_value(k)], v1 = qb[qblocks::act_value(k + 1)];
        x.xw[(t * x.nb + b) * 16 + k / 2] = static_cast<int32_t>(static_cast<uint16_t>(v0)) |
                                             static_cast<int32_t>(static_cast<uint32_t>(static_cast<uint16_t>(v1)) << 16);
        sum += v0 + v1, a += std::abs(v0) + std::abs(v1);
      }
      const double ab = static_cast<double>(d[t * x.nb + b]) * static_cast<double>(a);  // |xr_b|_1
      x.off[t * x.nb + b] = -8 * sum;
      x.h[t * x.nb + b] = static_cast<float>(ab / 2 * (1 + 0x1p-20));
      l1 += ab;
    }
    x.slack[t] = greedy_q4::slack(x.nb, wmax, l1);
  }
}

// Group g's 16 rows against MT tokens: A[t] and the copy's bound term (sum_b d |xr_b|_1 / 2) in
// Bw[t]. Per token the integer dot u . q - 8 sum q = c . q is exact in int32 and then in fp32
// (|c . q| <= 32 x 7 x 32639 < 2^23; each pair product <= 15 x 32639).
template <int MT>
inline void group_ab(const XPackT& x, const uint8_t* codes, const uint16_t* scales, const float* xd, int64_t K,
                     int64_t g, V16::F A[MT], V16::F Bw[MT], qblocks::Prefetch& pf) {
  using V = V16;
  const V::I m4 = V::set1(0x000F000F);
  for (int t = 0; t < MT; ++t) A[t] = Bw[t] = V::zero();
  for (int64_t b = 0; b < x.nb; ++b) {
    pf.step();
    const uint8_t* cb = codes + (g * x.nb + b) * 256;
    V::I u[16];  // pair p of vector j: values 8j + 2p, 8j + 2p + 1
    for (int j = 0; j < 4; ++j) {
      const V::I z = V::load(cb + 64 * j);
      u[4 * j] = V::and_(z, m4);
      u[4 * j + 1] = V::and_(V::srli<4>(z), m4);
      u[4 * j + 2] = V::and_(V::srli<8>(z), m4);
      u[4 * j + 3] = V::and_(V::srli<12>(z), m4);
    }
    const V::F dv = V::scales(scales + (g * x.nb + b) * 16);
    for (int t = 0; t < MT; ++t) {
      const int32_t* xw = x.xw.data() + (t * x.nb + b) * 16;
      V::I acc = V::set1(x.off[t * x.nb + b]);
      for (int p = 0; p < 16; ++p) acc = V::dp(acc, u[p], V::set1(xw[p]));
      A[t] = V::fmadd(V::cvt(acc), V::mul(dv, V::set1(xd[t * (K / 32) + b])), A[t]);
      Bw[t] = V::fmadd(dv, V::set1(x.h[t * x.nb + b]), Bw[t]);
    }
  }
}

// Groups g0..g1: (greedy_q4.h: a row whose A is the best so far is scored exactly by
// `exact(n, t)`; every row whose U = A + B reaches v less the tie margin is kept), 16 rows a step.
template <int MT, typename Exact>
void rows_t(const XPackT& x, const uint8_t* codes, const uint16_t* scales, const float* xd, int64_t K, int64_t N,
            int64_t g0, int64_t g1, Exact&& exact, Part& out) {
  using V = V16;
  float bestA[kMaxTokens];
  for (int t = 0; t < kMaxTokens; ++t) out.v[t] = bestA[t] = -INFINITY;
  qblocks::Prefetch pf;
  V::F A[MT], Bw[MT];
  for (int64_t g = g0; g < g1; ++g) {
    if (g + 1 < g1) pf.spread(codes + (g + 1) * x.nb * 256, x.nb * 256, x.nb);
    group_ab<MT>(x, codes, scales, xd, K, g, A, Bw, pf);
    const uint32_t live = N - 16 * g >= 16 ? 0xFFFFu : (1u << (N - 16 * g)) - 1;
    for (int t = 0; t < MT; ++t) {
      // B: Bw's own fp32 sum ((nb + 3) 2^-24 relative, under 2^-15 for nb <= 512) rounded up,
      // then U's additions rounded up
      const V::F B = V::fmadd(Bw[t], V::set1(0x1p-14f), Bw[t]);
      V::F U = V::add(V::add(A[t], B), V::set1(x.slack[t]));
      U = V::fmadd(V::abs(U), V::set1(0x1p-20f), U);
      alignas(64) float a[16], uv[16];
      V::store(a, A[t]);
      V::store(uv, U);
      for (uint32_t m = V::gt(live, A[t], V::set1(bestA[t])); m; m &= m - 1) {
        const int r = __builtin_ctz(m);
        if (a[r] > bestA[t]) {
          bestA[t] = a[r];
          out.v[t] = std::max(out.v[t], exact(16 * g + r, t));
        }
      }
      const float thr = out.v[t] - tie_margin(out.v[t]);
      for (uint32_t m = V::ge(live, U, V::set1(thr)); m; m &= m - 1) {
        const int r = __builtin_ctz(m);
        out.cand[t].push_back({static_cast<int32_t>(16 * g + r), uv[r]});
      }
    }
  }
}

}  // namespace flatserve::greedy_q4t
#endif
