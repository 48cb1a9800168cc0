// GGUF block formats unpacked into the quantized GEMM's common form (ops/csrc/quant_gemm_cpu.cpp
// says what the form is and why): the layouts, fp16 scales, and one stored block or row -> its
// int8 codes, 16-value scales and 32-value offsets; and the activations' int16 block codes. Only
// that file and the quantized kernels' headers (quant_*.h, greedy_q4.h) include it.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

#include "cpu_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#define QG_AVX2 1
#else
#define QG_AVX2 0
#if defined(__SSE2__)
#include <emmintrin.h>
#endif
#endif


namespace flatserve::qblocks {

// GGML type ids; Q4_G (100) is ours: d f16 | zero u8 | 16 nibble bytes, x = d * (q - zero) (GPTQ/AWQ).
enum Fmt : int { Q4_0 = 2, Q5_0 = 6, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, Q4_G = 100 };

struct Layout { int block, type_size; bool mins; };

// Stored position -> value index within a 32-value block of activation codes (ACT_ORDER, its own
// inverse; ops/csrc/quant_gemm_cpu.cpp says why).
constexpr int act_value(int pos) { return pos < 8 || pos >= 24 ? pos : pos < 16 ? pos + 8 : pos - 8; }

// One block's two 16-value dots, weight codes v (values in order) against x's codes (ACT_ORDER:
// values 0-15 at positions 0-7 and 16-23, values 16-31 at 8-15 and 24-31). Integer sums: any
// order gives the same s0, s1. A per-value gather through act_value stayed scalar (112 ms a
// one-request step on x86-64's SSE2 baseline, 2-core Zen 5; 61 with these runs as plain loops,
// which GCC 12 still left scalar; SSE2's pmaddwd below).
inline void dot_block(const int8_t* v, const int16_t* x, int32_t& s0, int32_t& s1) {
#if defined(__SSE2__)
  const __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(v));       // values 0-15
  const __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(v + 16));  // values 16-31
  auto wide = [](__m128i b, bool high) {  // 8 signed bytes -> int16: each byte doubled, shifted down
    return _mm_srai_epi16(high ? _mm_unpackhi_epi8(b, b) : _mm_unpacklo_epi8(b, b), 8);
  };
  auto xl = [&](int p) { return _mm_loadu_si128(reinterpret_cast<const __m128i*>(x + p)); };
  const __m128i a = _mm_add_epi32(_mm_madd_epi16(wide(lo, false), xl(0)), _mm_madd_epi16(wide(lo, true), xl(16)));
  const __m128i c = _mm_add_epi32(_mm_madd_epi16(wide(hi, false), xl(8)), _mm_madd_epi16(wide(hi, true), xl(24)));
  const __m128i t = _mm_add_epi32(_mm_unpacklo_epi32(a, c), _mm_unpackhi_epi32(a, c));  // a0+a2 c0+c2 a1+a3 c1+c3
  const __m128i u = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));                      // sum(a) sum(c) ..
  s0 = _mm_cvtsi128_si32(u);
  s1 = _mm_cvtsi128_si32(_mm_shuffle_epi32(u, 0x55));
#else
  s0 = s1 = 0;
  for (int i = 0; i < 8; ++i) s0 += int32_t(v[i]) * x[i] + int32_t(v[8 + i]) * x[16 + i];
  for (int i = 0; i < 8; ++i) s1 += int32_t(v[16 + i]) * x[8 + i] + int32_t(v[24 + i]) * x[24 + i];
#endif
}

constexpr Layout known_layout(int fmt) {  // {0, 0, false} for an unknown format
  switch (fmt) {
    case Q4_0: return {32, 18, false};
    case Q5_0: return {32, 22, false};
    case Q8_0: return {32, 34, false};
    case Q4_K: return {256, 144, true};
    case Q5_K: return {256, 176, true};
    case Q6_K: return {256, 210, false};
    case Q4_G: return {32, 19, false};
  }
  return {0, 0, false};
}

// A call's activation rows in groups of 16 (the last zero-padded), as the tile layouts take them
// (csrc/quant_amx.h, csrc/quant_vnni.h): per group and block the rows' scales and scaled sums
// [16]; the codes in each layout's own form, written by fill's put(i, t, xq): row t of
// group-block i = g * nb + b has the 32 codes xq (ACT_ORDER).
struct ActGroups {
  int64_t groups = 0, nb = 0;
  std::vector<float> d, s;
  const float* d_at(int64_t g, int64_t b) const { return d.data() + (g * nb + b) * 16; }
  const float* s_at(int64_t g, int64_t b) const { return s.data() + (g * nb + b) * 16; }

  void shape(int64_t M, int64_t K) {  // then size the codes for groups * nb group-blocks
    nb = K / 32, groups = (M + 15) / 16;
    d.assign(groups * nb * 16, 0.f);
    s.assign(groups * nb * 16, 0.f);
  }
  template <typename Put>
  void fill(const int16_t* q, const float* dq, const float* sq, int64_t M, Put put) {
    at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
      for (int64_t m = m0; m < m1; ++m)
        for (int64_t b = 0; b < nb; ++b) {
          const int64_t i = (m / 16) * nb + b, t = m % 16;
          put(i, t, q + (m * nb + b) * 32);
          d[i * 16 + t] = dq[m * nb + b];
          s[i * 16 + t] = sq[m * nb + b];
        }
    });
  }
};

// One call's activation rows in groups of 16 (ActGroups) for the tiles in VNNI lanes (csrc/quant_vnni.h,
// csrc/quant_tiles_ymm.h): per group and block the codes [16 pairs][16 rows][2].
struct ActPairs : ActGroups {
  std::vector<int16_t> x;
  const int16_t* x_at(int64_t g, int64_t b) const { return x.data() + (g * nb + b) * 512; }
};

// A group-block's codes are the transpose of its 16 rows' blocks read as 16 pairs (32-bit words)
// each: in ACT_ORDER word w holds pair w, w + 4, w - 4, w for w in 0-3, 4-7, 8-11, 12-15. With AVX2
// that is four 8 x 8 transposes of words (the scalar gather per value took ~8% of a q5_0 1,024 x
// 640 call at 512 rows, `perf record`, 2-core Zen 5, 2026-11-29). The same codes either way.
inline void act_pairs(const int16_t* q, const float* d, const float* s, int64_t M, int64_t K, ActPairs& a) {
  a.shape(M, K);
  a.x.assign(a.groups * a.nb * 512, 0);
#if defined(__AVX2__)
  a.fill(q, d, s, M, [](int64_t, int64_t, const int16_t*) {});  // the scales and sums
  const int64_t nb = a.nb;
  at::parallel_for(0, a.groups, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g)
      for (int64_t t0 = 0; t0 < 16 && 16 * g + t0 < M; t0 += 8)
        for (int64_t b = 0; b < nb; ++b)
          for (int h = 0; h < 2; ++h) {  // words 0-7, then 8-15
            __m256 v[8];
            for (int i = 0; i < 8; ++i) {
              const int64_t m = 16 * g + t0 + i;
              v[i] = m < M ? _mm256_loadu_ps(reinterpret_cast<const float*>(q + (m * nb + b) * 32 + 16 * h))
                           : _mm256_setzero_ps();
            }
            flatserve::transpose8x8(v);  // v[i]: word 8 h + i of rows t0 ..
            int16_t* dst = a.x.data() + (g * nb + b) * 512 + 2 * t0;
            for (int i = 0; i < 8; ++i) _mm256_storeu_ps(reinterpret_cast<float*>(dst + ((i < 4 ? i : i + 4) + 4 * h) * 32), v[i]);
          }
  });
#else
  a.fill(q, d, s, M, [&](int64_t i, int64_t t, const int16_t* xq) {
    int16_t* dst = a.x.data() + i * 512 + 2 * t;
    for (int l = 0; l < 32; ++l) dst[(l / 2) * 32 + l % 2] = xq[act_value(l)];  // value l: pair l / 2
  });
#endif
}

#if QG_AVX2
// rows16 and the VNNI tiles read 16 weight rows at a time, block by block: 16 streams, which the
// hardware prefetchers of a 2-core Zen 4 did not keep up with where the weights came from memory
// (the 171 MB Q8_0 LM head, and every layer's linears after the head has evicted them). So the next
// 16 rows' bytes are requested into L2 a few lines per block while these compute (all at once,
// the requests queued behind full miss buffers and stalled the loop: 12% of the VNNI tiles' head
// time at 16 rows). Measured in quant_gemm_cpu.cpp (stream_bytes).
struct Prefetch {
  const char* p = nullptr;
  const char* end = nullptr;
  int64_t per_step = 0;
  // bytes [p, p + n) over `steps` calls of step()
  void spread(const uint8_t* from, int64_t n, int64_t steps) {
    p = reinterpret_cast<const char*>(from), end = p + n;
    per_step = (n / 64 + steps - 1) / steps + 1;
  }
  __attribute__((always_inline)) inline void step() {
    for (int64_t i = 0; i < per_step && p < end; ++i, p += 64) _mm_prefetch(p, _MM_HINT_T1);
  }
};
#endif

// f(std::integral_constant<int, F>{}) for the format F = fmt: a kernel templated on the format,
// chosen at run time.
template <typename Fn>
inline void by_format(int fmt, Fn&& f) {
  switch (fmt) {
    case Q4_0: return f(std::integral_constant<int, Q4_0>{});
    case Q5_0: return f(std::integral_constant<int, Q5_0>{});
    case Q8_0: return f(std::integral_constant<int, Q8_0>{});
    case Q4_K: return f(std::integral_constant<int, Q4_K>{});
    case Q5_K: return f(std::integral_constant<int, Q5_K>{});
    case Q6_K: return f(std::integral_constant<int, Q6_K>{});
    case Q4_G: return f(std::integral_constant<int, Q4_G>{});
  }
  TORCH_CHECK(false, "quant_gemm: unknown format ", fmt);
}

inline Layout layout(int fmt) {
  const Layout L = known_layout(fmt);
  TORCH_CHECK(L.block > 0, "quant_gemm: unknown format ", fmt);
  return L;
}

inline float h2f(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
#if QG_AVX2
  return _cvtsh_ss(h);
#else
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: renormalise
      int e = -1;
      uint32_t m = man;
      do { ++e; m <<= 1; } while (!(m & 0x400));
      bits = sign | ((112 - e) << 23) | ((m & 0x3FF) << 13);
    }
  } else if (exp == 31) {
    bits = sign | 0x7F800000u | (man << 13);
  } else {
    bits = sign | ((exp + 112) << 23) | (man << 13);
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
#endif
}

// Q4_K / Q5_K: 8 six-bit scales and mins packed in 12 bytes.
inline void k_scales(const uint8_t* s, uint8_t* sc, uint8_t* mn) {
  for (int j = 0; j < 4; ++j) {
    sc[j] = s[j] & 63;
    mn[j] = s[j + 4] & 63;
    sc[j + 4] = (s[j + 8] & 0x0F) | ((s[j] >> 6) << 4);
    mn[j + 4] = (s[j + 8] >> 4) | ((s[j + 4] >> 6) << 4);
  }
}

#if QG_AVX2
inline __m256i nibbles_32(const uint8_t* qs) {  // 16 bytes -> 32 values: low nibbles, then high
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  const __m128i m4 = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(q, 4), m4), _mm_and_si128(q, m4));
}
inline __m256i bits_to_0x10(uint32_t bits) {  // bit i -> byte i = 0x10 or 0
  const __m256i shuf = _mm256_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1,
                                        2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3);
  const __m256i sel = _mm256_set1_epi64x(0x8040201008040201LL);
  __m256i x = _mm256_shuffle_epi8(_mm256_set1_epi32(static_cast<int>(bits)), shuf);
  x = _mm256_cmpeq_epi8(_mm256_and_si256(x, sel), sel);
  return _mm256_and_si256(x, _mm256_set1_epi8(0x10));
}
inline void st(int8_t* p, __m256i v) { _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), v); }
inline __m256i ld(const void* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }

// a . x + b . y in int32 pair sums (vpmaddwd twice and vpaddd; with AVX-VNNI the second multiply
// and the add are one vpdpwssd). The same integers either way: callers keep each lane below 2^24.
__attribute__((always_inline)) inline __m256i madd2(__m256i a, __m256i x, __m256i b, __m256i y) {
#if defined(__AVXVNNI__)
  return _mm256_dpwssd_avx_epi32(_mm256_madd_epi16(a, x), b, y);
#else
  return _mm256_add_epi32(_mm256_madd_epi16(a, x), _mm256_madd_epi16(b, y));
#endif
}
#endif

// One stored block -> its values' codes v, 16-value scales sc and 32-value offsets mn.
inline void unpack_block(const uint8_t* b, int fmt, int8_t* v, float* sc, float* mn) {
  switch (fmt) {
    case Q8_0: {
      sc[0] = sc[1] = h2f(b);
      std::memcpy(v, b + 2, 32);
      return;
    }
    case Q4_G: {  // zero points up to 16 (GPTQ's stored + 1): q - z stays within int8
      sc[0] = sc[1] = h2f(b);
      const int z = b[2];
#if QG_AVX2
      st(v, _mm256_sub_epi8(nibbles_32(b + 3), _mm256_set1_epi8(static_cast<char>(z))));
#else
      for (int j = 0; j < 16; ++j) {
        v[j] = static_cast<int8_t>((b[3 + j] & 0x0F) - z);
        v[j + 16] = static_cast<int8_t>((b[3 + j] >> 4) - z);
      }
#endif
      return;
    }
    case Q4_0:
    case Q5_0: {
      sc[0] = sc[1] = h2f(b);
      const uint8_t* qs = b + (fmt == Q4_0 ? 2 : 6);
      uint32_t qh = 0;
      if (fmt == Q5_0) std::memcpy(&qh, b + 2, 4);
#if QG_AVX2
      __m256i q = nibbles_32(qs);
      if (fmt == Q5_0) q = _mm256_or_si256(q, bits_to_0x10(qh));
      st(v, _mm256_sub_epi8(q, _mm256_set1_epi8(fmt == Q4_0 ? 8 : 16)));
#elif defined(__SSE2__)
      // the portable x86 build (SSE2): the loop below stayed scalar there (GCC 12: the per-value
      // bit shift); a one-request step's layers 26.2 -> 13.4 ms with this (2-core Zen 5 forced to
      // portable, 2026-11-29)
      const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)), m4 = _mm_set1_epi8(0x0F);
      const __m128i sel = _mm_set1_epi64x(0x8040201008040201LL), x10 = _mm_set1_epi8(0x10);
      auto bits16 = [&](uint32_t h) {  // bit i of h -> byte i = 0x10 or 0, i < 16
        const __m128i b = _mm_unpacklo_epi64(_mm_set1_epi8(static_cast<char>(h & 0xFF)),
                                             _mm_set1_epi8(static_cast<char>((h >> 8) & 0xFF)));
        return _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(b, sel), sel), x10);
      };
      const __m128i off = _mm_set1_epi8(static_cast<char>(fmt == Q4_0 ? 8 : 16));
      __m128i lo = _mm_and_si128(q, m4), hi = _mm_and_si128(_mm_srli_epi16(q, 4), m4);
      if (fmt == Q5_0) lo = _mm_or_si128(lo, bits16(qh)), hi = _mm_or_si128(hi, bits16(qh >> 16));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(v), _mm_sub_epi8(lo, off));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(v + 16), _mm_sub_epi8(hi, off));
#else
      const int off = fmt == Q4_0 ? 8 : 16;
      for (int j = 0; j < 16; ++j) {
        v[j] = static_cast<int8_t>(((qs[j] & 0x0F) | (((qh >> j) & 1) << 4)) - off);
        v[j + 16] = static_cast<int8_t>(((qs[j] >> 4) | (((qh >> (j + 16)) & 1) << 4)) - off);
      }
#endif
      return;
    }
    case Q4_K:
    case Q5_K: {
      const float d = h2f(b), dmin = h2f(b + 2);
      uint8_t s[8], m[8];
      k_scales(b + 4, s, m);
      for (int j = 0; j < 8; ++j) {
        sc[2 * j] = sc[2 * j + 1] = d * static_cast<float>(s[j]);
        mn[j] = dmin * static_cast<float>(m[j]);
      }
      const uint8_t* qh = b + 16;
      const uint8_t* qs = b + (fmt == Q4_K ? 16 : 48);
#if QG_AVX2
      const __m256i m4 = _mm256_set1_epi8(0x0F), h = ld(qh), x10 = _mm256_set1_epi8(0x10);
      for (int i = 0; i < 4; ++i) {
        const __m256i q = ld(qs + 32 * i);
        __m256i lo = _mm256_and_si256(q, m4), hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
        if (fmt == Q5_K) {  // bit j of qh[l]: bit 4 of value l of sub-block j
          const __m256i b0 = _mm256_set1_epi8(static_cast<char>(1 << (2 * i)));
          const __m256i b1 = _mm256_set1_epi8(static_cast<char>(1 << (2 * i + 1)));
          lo = _mm256_or_si256(lo, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(h, b0), b0), x10));
          hi = _mm256_or_si256(hi, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(h, b1), b1), x10));
        }
        st(v + 64 * i, lo);
        st(v + 64 * i + 32, hi);
      }
#else
      for (int i = 0; i < 4; ++i)
        for (int l = 0; l < 32; ++l) {
          int lo = qs[32 * i + l] & 0x0F, hi = qs[32 * i + l] >> 4;
          if (fmt == Q5_K) {
            lo |= ((qh[l] >> (2 * i)) & 1) << 4;
            hi |= ((qh[l] >> (2 * i + 1)) & 1) << 4;
          }
          v[64 * i + l] = static_cast<int8_t>(lo);
          v[64 * i + 32 + l] = static_cast<int8_t>(hi);
        }
#endif
      return;
    }
    case Q6_K: {
      const float d = h2f(b + 208);
      const int8_t* scales = reinterpret_cast<const int8_t*>(b + 192);
      for (int i = 0; i < 16; ++i) sc[i] = d * static_cast<float>(scales[i]);
      for (int half = 0; half < 2; ++half) {
        const uint8_t* ql = b + 64 * half;
        const uint8_t* qh = b + 128 + 32 * half;
        int8_t* o = v + 128 * half;
#if QG_AVX2
        const __m256i m4 = _mm256_set1_epi8(0x0F), m3 = _mm256_set1_epi8(3), k32 = _mm256_set1_epi8(32);
        const __m256i l0 = ld(ql), l1 = ld(ql + 32), h = ld(qh);
        auto hi2 = [&](int shift) {
          return _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, shift), m3), 4);
        };
        st(o, _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(l0, m4), hi2(0)), k32));
        st(o + 32, _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(l1, m4), hi2(2)), k32));
        st(o + 64, _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l0, 4), m4), hi2(4)), k32));
        st(o + 96, _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16(l1, 4), m4), hi2(6)), k32));
#else
        for (int l = 0; l < 32; ++l) {
          o[l] = static_cast<int8_t>(((ql[l] & 0x0F) | (((qh[l] >> 0) & 3) << 4)) - 32);
          o[l + 32] = static_cast<int8_t>(((ql[l + 32] & 0x0F) | (((qh[l] >> 2) & 3) << 4)) - 32);
          o[l + 64] = static_cast<int8_t>(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32);
          o[l + 96] = static_cast<int8_t>(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32);
        }
#endif
      }
      return;
    }
  }
}

struct Unpacked {  // one weight row in the common form
  int8_t* v;
  float* sc;
  float* mn;
  // Q8_0 rows are dotted from their stored blocks (34 bytes: f16 d, 32 codes): already the
  // common form but for the stride, and unpacking them cost a copy per block for nothing
  // (the default model's 262k-row LM head is Q8_0).
  const uint8_t* raw = nullptr;
};

inline void unpack_row(const uint8_t* src, const Layout& L, int fmt, int64_t K, Unpacked r) {
  const int64_t nb = K / L.block;
  for (int64_t i = 0; i < nb; ++i)
    unpack_block(src + i * L.type_size, fmt, r.v + i * L.block, r.sc + i * (L.block / 16),
                 r.mn + i * (L.block / 32));
}

// Activations: each 32-value block of a row quantized to int16 codes with one fp32 scale
// (quant_gemm_cpu.cpp's quantize_act, the input of every path).
// One 32-value block: int16 codes q of v (amax / 32639 per step) in ACT_ORDER, its scale and
// scaled sum.
inline void quantize_block(const float* v, int16_t* q, float* d, float* s) {
  float amax = 0.f;
  for (int l = 0; l < 32; ++l) amax = std::max(amax, std::fabs(v[l]));
  const float dd = amax / 32639.f, id = amax > 0.f ? 32639.f / amax : 0.f;
  int32_t sum = 0;
  for (int pos = 0; pos < 32; ++pos) {
    const int32_t c = static_cast<int32_t>(std::nearbyint(v[act_value(pos)] * id));
    q[pos] = static_cast<int16_t>(c);
    sum += c;
  }
  *d = dd;
  *s = dd * static_cast<float>(sum);
}

// A named, never-inlined function without FMA contraction: the attribute does not reach a
// lambda's body, and with the loop inside parallel_for's lambda the inlined copy (M <= 16 rows,
// run on the caller) and the threaded copy were compiled apart and once rounded differently: a
// row's codes depended on how many rows shared the call (a token's logits on its batch).
template <typename T>
__attribute__((optimize("fp-contract=off"), noinline))
void quantize_row(const T* x, int64_t K, int16_t* q, float* d, float* s) {
  float buf[32];
  for (int64_t b = 0; b < K / 32; ++b) {
    for (int l = 0; l < 32; ++l) buf[l] = static_cast<float>(x[32 * b + l]);
    quantize_block(buf, q + 32 * b, d + b, s + b);
  }
}

template <typename T>
void quantize_rows(const T* x, int64_t M, int64_t K, int16_t* q, float* d, float* s) {
  const int64_t nb = K / 32;
  at::parallel_for(0, M, 16, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) quantize_row(x + m * K, K, q + m * K, d + m * nb, s + m * nb);
  });
}

}  // namespace flatserve::qblocks
