// AVX-512 pieces of the CPU decode attention (flatserve/attention/csrc/paged_decode_cpu.cpp) for
// bf16 caches: the scores on vdpbf16ps, their 4 x 4 reduction, and P V with V widened by one
// shift and one mask. Here so that the kernel's source stays within its size budget; only that
// kernel includes it.
#pragma once

#include <cstdint>

#include <c10/util/BFloat16.h>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace flatserve::decode {

#if defined(__AVX512BF16__)
// Sums of 16 vectors in one: 45 shuffles and adds against 16 horizontal reductions (~10
// dependent instructions each, every 4 keys x 4 heads). Lane l holds the sum of v[kPerm[l]]
// (scores_bf16's table).
inline __m512 reduce16(const __m512* v) {
  __m512 r[8], s[4], u[2];
  for (int i = 0; i < 8; ++i)  // 256-bit halves: v[i]'s partial sums low, v[i + 8]'s high
    r[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[i], v[i + 8], 0x44),
                         _mm512_shuffle_f32x4(v[i], v[i + 8], 0xEE));
  for (int i = 0; i < 4; ++i)  // 128-bit quarters
    s[i] = _mm512_add_ps(_mm512_shuffle_f32x4(r[i], r[i + 4], 0x88),
                         _mm512_shuffle_f32x4(r[i], r[i + 4], 0xDD));
  for (int i = 0; i < 2; ++i)  // pairs within quarters
    u[i] = _mm512_add_ps(_mm512_shuffle_ps(s[i], s[i + 2], 0x44), _mm512_shuffle_ps(s[i], s[i + 2], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_ps(u[0], u[1], 0x88), _mm512_shuffle_ps(u[0], u[1], 0xDD));
}

inline __m128 extract4(__m512 r, int j) {
  switch (j) {
    case 0: return _mm512_extractf32x4_ps(r, 0);
    case 1: return _mm512_extractf32x4_ps(r, 1);
    case 2: return _mm512_extractf32x4_ps(r, 2);
    default: return _mm512_extractf32x4_ps(r, 3);
  }
}

// bf16 caches on CPUs with AVX512-BF16: vdpbf16ps multiplies bf16 pairs straight from the
// cache and accumulates in fp32 (32 elements per instruction, no conversion of K), the
// products exact in fp32 as in the generic path; only the order of the fp32 sums differs.
template <int G, int NK>
inline void scores_bf16(const c10::BFloat16* q, const c10::BFloat16* k, int64_t rs, int64_t d,
                        float* sc, int64_t bs) {
  __m512 s[NK][G];
  for (int i = 0; i < NK; ++i)
    for (int j = 0; j < G; ++j) s[i][j] = _mm512_setzero_ps();
  for (int64_t c = 0; c < d; c += 32) {
    __m512bh kv[NK];
    for (int i = 0; i < NK; ++i) kv[i] = (__m512bh)_mm512_loadu_si512(k + i * rs + c);
    for (int j = 0; j < G; ++j) {
      const __m512bh qj = (__m512bh)_mm512_loadu_si512(q + j * d + c);
      for (int i = 0; i < NK; ++i) s[i][j] = _mm512_dpbf16_ps(s[i][j], qj, kv[i]);
    }
  }
  if constexpr (NK == 4 && G == 4) {
    // Lane l of reduce16's result sums input kPerm[l]; feeding s[i][j] as input kPerm[4j + i]
    // puts head j's four scores in lanes 4j..4j+3.
    constexpr int kPerm[16] = {0, 2, 1, 3, 8, 10, 9, 11, 4, 6, 5, 7, 12, 14, 13, 15};
    __m512 in[16];
    for (int l = 0; l < 16; ++l) in[kPerm[l]] = s[l % 4][l / 4];
    const __m512 r = reduce16(in);
    for (int j = 0; j < 4; ++j) _mm_storeu_ps(sc + j * bs, extract4(r, j));
  } else {
    for (int i = 0; i < NK; ++i)
      for (int j = 0; j < G; ++j) sc[j * bs + i] = _mm512_reduce_add_ps(s[i][j]);
  }
}
#endif

#if defined(__AVX512BF16__)
// acc [d] in split_acc_index's order (per 32 dims: the 16 even dims, then the 16 odd ones)
// times f -> d bf16 in dim order, rounded to nearest even as c10's conversion is (for normal
// values: the instruction treats subnormal inputs as zero). One conversion and one word
// permute per 32 values against 32 scalar conversions.
inline void store_split_bf16(const float* acc, float f, int64_t d, uint16_t* o) {
  alignas(64) static constexpr int16_t kIdx[32] = {0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23,
                                                   8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31};
  const __m512i idx = _mm512_load_si512(kIdx);
  const __m512 fv = _mm512_set1_ps(f);
  for (int64_t c = 0; c < d; c += 32) {
    const __m512 ev = _mm512_mul_ps(_mm512_loadu_ps(acc + c), fv);
    const __m512 od = _mm512_mul_ps(_mm512_loadu_ps(acc + c + 16), fv);
    const __m512i w = (__m512i)_mm512_cvtne2ps_pbh(od, ev);  // words 0-15 even dims, 16-31 odd
    _mm512_storeu_si512(o + c, _mm512_permutexvar_epi16(idx, w));
  }
}
#endif

// Where dim e of a head sits in pv_bf16_split's accumulators: per 32 dims, the 16 even dims,
// then the 16 odd ones. Plain integer maths, so at every ISA level (the kernel's generic
// output loop names it even where no level of its own uses that order).
inline int64_t split_acc_index(int64_t e) { return (e & ~int64_t{31}) + (e & 1) * 16 + (e & 31) / 2; }

#if defined(__AVX512F__)
// bf16 P V with V widened 32 values at a time by one shift (even elements) and one mask (odd
// ones), against a zero-extend and a shift per 16: the accumulators of each 32-dim chunk hold
// its even dims, then its odd ones (split_acc_index). For G <= 4 the same products in the same
// order of sums as the generic loop, so the same bits; G = 8 sums its keys in one chain.

template <int G>
inline void pv_bf16_split(const uint16_t* vb, int64_t rs, int64_t t0, int64_t t1, int64_t d,
                          int64_t bs, const float* corr, float* acc, const float* sc) {
  const __m512i hi = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  auto even = [](__m512i w) { return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16)); };
  auto odd = [&](__m512i w) { return _mm512_castsi512_ps(_mm512_and_si512(w, hi)); };
  for (int64_t c = 0; c < d; c += 32) {
    __m512 ae[G], ao[G], be[G], bo[G];
    for (int j = 0; j < G; ++j) {
      const __m512 cj = _mm512_set1_ps(corr[j]);
      ae[j] = _mm512_mul_ps(_mm512_loadu_ps(acc + j * d + c), cj);
      ao[j] = _mm512_mul_ps(_mm512_loadu_ps(acc + j * d + c + 16), cj);
      be[j] = bo[j] = _mm512_setzero_ps();
    }
    int64_t i = t0;
    // G = 8 (packed rows): one accumulator pair per head, the registers hold no more.
    for (; G <= 4 && i + 2 <= t1; i += 2) {
      const __m512i w0 = _mm512_loadu_si512(vb + i * rs + c);
      const __m512i w1 = _mm512_loadu_si512(vb + (i + 1) * rs + c);
      const __m512 e0 = even(w0), o0 = odd(w0), e1 = even(w1), o1 = odd(w1);
      for (int j = 0; j < G; ++j) {
        const __m512 p0 = _mm512_set1_ps(sc[j * bs + i]), p1 = _mm512_set1_ps(sc[j * bs + i + 1]);
        ae[j] = _mm512_fmadd_ps(p0, e0, ae[j]); ao[j] = _mm512_fmadd_ps(p0, o0, ao[j]);
        be[j] = _mm512_fmadd_ps(p1, e1, be[j]); bo[j] = _mm512_fmadd_ps(p1, o1, bo[j]);
      }
    }
    for (; i < t1; ++i) {
      const __m512i w0 = _mm512_loadu_si512(vb + i * rs + c);
      const __m512 e0 = even(w0), o0 = odd(w0);
      for (int j = 0; j < G; ++j) {
        const __m512 p0 = _mm512_set1_ps(sc[j * bs + i]);
        ae[j] = _mm512_fmadd_ps(p0, e0, ae[j]); ao[j] = _mm512_fmadd_ps(p0, o0, ao[j]);
      }
    }
    for (int j = 0; j < G; ++j) {
      _mm512_storeu_ps(acc + j * d + c, _mm512_add_ps(ae[j], be[j]));
      _mm512_storeu_ps(acc + j * d + c + 16, _mm512_add_ps(ao[j], bo[j]));
    }
  }
}
#endif

}  // namespace flatserve::decode
