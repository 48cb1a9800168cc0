// The quantized LM head's greedy candidate pass on AVX-512 VNNI, and on AVX2 in the form below
// (flatserve/model/greedy_q8.py says what and why): the head's own Q8_0 codes q (scale D per 32
// weights), dotted with x requantized to int8 codes c per 32 values (scale s_b = max |xr_b| /
// 127; 63 on AVX2), where the head dots int16 codes.
// vpdpbusd does 64 products an instruction against vpdpwssd's 32 for the head (benchmarks/dev/
// cpu_vnni_loop.cpp: both ~1 a cycle on Zen 4), and the pass reads no copy of the head.
//
//   A_n = sum_b D_nb s_b (q_nb . c_b)     xr = the head's view of x (xd * xq, exact in double)
//   |head(x)_n - A_n| <= |W_n|_1 (E + slack) + sum_{b in O} |W_nb|_1 (E_b - E) =: B_n
//   E_b = max_{k in b} |xr_k - s_b c_k|,   E = max_{b not in O} E_b
//
// since sum_k |W_nk| |xr_k - s c_k| <= sum_b |W_nb|_1 E_b; O holds the few blocks whose error is
// far over the rest (an outlier channel's: kOutBlocks below). slack covers fp32 rounding of both
// dots: each term of either rounds at most nb + 5 times and is at most sum_k |W_nk| (|xr_k| +
// max E_b), so (nb + 16) 2^-22 (xmax + max E_b) covers the two (as greedy_q4.h's slack). One
// |W_n|_1 a row (R, 4 bytes), not a bound per block; the O blocks' |W_nb|_1 come from their codes
// as a row is scored. On the default model's real hidden states ~40 rows a token (max 56) of 262k
// are rescored at 8-bit codes, ~90 (max 195) at AVX2's 7-bit (benchmarks/dev/cpu_greedy_head.py
// --gguf --rows 16, 2026-11-29), a negligible share of the head's work.
//
// vpdpbusd multiplies unsigned by signed bytes: the stored codes are the signed side (broadcast
// from the block as stored), x goes as c + 128 and each block's sum 128 S_nb (S = sum_k q_nk, kept
// as int16 per block, 2 bytes a block) starts the accumulator. Lanes are tokens (16 in zmm, or 8
// in ymm for up to 8 tokens), so a row's logits need no horizontal sum. Candidates and the exact
// rescoring are greedy_q4.h's (v, the tie margin, Part).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "greedy_q4.h"
#include "quant_blocks.h"

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#define FLATSERVE_GREEDY_Q8 1
#include <immintrin.h>

namespace flatserve::greedy_q8 {

// AVX-512 VNNI: vpdpbusd, x as c + 128 (c in [-127, 127]). AVX2 (no VNNI): vpmaddubsw, whose
// int16 pair sums saturate past 32767, so x goes as c + 64 with c in [-63, 63] (pairs
// |2 x 127 x 128| = 32512), then vpmaddwd by ones and vpaddd: 3 instructions for 32 products where
// the head's int16 dot spends ~9 per 32 with its per-block scaling (quant_gemm_cpu.cpp dot_src).
// The bound is the same formula with this E (twice VNNI's for the same x). AVX-VNNI (the avxvnni
// level: 256-bit vpdpbusd, no AVX-512) takes VNNI's codes in AVX2's lanes.
#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define FLATSERVE_GREEDY_Q8_VNNI 1
#endif
#if defined(FLATSERVE_GREEDY_Q8_VNNI) || defined(__AVXVNNI__)
constexpr int kCodeMax = 127, kOffset = 128;
#else
constexpr int kCodeMax = 63, kOffset = 64;
#endif

using flatserve::qblocks::h2f;
using greedy_q4::Cand;
using greedy_q4::kMaxTokens;
using greedy_q4::Part;
using greedy_q4::tie_margin;

// Blocks whose error is taken apart from E: a block of x holding an outlier channel has a scale
// s_b, and so an error, many times the others' (the default model's final norm puts 332 in one
// channel of some tokens against block maxima of ~15 elsewhere). With E the maximum over all
// blocks, that one block made every row's bound ~20x too wide: 190k-237k of 262k rows were
// rescored for such a token, 21-35 ms calls against 8.5 (2-core Zen 5 at avxvnni, 16 requests,
// 10 of 80 steps). So E is the maximum over the other blocks, and for up to kOutBlocks blocks
// whose error exceeds kOutRatio x the token's median block error (any token's), each row adds
// |W_nb|_1 (E_b - E) for its own block b, summed from the codes as the row is scored:
//
//   sum_k |W_nk| |xr_k - s c_k| <= sum_b |W_nb|_1 E_b <= |W_n|_1 E + sum_{b in O} |W_nb|_1 (E_b - E)
constexpr int kOutBlocks = 4;
constexpr double kOutRatio = 4.0;

struct XPack8 {
  int64_t M = 0, nb = 0, L = 16;  // L: lanes, 16 (zmm; AVX2: two ymm) or 8 (ymm, up to 8 tokens)
  std::vector<int32_t> xu;  // [nb][8][L]: token t's codes c + kOffset of block b, values 4j..4j+3
  std::vector<float> s;     // [nb][L]: s_b per token
  alignas(64) float e[kMaxTokens] = {};  // E + slack per token, rounded up (B_n = R_n e + ...)
  int nout = 0;                          // outlier blocks, at most kOutBlocks
  int64_t out_b[kOutBlocks] = {};        // their block indices
  alignas(64) float ex[kOutBlocks][kMaxTokens] = {};  // E_b - E per token, rounded up (>= 0)
  alignas(64) float e_wide[kMaxTokens] = {};          // e + sum_o ex[o], rounded up
};

// The outlier blocks of err [M][nb] (each token's block errors): up to kOutBlocks blocks, those
// furthest over kOutRatio x a token's median; then each token's E (over the rest) in e_base and
// its excess in each of them, x.ex.
inline void split_outliers(const std::vector<double>& err, int64_t M, int64_t nb, XPack8& x,
                           double* e_base) {
  std::vector<double> score(nb, 0.0), tmp(nb);
  for (int64_t t = 0; t < M; ++t) {
    std::copy(err.begin() + t * nb, err.begin() + (t + 1) * nb, tmp.begin());
    std::nth_element(tmp.begin(), tmp.begin() + nb / 2, tmp.end());
    const double med = std::max(tmp[nb / 2], 1e-30);
    for (int64_t b = 0; b < nb; ++b) score[b] = std::max(score[b], err[t * nb + b] / med);
  }
  x.nout = 0;
  for (int i = 0; i < kOutBlocks; ++i) {
    const int64_t b = std::max_element(score.begin(), score.end()) - score.begin();
    if (!(score[b] > kOutRatio)) break;
    x.out_b[x.nout++] = b;
    score[b] = 0.0;
  }
  for (int64_t t = 0; t < M; ++t) {
    double e = 0.0;
    for (int64_t b = 0; b < nb; ++b)
      if (std::find(x.out_b, x.out_b + x.nout, b) == x.out_b + x.nout) e = std::max(e, err[t * nb + b]);
    e_base[t] = e;
    for (int o = 0; o < x.nout; ++o)
      x.ex[o][t] = static_cast<float>(std::max(0.0, err[t * nb + x.out_b[o]] - e) * (1 + 0x1p-20));
  }
}

// q [M, K] the head's int16 codes (ACT_ORDER per block), d [M, K / 32] their scales -> XPack8.
inline void pack_x8(const int16_t* q, const float* d, int64_t M, int64_t K, int64_t L, XPack8& x) {
  x.M = M, x.nb = K / 32, x.L = L;
  x.xu.assign(x.nb * 8 * L, 0), x.s.assign(x.nb * L, 1.f);
  std::vector<double> errs(M * x.nb, 0.0);
  double emax[kMaxTokens] = {}, xmaxs[kMaxTokens] = {}, e_base[kMaxTokens] = {};
  for (int64_t t = 0; t < M; ++t) {
    double err = 0.0, xmax = 0.0;
    for (int64_t b = 0; b < x.nb; ++b) {
      double xr[32], amax = 0.0;
      for (int pos = 0; pos < 32; ++pos) {
        xr[qblocks::act_value(pos)] = static_cast<double>(d[t * x.nb + b]) * q[t * K + 32 * b + pos];
        amax = std::max(amax, std::fabs(xr[qblocks::act_value(pos)]));
      }
      const float s = amax > 0.0 ? static_cast<float>(amax / kCodeMax) : 1.f;
      uint8_t u[32];
      double eb = 0.0;
      for (int k = 0; k < 32; ++k) {
        const int c = std::clamp(static_cast<int>(std::nearbyint(xr[k] / s)), -kCodeMax, kCodeMax);
        u[k] = static_cast<uint8_t>(c + kOffset);
        eb = std::max(eb, std::fabs(xr[k] - static_cast<double>(s) * c));
      }
      for (int j = 0; j < 8; ++j) std::memcpy(&x.xu[(b * 8 + j) * L + t], u + 4 * j, 4);
      x.s[b * L + t] = s;
      errs[t * x.nb + b] = eb;
      err = std::max(err, eb);
      xmax = std::max(xmax, amax);
    }
    emax[t] = err, xmaxs[t] = xmax;
  }
  split_outliers(errs, M, x.nb, x, e_base);
  for (int64_t t = 0; t < M; ++t) {  // the slack takes every block's error: a term's size, not its bound
    const double slack = (x.nb + 16) * 0x1p-22 * (xmaxs[t] + emax[t]);
    x.e[t] = static_cast<float>((e_base[t] + slack) * (1 + 0x1p-20)) + 1e-30f;
    double ex = 0.0;  // the sum of float terms in double: exact to 2^-50, under the 2^-20
    for (int o = 0; o < x.nout; ++o) ex += x.ex[o][t];
    x.e_wide[t] = x.nout ? static_cast<float>((x.e[t] + ex) * (1 + 0x1p-20)) : x.e[t];
  }
}

// |W_nb|_1 / |D_nb| of one Q8_0 block (34 bytes at blk): the sum of its codes' magnitudes, exact.
inline float abs_sum(const uint8_t* blk) {
  const __m256i a = _mm256_abs_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2)));
  const __m256i s = _mm256_sad_epu8(a, _mm256_setzero_si256());  // 4 sums of 8 bytes
  const __m128i h = _mm_add_epi64(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
  return static_cast<float>(_mm_cvtsi128_si32(h) + _mm_extract_epi32(h, 2));
}

// The pass's vector operations for L lanes. 8 lanes (ymm) for up to 8 tokens: Zen 4 issues two
// 256-bit vpdpbusd a cycle against one 512-bit, but the rest of a block's work does not halve:
// the default head at 4-8 rows took 8.7-8.9 ms against 16 lanes' 10.3 (cpu_greedy_head.py --gguf).
template <int L> struct Lanes;
// What 8 lanes in a ymm do alike at both levels; dp and the masked compares differ.
struct Ymm {
  using I = __m256i;
  using F = __m256;
  static I load(const int32_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
  static F load(const float* p) { return _mm256_loadu_ps(p); }
  static I set1(int32_t v) { return _mm256_set1_epi32(v); }
  static F set1(float v) { return _mm256_set1_ps(v); }
  static F fma(I acc, F s, F a) { return _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc), s, a); }
  static F mul(F a, F b) { return _mm256_mul_ps(a, b); }
  static F add(F a, F b) { return _mm256_add_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm256_fmadd_ps(a, b, c); }
  static F max(F a, F b) { return _mm256_max_ps(a, b); }
  static F abs(F a) { return _mm256_andnot_ps(_mm256_set1_ps(-0.f), a); }
  static void store(float* p, F a) { _mm256_storeu_ps(p, a); }
};
#ifdef FLATSERVE_GREEDY_Q8_VNNI
template <> struct Lanes<16> {
  using I = __m512i;
  using F = __m512;
  static I load(const int32_t* p) { return _mm512_loadu_si512(p); }
  static F load(const float* p) { return _mm512_loadu_ps(p); }
  static I set1(int32_t v) { return _mm512_set1_epi32(v); }
  static F set1(float v) { return _mm512_set1_ps(v); }
  static I dp(I acc, I x, I w) { return _mm512_dpbusd_epi32(acc, x, w); }
  static F fma(I acc, F s, F a) { return _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), s, a); }
  static F mul(F a, F b) { return _mm512_mul_ps(a, b); }
  static F add(F a, F b) { return _mm512_add_ps(a, b); }
  static F fmadd(F a, F b, F c) { return _mm512_fmadd_ps(a, b, c); }
  static F max(F a, F b) { return _mm512_max_ps(a, b); }
  static F abs(F a) { return _mm512_abs_ps(a); }
  static uint32_t gt(uint32_t m, F a, F b) { return _mm512_mask_cmp_ps_mask(m, a, b, _CMP_GT_OQ); }
  static uint32_t ge(uint32_t m, F a, F b) { return _mm512_mask_cmp_ps_mask(m, a, b, _CMP_GE_OQ); }
  static void store(float* p, F a) { _mm512_storeu_ps(p, a); }
};
template <> struct Lanes<8> : Ymm {
  static I dp(I acc, I x, I w) { return _mm256_dpbusd_epi32(acc, x, w); }
  static uint32_t gt(uint32_t m, F a, F b) { return _mm256_mask_cmp_ps_mask(static_cast<__mmask8>(m), a, b, _CMP_GT_OQ); }
  static uint32_t ge(uint32_t m, F a, F b) { return _mm256_mask_cmp_ps_mask(static_cast<__mmask8>(m), a, b, _CMP_GE_OQ); }
};
#else
// AVX2: 8 lanes in one ymm; 16 as two ymm (one broadcast of the row's codes serves both halves).
template <> struct Lanes<8> : Ymm {
#if defined(__AVXVNNI__)
  static I dp(I acc, I x, I w) { return _mm256_dpbusd_avx_epi32(acc, x, w); }  // x in [1, 255]
#else
  static I dp(I acc, I x, I w) {
    const I p = _mm256_maddubs_epi16(x, w);  // x in [1, 127]: no saturation
    return _mm256_add_epi32(acc, _mm256_madd_epi16(p, _mm256_set1_epi16(1)));
  }
#endif
  static uint32_t gt(uint32_t m, F a, F b) { return m & _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_GT_OQ)); }
  static uint32_t ge(uint32_t m, F a, F b) { return m & _mm256_movemask_ps(_mm256_cmp_ps(a, b, _CMP_GE_OQ)); }
};
template <> struct Lanes<16> {
  using H = Lanes<8>;
  struct I { __m256i lo, hi; };
  struct F { __m256 lo, hi; };
  static I load(const int32_t* p) { return {H::load(p), H::load(p + 8)}; }
  static F load(const float* p) { return {H::load(p), H::load(p + 8)}; }
  static I set1(int32_t v) { return {H::set1(v), H::set1(v)}; }
  static F set1(float v) { return {H::set1(v), H::set1(v)}; }
  static I dp(I acc, I x, I w) { return {H::dp(acc.lo, x.lo, w.lo), H::dp(acc.hi, x.hi, w.lo)}; }
  static F fma(I acc, F s, F a) { return {H::fma(acc.lo, s.lo, a.lo), H::fma(acc.hi, s.hi, a.hi)}; }
  static F mul(F a, F b) { return {H::mul(a.lo, b.lo), H::mul(a.hi, b.hi)}; }
  static F add(F a, F b) { return {H::add(a.lo, b.lo), H::add(a.hi, b.hi)}; }
  static F fmadd(F a, F b, F c) { return {H::fmadd(a.lo, b.lo, c.lo), H::fmadd(a.hi, b.hi, c.hi)}; }
  static F max(F a, F b) { return {H::max(a.lo, b.lo), H::max(a.hi, b.hi)}; }
  static F abs(F a) { return {H::abs(a.lo), H::abs(a.hi)}; }
  static uint32_t gt(uint32_t m, F a, F b) { return m & (H::gt(0xff, a.lo, b.lo) | H::gt(0xff, a.hi, b.hi) << 8); }
  static uint32_t ge(uint32_t m, F a, F b) { return m & (H::ge(0xff, a.lo, b.lo) | H::ge(0xff, a.hi, b.hi) << 8); }
  static void store(float* p, F a) { H::store(p, a.lo), H::store(p + 8, a.hi); }
};
#endif

// Rows n .. n + G of the head -> A (lanes: tokens). The G rows' blocks are one contiguous span
// (G x 34 nb bytes); the next span is requested into L2 a few lines a block (Prefetch, as the
// head's rows16: without it the 8 row streams a block apart wait on DRAM).
template <int G, int L>
inline void dot_rows(const XPack8& x, const uint8_t* w, int64_t rb, const int16_t* S, int64_t n,
                     typename Lanes<L>::F A[G], qblocks::Prefetch& pf) {
  using V = Lanes<L>;
  for (int r = 0; r < G; ++r) A[r] = V::set1(0.f);
  for (int64_t b = 0; b < x.nb; ++b) {
    pf.step();
    typename V::I xv[8];
    for (int j = 0; j < 8; ++j) xv[j] = V::load(x.xu.data() + (b * 8 + j) * L);
    const typename V::F s = V::load(x.s.data() + b * L);
    for (int r = 0; r < G; ++r) {
      const uint8_t* blk = w + (n + r) * rb + 34 * b;
      typename V::I acc = V::set1(-kOffset * static_cast<int32_t>(S[(n + r) * x.nb + b]));
      for (int j = 0; j < 8; ++j) {
        int32_t wq;
        std::memcpy(&wq, blk + 2 + 4 * j, 4);
        acc = V::dp(acc, xv[j], V::set1(wq));
      }
      // |q . c| <= 32 128 127 < 2^24: the conversion is exact
      A[r] = V::fma(acc, V::mul(s, V::set1(h2f(blk))), A[r]);
    }
  }
}

// Rows n0..n1: as greedy_q4.h says (v from the rows whose A is the best so far, scored exactly by
// `exact(n, t)`; every row whose U = A + B reaches v less the tie margin kept), G rows a step.
template <int L, typename Exact>
void rows(const XPack8& x, const uint8_t* w, int64_t rb, const int16_t* S, const float* R, int64_t n0, int64_t n1,
          Exact&& exact, Part& out) {
  using V = Lanes<L>;
  constexpr int G = 8;
  const uint32_t live = (1u << x.M) - 1;
  const typename V::F e = V::mul(V::load(x.e), V::set1(1 + 0x1p-20f));
  const typename V::F ew = V::mul(V::load(x.e_wide), V::set1(1 + 0x1p-20f));
  typename V::F bestA = V::set1(-INFINITY), thr = bestA;
  for (int t = 0; t < kMaxTokens; ++t) out.v[t] = -INFINITY;
  qblocks::Prefetch pf;
  auto keep = [&](int64_t n, typename V::F a) {
    uint32_t better = V::gt(live, a, bestA);
    if (better) {
      bestA = V::max(bestA, a);
      float th[L];
      for (; better; better &= better - 1) {
        const int t = __builtin_ctz(better);
        out.v[t] = std::max(out.v[t], exact(n, t));
      }
      for (int t = 0; t < L; ++t) th[t] = out.v[t] - tie_margin(out.v[t]);
      thr = V::load(th);
    }
    // U rounded up: R e is rounded up already; the product and the sum round 2^-24 each. First
    // with every outlier block's share at its widest, |W_nb|_1 <= R_n (e_wide = e + sum_o ex_o:
    // the same one FMA as without outliers, and most rows end there), then for a row that still
    // reaches thr with sum_o |W_nb|_1 ex_o from the blocks' codes: X's <= 2 nout + 1 roundings of
    // 2^-24 are under its 2^-20, ub's and u2's under the last one's.
    const typename V::F u = V::fmadd(V::set1(R[n]), ew, a);
    typename V::F uu = V::fmadd(V::abs(u), V::set1(0x1p-20f), u);
    if (x.nout && V::ge(live, uu, thr)) {
      typename V::F X = V::set1(0.f);
      for (int o = 0; o < x.nout; ++o) {
        const uint8_t* blk = w + n * rb + 34 * x.out_b[o];
        X = V::fmadd(V::set1(std::fabs(h2f(blk)) * abs_sum(blk)), V::load(x.ex[o]), X);
      }
      X = V::fmadd(X, V::set1(0x1p-20f), X);
      const typename V::F ub = V::fmadd(V::set1(R[n]), e, a);
      const typename V::F u2 = V::add(ub, X);
      uu = V::fmadd(V::add(V::abs(ub), V::abs(u2)), V::set1(0x1p-20f), u2);
    }
    float uv[L];
    V::store(uv, uu);
    for (uint32_t m = V::ge(live, uu, thr); m; m &= m - 1) {
      const int t = __builtin_ctz(m);
      out.cand[t].push_back({static_cast<int32_t>(n), uv[t]});
    }
  };
  typename V::F A[G];
  int64_t n = n0;
  for (; n + G <= n1; n += G) {
    pf.spread(w + std::min(n + G, n1) * rb, std::min<int64_t>(G, n1 - std::min(n + G, n1)) * rb, x.nb);
    dot_rows<G, L>(x, w, rb, S, n, A, pf);
    for (int r = 0; r < G; ++r) keep(n + r, A[r]);
  }
  for (; n < n1; ++n) {
    pf.spread(w, 0, 1);
    dot_rows<1, L>(x, w, rb, S, n, A, pf);
    keep(n, A[0]);
  }
}

// Q8_0 rows [n0, n1) -> S [N, nb] (sum of each block's codes) and R [N] (|W_n|_1 rounded up).
inline void prep_rows(const uint8_t* w8, int64_t n0, int64_t n1, int64_t nb, int16_t* S, float* R) {
  for (int64_t n = n0; n < n1; ++n) {
    double l1 = 0.0;
    for (int64_t b = 0; b < nb; ++b) {
      const uint8_t* blk = w8 + (n * nb + b) * 34;
      int sum = 0, abs = 0;
      for (int k = 0; k < 32; ++k) {
        const int c = static_cast<int8_t>(blk[2 + k]);
        sum += c, abs += std::abs(c);
      }
      S[n * nb + b] = static_cast<int16_t>(sum);
      l1 += std::fabs(static_cast<double>(h2f(blk))) * abs;
    }
    R[n] = static_cast<float>(l1 * (1 + 0x1p-20));
  }
}

}  // namespace flatserve::greedy_q8
#endif
