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
#include "quant_rows.h"

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

// K formats straight to int16: one 256-value superblock's codes (unpack_block's values, widened)
// into w (w16's row slice), and the 16 rows' scales / offsets of superblock i, gathered a row a
// lane (offs: the rows' byte offsets from sb, the first row's superblock), into scT + 256 i and
// mnT + 128 i, with unpack_block's float products (d * s, dmin * m: the same bits).
template <int fmt>
inline void widen_k(const uint8_t* b, int16_t* w) {
  const __m512i m4 = _mm512_set1_epi16(0x0F);
  auto wide = [](const uint8_t* p) {  // 32 bytes -> 32 int16
    return _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  };
  auto put = [&](int at, __m512i v) { _mm512_storeu_si512(w + at, v); };
  if constexpr (fmt == Q6_K) {
    const __m512i m3 = _mm512_set1_epi16(3), k32 = _mm512_set1_epi16(32);
    auto hi2 = [&](__m512i h, int shift) {  // bits shift, shift + 1 of qh as bits 4, 5
      return _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h, shift), m3), 4);
    };
    for (int half = 0; half < 2; ++half) {
      const __m512i l0 = wide(b + 64 * half), l1 = wide(b + 64 * half + 32), h = wide(b + 128 + 32 * half);
      const int o = 128 * half;
      put(o, _mm512_sub_epi16(_mm512_or_si512(_mm512_and_si512(l0, m4), hi2(h, 0)), k32));
      put(o + 32, _mm512_sub_epi16(_mm512_or_si512(_mm512_and_si512(l1, m4), hi2(h, 2)), k32));
      put(o + 64, _mm512_sub_epi16(_mm512_or_si512(_mm512_srli_epi16(l0, 4), hi2(h, 4)), k32));
      put(o + 96, _mm512_sub_epi16(_mm512_or_si512(_mm512_srli_epi16(l1, 4), hi2(h, 6)), k32));
    }
  } else {  // Q4_K, Q5_K: sub-block pair i = qs[32 i ..]'s low nibbles, then its high ones
    const uint8_t* qs = b + (fmt == Q4_K ? 16 : 48);
    const __m512i h = fmt == Q5_K ? wide(b + 16) : _mm512_setzero_si512();
    const __m512i one = _mm512_set1_epi16(1);
    for (int i = 0; i < 4; ++i) {
      const __m512i q = wide(qs + 32 * i);
      __m512i lo = _mm512_and_si512(q, m4), hi = _mm512_srli_epi16(q, 4);
      if constexpr (fmt == Q5_K) {  // bit 2i / 2i + 1 of qh[l]: bit 4 of value l of the pair's halves
        lo = _mm512_or_si512(lo, _mm512_slli_epi16(_mm512_and_si512(_mm512_srli_epi16(h, 2 * i), one), 4));
        const __m512i b1 = _mm512_and_si512(_mm512_srli_epi16(h, 2 * i + 1), one);
        hi = _mm512_or_si512(hi, _mm512_slli_epi16(b1, 4));
      }
      put(64 * i, lo);
      put(64 * i + 32, hi);
    }
  }
}

template <int fmt>
inline void scales_k(__m512i offs, const uint8_t* sb, float* scT, float* mnT) {
  auto at = [&](int byte) { return _mm512_i32gather_epi32(offs, sb + byte, 1); };
  auto byte_of = [](__m512i v, int j) {
    return _mm512_and_si512(_mm512_srli_epi32(v, 8 * j), _mm512_set1_epi32(0xFF));
  };
  auto half_ps = [](__m512i v) { return _mm512_cvtph_ps(_mm512_cvtepi32_epi16(v)); };  // each lane's low fp16
  if constexpr (fmt == Q6_K) {  // int8 scales at 192, fp16 d at 208 (read as 206's dword: in the block)
    const __m512 d = half_ps(_mm512_srli_epi32(at(206), 16));
    for (int q = 0; q < 4; ++q) {
      const __m512i v = at(192 + 4 * q);
      for (int j = 0; j < 4; ++j) {
        const __m512i sc = _mm512_srai_epi32(_mm512_slli_epi32(v, 24 - 8 * j), 24);
        _mm512_storeu_ps(scT + 16 * (4 * q + j), _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc)));
      }
    }
  } else {  // k_scales across the lanes: 8 six-bit scales and mins in 12 bytes from byte 4
    const __m512i g = at(0), A = at(4), B = at(8), C = at(12);
    const __m512i m6 = _mm512_set1_epi32(63), m4 = _mm512_set1_epi32(15);
    const __m512 d = half_ps(g), dmin = half_ps(_mm512_srli_epi32(g, 16));
    auto put = [&](int j, __m512i sc, __m512i mn) {
      const __m512 s = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sc));
      _mm512_storeu_ps(scT + 16 * (2 * j), s);
      _mm512_storeu_ps(scT + 16 * (2 * j + 1), s);
      _mm512_storeu_ps(mnT + 16 * j, _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(mn)));
    };
    for (int j = 0; j < 4; ++j) {
      const __m512i a = byte_of(A, j), bb = byte_of(B, j), c = byte_of(C, j);
      put(j, _mm512_and_si512(a, m6), _mm512_and_si512(bb, m6));
      put(j + 4, _mm512_or_si512(_mm512_and_si512(c, m4), _mm512_slli_epi32(_mm512_srli_epi32(a, 6), 4)),
          _mm512_or_si512(_mm512_srli_epi32(c, 4), _mm512_slli_epi32(_mm512_srli_epi32(bb, 6), 4)));
    }
  }
}

// 16 weight rows' codes, int16 [16][K], scales transposed scT[K / 16][16] (32-value formats:
// only the even entries, the ones rows8 reads) and offsets mnT[nb][16]; rows past N (r >= nn)
// repeat row nn - 1 (read, never stored). Each block is widened straight from its stored bytes
// (DirectRow::codes32) or from unpack_block's codes, and 32-value formats' scales are gathered 16
// rows a block: unpacking to int8 rows, widening them and transposing the scales in three passes
// had taken ~55% of the tiles' time on the layers' q5_0 gate_up at 16 rows (2-core Zen 4).
template <int fmt>
struct WGroup16 {
  static constexpr Layout L = known_layout(fmt);
  std::vector<int16_t> w16;
  std::vector<float> scT, mnT;
  explicit WGroup16(int64_t K) : w16(16 * K, 0), scT(K, 0.f), mnT(K / 2, 0.f) {}

  void load(const uint8_t* w, int64_t n0, int64_t nn, int64_t row_bytes, int64_t K) {
    const int64_t nb = K / 32;
    auto row = [&](int64_t r) { return w + (n0 + std::min(r, nn - 1)) * row_bytes; };
    if constexpr (L.block == 32) {
      for (int64_t r = 0; r < 16; ++r) {
        const uint8_t* src = row(r);
        for (int64_t b = 0; b < nb; ++b)
          _mm512_storeu_si512(w16.data() + r * K + 32 * b,
                              _mm512_cvtepi8_epi16(DirectRow<fmt>::codes32(src + b * L.type_size)));
      }
      alignas(64) int32_t o[16];
      for (int r = 0; r < 16; ++r) o[r] = static_cast<int32_t>(row(r) - row(0));
      const __m512i offs = _mm512_load_si512(o);
      for (int64_t b = 0; b < nb; ++b) {  // fp16 d at each block's start: the dword's low half
        const __m512i g = _mm512_i32gather_epi32(offs, row(0) + b * L.type_size, 1);
        _mm512_storeu_ps(scT.data() + 32 * b, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g)));
      }
    } else {  // widen_k / scales_k: unpack_block to int8, widening and scattering the scales a
      // row at a time had taken about half of a q4_k call at 16 rows
      for (int64_t r = 0; r < 16; ++r)
        for (int64_t i = 0; i < K / 256; ++i)
          widen_k<fmt>(row(r) + i * L.type_size, w16.data() + r * K + 256 * i);
      alignas(64) int32_t o[16];
      for (int r = 0; r < 16; ++r) o[r] = static_cast<int32_t>(row(r) - row(0));
      const __m512i offs = _mm512_load_si512(o);
      for (int64_t i = 0; i < K / 256; ++i)
        scales_k<fmt>(offs, row(0) + i * L.type_size, scT.data() + 256 * i, mnT.data() + 128 * i);
    }
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
    } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
      _mm256_mask_storeu_epi16(o, keep, bf16_rne(v));
    } else {
      alignas(64) float f[16];
      _mm512_store_ps(f, v);
      for (int64_t r = 0; r < nn; ++r) store(o + r, f[r]);
    }
  }
}

template <int fmt, typename T, typename Store>
void gemm_t(const ActPairs& a, int64_t M, const uint8_t* w, int64_t N, int64_t row_bytes, T* out, int64_t ldo,
            Store store) {
  constexpr bool halves = fmt == Q6_K, mins = known_layout(fmt).mins;
  const int64_t K = 32 * a.nb;
  at::parallel_for(0, (N + 15) / 16, 1, [&](int64_t c0, int64_t c1) {
    WGroup16<fmt> wg(K);
    alignas(64) float res[256];
    __m512 acc[8];
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t n0 = 16 * c, nn = std::min<int64_t>(16, N - n0);
      wg.load(w, n0, nn, row_bytes, K);
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
  switch (fmt) {
    case Q4_0: return gemm_t<Q4_0>(a, M, w, N, row_bytes, out, ldo, store);
    case Q5_0: return gemm_t<Q5_0>(a, M, w, N, row_bytes, out, ldo, store);
    case Q8_0: return gemm_t<Q8_0>(a, M, w, N, row_bytes, out, ldo, store);
    case Q4_K: return gemm_t<Q4_K>(a, M, w, N, row_bytes, out, ldo, store);
    case Q5_K: return gemm_t<Q5_K>(a, M, w, N, row_bytes, out, ldo, store);
    case Q6_K: return gemm_t<Q6_K>(a, M, w, N, row_bytes, out, ldo, store);
    case Q4_G: return gemm_t<Q4_G>(a, M, w, N, row_bytes, out, ldo, store);
  }
  TORCH_CHECK(false, "quant_gemm: unknown format ", fmt);
}

}  // namespace flatserve::qvnni
#endif
