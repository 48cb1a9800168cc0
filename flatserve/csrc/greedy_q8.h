// The quantized LM head's greedy candidate pass on AVX-512 VNNI (flatserve/model/greedy_q8.py says
// what and why): the head's own Q8_0 codes q (scale D per 32 weights), dotted with x requantized
// to int8 codes c per 32 values (scale s_b = max |xr_b| / 127), where the head dots int16 codes.
// vpdpbusd does 64 products an instruction against vpdpwssd's 32 for the head (benchmarks/dev/
// cpu_vnni_loop.cpp: both ~1 a cycle on Zen 4), and the pass reads no copy of the head.
//
//   A_n = sum_b D_nb s_b (q_nb . c_b)     xr = the head's view of x (xd * xq, exact in double)
//   |head(x)_n - A_n| <= |W_n|_1 (E + slack) =: B_n,   E = max_k |xr_k - s_b c_k|
//
// since sum_k |W_nk| |xr_k - s c_k| <= |W_n|_1 E. slack covers fp32 rounding of both dots: each
// term of either rounds at most nb + 5 times and is at most sum_k |W_nk| (|xr_k| + E), so
// (nb + 16) 2^-22 (xmax + E) covers the two (as greedy_q4.h's). One |W_n|_1 a row (R, 4 bytes),
// not a bound per block: on the default model's real hidden states the per-row bound keeps ~240
// rows a token and ~630 a 16-token union of 262k (an offline float64 check, 384 decode rows,
// 2026-11-28), few enough that rescoring them is ~0.3% of the head's work.
//
// vpdpbusd multiplies unsigned by signed bytes: the stored codes are the signed side (broadcast
// from the block as stored), x goes as c + 128 and each block's sum 128 S_nb (S = sum_k q_nk, kept
// as int16 per block, 2 bytes a block) starts the accumulator. Lanes are tokens, so a row's 16
// logits need no horizontal sum. Candidates and the exact rescoring are greedy_q4.h's (v, the
// tie margin, Part).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "greedy_q4.h"
#include "quant_blocks.h"

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define FLATSERVE_GREEDY_Q8 1
#include <immintrin.h>

namespace flatserve::greedy_q8 {

using flatserve::qblocks::h2f;
using greedy_q4::Cand;
using greedy_q4::kMaxTokens;
using greedy_q4::Part;
using greedy_q4::tie_margin;

struct XPack8 {
  int64_t M = 0, nb = 0;
  std::vector<int32_t> xu;  // [nb][8][16]: token t's codes c + 128 of block b, values 4j..4j+3
  std::vector<float> s;     // [nb][16]: s_b per token
  float e[kMaxTokens] = {}; // E + slack per token, rounded up (B_n = R_n e)
};

// q [M, K] the head's int16 codes (ACT_ORDER per block), d [M, K / 32] their scales -> XPack8.
inline void pack_x8(const int16_t* q, const float* d, int64_t M, int64_t K, XPack8& x) {
  x.M = M, x.nb = K / 32;
  x.xu.assign(x.nb * 8 * 16, 0), x.s.assign(x.nb * 16, 1.f);
  for (int64_t t = 0; t < M; ++t) {
    double err = 0.0, xmax = 0.0;
    for (int64_t b = 0; b < x.nb; ++b) {
      double xr[32], amax = 0.0;
      for (int pos = 0; pos < 32; ++pos) {
        xr[qblocks::act_value(pos)] = static_cast<double>(d[t * x.nb + b]) * q[t * K + 32 * b + pos];
        amax = std::max(amax, std::fabs(xr[qblocks::act_value(pos)]));
      }
      const float s = amax > 0.0 ? static_cast<float>(amax / 127) : 1.f;
      uint8_t u[32];
      for (int k = 0; k < 32; ++k) {
        const int c = std::clamp(static_cast<int>(std::nearbyint(xr[k] / s)), -127, 127);
        u[k] = static_cast<uint8_t>(c + 128);
        err = std::max(err, std::fabs(xr[k] - static_cast<double>(s) * c));
      }
      for (int j = 0; j < 8; ++j) std::memcpy(&x.xu[(b * 8 + j) * 16 + t], u + 4 * j, 4);
      x.s[b * 16 + t] = s;
      xmax = std::max(xmax, amax);
    }
    const double slack = (x.nb + 16) * 0x1p-22 * (xmax + err);
    x.e[t] = static_cast<float>((err + slack) * (1 + 0x1p-20)) + 1e-30f;
  }
}

// Rows n .. n + G of the head -> A (lanes: tokens). The G rows' blocks are one contiguous span
// (G x 34 nb bytes); the next span is requested into L2 a few lines a block (Prefetch, as the
// head's rows16: without it the 8 row streams a block apart wait on DRAM).
template <int G>
inline void dot_rows(const XPack8& x, const uint8_t* w, int64_t rb, const int16_t* S, int64_t n, __m512 A[G],
                     qblocks::Prefetch& pf) {
  for (int r = 0; r < G; ++r) A[r] = _mm512_setzero_ps();
  for (int64_t b = 0; b < x.nb; ++b) {
    pf.step();
    __m512i xv[8];
    for (int j = 0; j < 8; ++j) xv[j] = _mm512_loadu_si512(x.xu.data() + (b * 8 + j) * 16);
    const __m512 s = _mm512_loadu_ps(x.s.data() + b * 16);
    for (int r = 0; r < G; ++r) {
      const uint8_t* blk = w + (n + r) * rb + 34 * b;
      __m512i acc = _mm512_set1_epi32(-128 * static_cast<int32_t>(S[(n + r) * x.nb + b]));
      for (int j = 0; j < 8; ++j) {
        int32_t wq;
        std::memcpy(&wq, blk + 2 + 4 * j, 4);
        acc = _mm512_dpbusd_epi32(acc, xv[j], _mm512_set1_epi32(wq));
      }
      // |q . c| <= 32 127 127 < 2^24: the conversion is exact
      A[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_mul_ps(s, _mm512_set1_ps(h2f(blk))), A[r]);
    }
  }
}

// Rows n0..n1: as greedy_q4::rows (v from the rows whose A is the best so far, scored exactly by
// `exact(n, t)`; every row whose U = A + B reaches v less the tie margin kept), G rows a step.
template <typename Exact>
void rows(const XPack8& x, const uint8_t* w, int64_t rb, const int16_t* S, const float* R, int64_t n0, int64_t n1,
          Exact&& exact, Part& out) {
  constexpr int G = 8;
  const __mmask16 live = static_cast<__mmask16>((1u << x.M) - 1);
  const __m512 e = _mm512_loadu_ps(x.e), up = _mm512_set1_ps(1 + 0x1p-20f);
  __m512 bestA = _mm512_set1_ps(-INFINITY), thr = bestA;
  for (int t = 0; t < kMaxTokens; ++t) out.v[t] = -INFINITY;
  qblocks::Prefetch pf;
  auto keep = [&](int64_t n, __m512 a) {
    __mmask16 better = _mm512_mask_cmp_ps_mask(live, a, bestA, _CMP_GT_OQ);
    if (better) {
      bestA = _mm512_max_ps(bestA, a);
      alignas(64) float th[16];
      for (; better; better &= better - 1) {
        const int t = __builtin_ctz(better);
        out.v[t] = std::max(out.v[t], exact(n, t));
      }
      for (int t = 0; t < 16; ++t) th[t] = out.v[t] - tie_margin(out.v[t]);
      thr = _mm512_load_ps(th);
    }
    // U rounded up: R e is rounded up already; the product and the sum round 2^-24 each
    const __m512 u = _mm512_fmadd_ps(_mm512_set1_ps(R[n]), _mm512_mul_ps(e, up), a);
    const __m512 uu = _mm512_fmadd_ps(_mm512_abs_ps(u), _mm512_set1_ps(0x1p-20f), u);
    alignas(64) float uv[16];
    _mm512_store_ps(uv, uu);
    for (__mmask16 m = _mm512_mask_cmp_ps_mask(live, uu, thr, _CMP_GE_OQ); m; m &= m - 1) {
      const int t = __builtin_ctz(m);
      out.cand[t].push_back({static_cast<int32_t>(n), uv[t]});
    }
  };
  __m512 A[G];
  int64_t n = n0;
  for (; n + G <= n1; n += G) {
    pf.spread(w + std::min(n + G, n1) * rb, std::min<int64_t>(G, n1 - std::min(n + G, n1)) * rb, x.nb);
    dot_rows<G>(x, w, rb, S, n, A, pf);
    for (int r = 0; r < G; ++r) keep(n + r, A[r]);
  }
  for (; n < n1; ++n) {
    pf.spread(w, 0, 1);
    dot_rows<1>(x, w, rb, S, n, A, pf);
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
