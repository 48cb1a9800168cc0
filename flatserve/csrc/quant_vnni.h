// The AMX tiles' quantized GEMM (csrc/quant_amx.h) in AVX-512 VNNI lanes: the avx512 level's
// (AMD Zen 4's) calls of more than a few rows, with the tiles' bits.
//
// Why: without tiles, the vector paths spend ~10 instructions on each (activation row, weight
// row, 32 values); at 16 generated rows the default model's 262k x 640 Q8_0 LM head was 47 ms of
// a 90-97 ms step on a 2-core Zen 4, instruction-bound (its 171 MB read in 6 ms at one row).
// Here one `vpdpwssd` does 2 products for each of 16 activation rows: 16 instructions per weight
// row and block for 16 activation rows, then 3 to scale them, ~1.2 per (row, row, block).
//
// How: the tiles' operands with int16 lanes. A weight group is 16 rows unpacked to int16 codes
// (w16 [16][K]); an activation group is 16 rows whose block b is 16 vectors, vector j holding
// values 2j, 2j + 1 of the 16 rows (ActPairs: lane t = row t). The dots of weight row r and block
// b against the group, in lane t: sum_j vpdpwssd(x_j, broadcast w16[r][2j, 2j + 1]) = the exact
// int32 S of the tiles (|S| <= 32 x 128 x 32639 < 2^28). The float operations after it are the
// tiles', in their order, so a row's bits are the same on tiles, rows16 (csrc/quant_rows.h) or
// this path, whatever its call:
//
//   acc = fma(float(S) * w_scale, x_scale, acc)          per block (or half block), in order
//   acc = fma(-w_min, x_sum, acc)                        K formats' offsets, after each block
#pragma once

#include "quant_blocks.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <c10/util/BFloat16.h>

namespace flatserve::qvnni {

using namespace flatserve::qblocks;

// One call's activation rows in groups of 16 (the last zero-padded): per group and block, the
// codes [16 pairs][16 rows][2] and the rows' scales and scaled sums [16].
struct ActPairs {
  int64_t groups = 0, nb = 0;
  std::vector<int16_t> x;
  std::vector<float> d, s;
  const int16_t* x_at(int64_t g, int64_t b) const { return x.data() + (g * nb + b) * 512; }
  const float* d_at(int64_t g, int64_t b) const { return d.data() + (g * nb + b) * 16; }
  const float* s_at(int64_t g, int64_t b) const { return s.data() + (g * nb + b) * 16; }
};

inline void act_pairs(const int16_t* q, const float* d, const float* s, int64_t M, int64_t K, ActPairs& a) {
  a.nb = K / 32;
  a.groups = (M + 15) / 16;
  const int64_t n = a.groups * a.nb;
  a.x.assign(n * 512, 0);
  a.d.assign(n * 16, 0.f);
  a.s.assign(n * 16, 0.f);
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) {
      const int64_t g = m / 16, t = m % 16;
      for (int64_t b = 0; b < a.nb; ++b) {
        const int16_t* xq = q + m * K + 32 * b;
        int16_t* dst = a.x.data() + (g * a.nb + b) * 512 + 2 * t;
        for (int l = 0; l < 32; ++l) dst[(l / 2) * 32 + l % 2] = xq[act_value(l)];  // value l: pair l / 2
        a.d[(g * a.nb + b) * 16 + t] = d[m * a.nb + b];
        a.s[(g * a.nb + b) * 16 + t] = s[m * a.nb + b];
      }
    }
  });
}

// One step (J = 16 pairs: a block; 8: a half block) of eight weight rows (wr[i]: its codes) against
// an activation group's pairs xb: S[i] lane t = the exact int32 dot of weight row i and row t.
// Constant trip counts, unrolled, so the 8 chains stay in registers (a loop bound that depended
// on the half compiled to register copies and spills around every vpdpwssd).
template <int J>
__attribute__((always_inline)) inline void dots8(const int16_t* const wr[8], const int16_t* xb, __m512i S[8]) {
  for (int i = 0; i < 8; ++i) S[i] = _mm512_setzero_si512();
#pragma GCC unroll 16
  for (int j = 0; j < J; ++j) {
    const __m512i x = _mm512_loadu_si512(xb + 32 * j);
#pragma GCC unroll 8
    for (int i = 0; i < 8; ++i) {
      int32_t pair;
      std::memcpy(&pair, wr[i] + 2 * j, 4);
      S[i] = _mm512_dpwssd_epi32(S[i], x, _mm512_set1_epi32(pair));
    }
  }
}

// Eight weight rows (codes w16 + r * K, scales scT[2 b + h][16], offsets mnT[b][16], from row
// r0) against activation group g -> acc[i] lane t: row 16 g + t, weight row r0 + i. Eight rows
// at a time: 8 dot chains, 8 accumulators and a vector of codes fit the 32 registers.
template <bool halves, bool mins>
inline void rows8(const int16_t* w16, int64_t K, const float* scT, const float* mnT, int r0, const ActPairs& a,
                  int64_t g, __m512 acc[8], Prefetch& pf) {
  for (int i = 0; i < 8; ++i) acc[i] = _mm512_setzero_ps();
  for (int64_t b = 0; b < a.nb; ++b) {
    pf.step();
    const int16_t* xb = a.x_at(g, b);
    const __m512 xd = _mm512_loadu_ps(a.d_at(g, b));
    const int16_t* wr[8];
    for (int i = 0; i < 8; ++i) wr[i] = w16 + (r0 + i) * K + 32 * b;
    __m512i S[8];
    for (int h = 0; h < (halves ? 2 : 1); ++h) {
      if constexpr (halves) {
        const int16_t* wh[8];
        for (int i = 0; i < 8; ++i) wh[i] = wr[i] + 16 * h;
        dots8<8>(wh, xb + 256 * h, S);
      } else {
        dots8<16>(wr, xb, S);
      }
      const float* sc = scT + (2 * b + h) * 16 + r0;
      for (int i = 0; i < 8; ++i)
        acc[i] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(S[i]), _mm512_set1_ps(sc[i])), xd, acc[i]);
    }
    if constexpr (mins) {
      const __m512 xs = _mm512_loadu_ps(a.s_at(g, b));
      for (int i = 0; i < 8; ++i) acc[i] = _mm512_fmadd_ps(_mm512_set1_ps(-mnT[16 * b + r0 + i]), xs, acc[i]);
    }
  }
}

// 16 weight rows' codes, int16 [16][K], scales transposed scT[K / 16][16] and offsets mnT[nb][16];
// rows past N (r >= nn) are zeros (read, never stored).
struct WGroup16 {
  std::vector<int8_t> v;
  std::vector<int16_t> w16;
  std::vector<float> sc, mn, scT, mnT;
  explicit WGroup16(int64_t K)
      : v(16 * K, 0), w16(16 * K, 0), sc(16 * K / 16, 0.f), mn(16 * K / 32, 0.f), scT(K), mnT(K / 2) {}

  void load(const uint8_t* w, int64_t n0, int64_t nn, int64_t row_bytes, const Layout& L, int fmt, int64_t K) {
    const int64_t nb = K / 32;
    if (fmt == Q8_0) {  // the stored codes widened in place: no unpack (the LM head's 5.2M blocks)
      for (int64_t r = 0; r < 16; ++r) {
        const uint8_t* row = w + (n0 + std::min(r, nn - 1)) * row_bytes;
        for (int64_t b = 0; b < nb; ++b) {
          _mm512_storeu_si512(w16.data() + r * K + 32 * b, _mm512_cvtepi8_epi16(_mm256_loadu_si256(
                                                             reinterpret_cast<const __m256i*>(row + 34 * b + 2))));
          scT[32 * b + r] = h2f(row + 34 * b);
        }
      }
      return;
    }
    for (int64_t r = 0; r < 16; ++r) {
      if (r < nn) unpack_row(w + (n0 + r) * row_bytes, L, fmt, K, {v.data() + r * K, sc.data() + r * 2 * nb,
                                                                   mn.data() + r * nb});
      else std::memset(v.data() + r * K, 0, K);
    }
    for (int64_t i = 0; i < 16 * K; i += 32)
      _mm512_storeu_si512(w16.data() + i, _mm512_cvtepi8_epi16(_mm256_loadu_si256(
                                              reinterpret_cast<const __m256i*>(v.data() + i))));
    for (int64_t i = 0; i < 2 * nb; ++i)
      for (int r = 0; r < 16; ++r) scT[16 * i + r] = sc[r * 2 * nb + i];
    if (L.mins)
      for (int64_t b = 0; b < nb; ++b)
        for (int r = 0; r < 16; ++r) mnT[16 * b + r] = mn[r * nb + b];
  }
};

// The 16 x 16 results of a weight group (res[r][t], lane t of weight row r) -> out row 16 g + t,
// columns n0 .. n0 + nn: contiguous per output row (stores down a column took one cache line per
// value: ~9% of the head's time at 16 rows), float and bfloat16 16 at a time.
template <typename T, typename Store>
inline void store_group(const float* res, int64_t g, int64_t M, int64_t n0, int64_t nn, T* out, int64_t ldo,
                        Store store) {
  const __m512i col = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                         _mm512_set1_epi32(16));
  const __mmask16 keep = static_cast<__mmask16>((1u << nn) - 1);
  for (int64_t t = 0; t < 16 && 16 * g + t < M; ++t) {
    const __m512 v = _mm512_i32gather_ps(col, res + t, 4);  // res[0..15][t]
    T* o = out + (16 * g + t) * ldo + n0;
    if constexpr (std::is_same_v<T, float>) {
      _mm512_mask_storeu_ps(o, keep, v);
    } else if constexpr (std::is_same_v<T, c10::BFloat16>) {  // round to nearest even, NaN -> 0x7FC0 (c10's)
      const __m512i u = _mm512_castps_si512(v);
      const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
      __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
      r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
      _mm256_mask_storeu_epi16(o, keep, _mm512_cvtepi32_epi16(r));
    } else {
      alignas(64) float f[16];
      _mm512_store_ps(f, v);
      for (int64_t r = 0; r < nn; ++r) store(o + r, f[r]);
    }
  }
}

template <bool halves, bool mins, typename T, typename Store>
void gemm_t(const ActPairs& a, int64_t M, const uint8_t* w, int64_t N, int64_t row_bytes, int fmt, T* out,
            int64_t ldo, Store store) {
  const Layout L = layout(fmt);
  const int64_t K = 32 * a.nb;
  at::parallel_for(0, (N + 15) / 16, 1, [&](int64_t c0, int64_t c1) {
    WGroup16 wg(K);
    alignas(64) float res[256];
    __m512 acc[8];
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t n0 = 16 * c, nn = std::min<int64_t>(16, N - n0);
      wg.load(w, n0, nn, row_bytes, L, fmt, K);
      Prefetch pf;  // spread over this group's 2 * groups * nb blocks
      if (c + 1 < c1)  // the head at 16 rows stalled on its loads ~30% of its time without
        pf.spread(w + (n0 + 16) * row_bytes, std::min<int64_t>(16, N - n0 - 16) * row_bytes, 2 * a.groups * a.nb);
      for (int64_t g = 0; g < a.groups; ++g) {
        for (int r0 = 0; r0 < nn; r0 += 8) {
          rows8<halves, mins>(wg.w16.data(), K, wg.scT.data(), wg.mnT.data(), r0, a, g, acc, pf);
          for (int i = 0; i < 8; ++i) _mm512_store_ps(res + 16 * (r0 + i), acc[i]);
        }
        store_group(res, g, M, n0, nn, out, ldo, store);
      }
    }
  });
}

// out[m, n] for every activation row m of `a` and weight row n of W (`fmt` blocks, [N, row_bytes]);
// store(T*, float) writes one result.
template <typename T, typename Store>
void gemm(const ActPairs& a, int64_t M, const uint8_t* w, int64_t N, int64_t row_bytes, int fmt, T* out,
          int64_t ldo, Store store) {
  if (fmt == Q6_K) return gemm_t<true, false>(a, M, w, N, row_bytes, fmt, out, ldo, store);
  if (layout(fmt).mins) return gemm_t<false, true>(a, M, w, N, row_bytes, fmt, out, ldo, store);
  return gemm_t<false, false>(a, M, w, N, row_bytes, fmt, out, ldo, store);
}

}  // namespace flatserve::qvnni
#endif
