// The quantized LM head's greedy candidate pass for a few tokens on AVX-512 (flatserve/model/
// greedy_q8.py says where it runs): greedy_q4.h's 4-bit copy of the head (the same codes c and
// scales d: quantize_block), laid out with 16 head rows in the lanes, dotted with the head's own
// int16 activation codes q (scale xd_b per 32 values: xr = xd q exactly). Why: at one token
// greedy_q8.h's lanes are tokens, so 15 of 16 idle, and the head itself (rows16) takes 6.3-6.7 ms
// at one row where the 2-core Zen 4 reads its 178 MB in ~3.7 ms (48 GB/s; benchmarks/dev/
// cpu_greedy_head.py --gguf prints both): arithmetic bounds it (by our reading, sum16v's shuffle
// tree a block). The copy is 94 MB and needs no horizontal sum: a
// lane is a row from the first block to the last.
//
//   A_n = sum_b d_nb xd_b (u_nb . q_b - 8 sum q_b)      u = c + 8 (unsigned nibbles)
//   |head(x)_n - A_n| <= sum_b d_nb |xr_b|_1 / 2 + slack =: B_n
//
// since head(x)_n - A_n = (W - W4) . xr up to the fp32 rounding of both dots (`slack`: greedy_q4.h's
// pack_x bound, which covers these terms, each at most wmax |xr|). x is not requantized: int8
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

#if defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define FLATSERVE_GREEDY_Q4T 1
#include <immintrin.h>

namespace flatserve::greedy_q4t {

using greedy_q4::kMaxTokens;
using greedy_q4::Part;
using greedy_q4::tie_margin;

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
                     int64_t g, __m512 A[MT], __m512 Bw[MT], qblocks::Prefetch& pf) {
  const __m512i m4 = _mm512_set1_epi32(0x000F000F);
  for (int t = 0; t < MT; ++t) A[t] = Bw[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < x.nb; ++b) {
    pf.step();
    const uint8_t* cb = codes + (g * x.nb + b) * 256;
    __m512i u[16];  // pair p of vector j: values 8j + 2p, 8j + 2p + 1
    for (int j = 0; j < 4; ++j) {
      const __m512i z = _mm512_loadu_si512(cb + 64 * j);
      u[4 * j] = _mm512_and_si512(z, m4);
      u[4 * j + 1] = _mm512_and_si512(_mm512_srli_epi32(z, 4), m4);
      u[4 * j + 2] = _mm512_and_si512(_mm512_srli_epi32(z, 8), m4);
      u[4 * j + 3] = _mm512_and_si512(_mm512_srli_epi32(z, 12), m4);
    }
    const __m512 dv = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(scales + (g * x.nb + b) * 16)));
    for (int t = 0; t < MT; ++t) {
      const int32_t* xw = x.xw.data() + (t * x.nb + b) * 16;
      __m512i acc = _mm512_set1_epi32(x.off[t * x.nb + b]);
      for (int p = 0; p < 16; ++p) acc = _mm512_dpwssd_epi32(acc, u[p], _mm512_set1_epi32(xw[p]));
      A[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc), _mm512_mul_ps(dv, _mm512_set1_ps(xd[t * (K / 32) + b])), A[t]);
      Bw[t] = _mm512_fmadd_ps(dv, _mm512_set1_ps(x.h[t * x.nb + b]), Bw[t]);
    }
  }
}

// Groups g0..g1: as greedy_q4::rows (a row whose A is the best so far is scored exactly by
// `exact(n, t)`; every row whose U = A + B reaches v less the tie margin is kept), 16 rows a step.
template <int MT, typename Exact>
void rows_t(const XPackT& x, const uint8_t* codes, const uint16_t* scales, const float* xd, int64_t K, int64_t N,
            int64_t g0, int64_t g1, Exact&& exact, Part& out) {
  float bestA[kMaxTokens];
  for (int t = 0; t < kMaxTokens; ++t) out.v[t] = bestA[t] = -INFINITY;
  qblocks::Prefetch pf;
  __m512 A[MT], Bw[MT];
  for (int64_t g = g0; g < g1; ++g) {
    if (g + 1 < g1) pf.spread(codes + (g + 1) * x.nb * 256, x.nb * 256, x.nb);
    group_ab<MT>(x, codes, scales, xd, K, g, A, Bw, pf);
    const uint32_t live = N - 16 * g >= 16 ? 0xFFFFu : (1u << (N - 16 * g)) - 1;
    for (int t = 0; t < MT; ++t) {
      // B: Bw's own fp32 sum ((nb + 3) 2^-24 relative, under 2^-15 for nb <= 512) rounded up,
      // then U's additions rounded up
      const __m512 B = _mm512_fmadd_ps(Bw[t], _mm512_set1_ps(0x1p-14f), Bw[t]);
      __m512 U = _mm512_add_ps(_mm512_add_ps(A[t], B), _mm512_set1_ps(x.slack[t]));
      U = _mm512_fmadd_ps(_mm512_abs_ps(U), _mm512_set1_ps(0x1p-20f), U);
      alignas(64) float a[16], uv[16];
      _mm512_store_ps(a, A[t]);
      _mm512_store_ps(uv, U);
      for (uint32_t m = _mm512_mask_cmp_ps_mask(live, A[t], _mm512_set1_ps(bestA[t]), _CMP_GT_OQ); m; m &= m - 1) {
        const int r = __builtin_ctz(m);
        if (a[r] > bestA[t]) {
          bestA[t] = a[r];
          out.v[t] = std::max(out.v[t], exact(16 * g + r, t));
        }
      }
      const float thr = out.v[t] - tie_margin(out.v[t]);
      for (uint32_t m = _mm512_mask_cmp_ps_mask(live, U, _mm512_set1_ps(thr), _CMP_GE_OQ); m; m &= m - 1) {
        const int r = __builtin_ctz(m);
        out.cand[t].push_back({static_cast<int32_t>(16 * g + r), uv[r]});
      }
    }
  }
}

}  // namespace flatserve::greedy_q4t
#endif
