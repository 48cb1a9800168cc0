// Decode-sized calls of the quantized GEMM (ops/csrc/quant_gemm_cpu.cpp): each weight row's
// stored blocks read straight into registers (DirectRow), no unpack buffer. Two users:
//
// - the AVX2 vector path (1-4 activation rows; the avx2 and avx512 levels), in that file;
// - at the amx level, `rows16` below: 16 weight rows at a time in AVX-512 lanes, computing the
//   AMX tiles' bits (csrc/quant_amx.h) for any format, so a call takes the tiles or this path
//   by row count alone and a row's result never depends on its call.
#pragma once

#include "quant_blocks.h"

#if QG_AVX2
#include <cmath>
#include <cstdint>
#include <cstring>

namespace flatserve::qblocks {

// Why no buffer: it pays off only when many activation rows reuse the unpacked row, and its store
// and reload cost more than the dots at 2 rows (the default model's 4096 x 640 q5_0 gate_up at
// one decode row: 0.48 ms, 3.8 GB/s of weights). The values and scales are unpack_block's. The
// format is a template argument: its branches and block arithmetic fold at compile time (as a
// run-time value they cost the 4 x 640 q8_0 rows 96 -> 52 us at one thread).
template <int fmt>
struct DirectRow {
  static constexpr Layout L = known_layout(fmt);
  const uint8_t* row;
  float* mn;     // [K/32]: the row's 32-value offsets (0 but for Q4_K/Q5_K), for the mins term
  float sc[16];  // the current super-block's 16-value scales (K formats)

  // A 32-value block's codes (values 0-31 in order), its scale apart (the first two bytes).
  __attribute__((always_inline)) static inline __m256i codes32(const uint8_t* blk) {
    static_assert(L.block == 32);
    if constexpr (fmt == Q8_0) return ld(blk + 2);
    if constexpr (fmt == Q4_G) return _mm256_sub_epi8(nibbles_32(blk + 3), _mm256_set1_epi8(static_cast<char>(blk[2])));
    __m256i q = nibbles_32(blk + (fmt == Q4_0 ? 2 : 6));
    if constexpr (fmt == Q5_0) {
      uint32_t qh;
      std::memcpy(&qh, blk + 2, 4);
#if defined(__AVX512BW__) && defined(__AVX512VL__)  // bit i -> byte i: one masked broadcast
      q = _mm256_or_si256(q, _mm256_maskz_set1_epi8(static_cast<__mmask32>(qh), 0x10));
#else
      q = _mm256_or_si256(q, bits_to_0x10(qh));
#endif
    }
    return _mm256_sub_epi8(q, _mm256_set1_epi8(fmt == Q4_0 ? 8 : 16));
  }

  // Block b (32 values) -> its codes (values 0-31 in order) and the scales of its two halves.
  __attribute__((always_inline)) inline void get(int64_t b, __m256i& wv, float& s0, float& s1) {
    if constexpr (L.block == 32) {
      const uint8_t* blk = row + b * L.type_size;
      s0 = s1 = h2f(blk);
      wv = codes32(blk);
      return;
    } else {
    const int64_t c = b & 7;
    const uint8_t* sb = row + (b >> 3) * L.type_size;
    const __m256i m4 = _mm256_set1_epi8(0x0F);
    if constexpr (fmt == Q6_K) {
      if (c == 0) {
        const float d = h2f(sb + 208);
        const int8_t* scales = reinterpret_cast<const int8_t*>(sb + 192);
        for (int i = 0; i < 16; ++i) sc[i] = d * static_cast<float>(scales[i]);
      }
      const int64_t half = c / 4, p = c % 4;
      const __m256i l = ld(sb + 64 * half + 32 * (p % 2)), h = ld(sb + 128 + 32 * half);
      const __m256i lo = p < 2 ? _mm256_and_si256(l, m4) : _mm256_and_si256(_mm256_srli_epi16(l, 4), m4);
      const __m256i hi = _mm256_slli_epi16(_mm256_and_si256(_mm256_srli_epi16(h, static_cast<int>(2 * p)),
                                                            _mm256_set1_epi8(3)), 4);
      wv = _mm256_sub_epi8(_mm256_or_si256(lo, hi), _mm256_set1_epi8(32));
      s0 = sc[2 * c], s1 = sc[2 * c + 1];
      mn[b] = 0.f;
      return;
    }
    if (c == 0) {  // Q4_K / Q5_K
      uint8_t sv[8], mv[8];
      k_scales(sb + 4, sv, mv);
      auto f8 = [](const uint8_t* p) {
        return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
      };  // d * s exactly as the scalar product: one rounding
      _mm256_storeu_ps(sc, _mm256_mul_ps(_mm256_set1_ps(h2f(sb)), f8(sv)));
      _mm256_storeu_ps(mn + b, _mm256_mul_ps(_mm256_set1_ps(h2f(sb + 2)), f8(mv)));
    }
    const __m256i q = ld(sb + (fmt == Q4_K ? 16 : 48) + 32 * (c / 2));
    __m256i v = c % 2 ? _mm256_and_si256(_mm256_srli_epi16(q, 4), m4) : _mm256_and_si256(q, m4);
    if constexpr (fmt == Q5_K) {
      const __m256i bit = _mm256_set1_epi8(static_cast<char>(1 << c));
      v = _mm256_or_si256(v, _mm256_and_si256(_mm256_cmpeq_epi8(_mm256_and_si256(ld(sb + 16), bit), bit),
                                              _mm256_set1_epi8(0x10)));
    }
    wv = v;
    s0 = s1 = sc[c];
    }
  }
};

#if defined(__AVX512BW__)
// Sixteen int32 vectors -> lane r: the sum of v[r]'s lanes 0-7 (h0) and 8-15 (h1), in 45
// shuffles and adds (pairs interleaved per 32 bits, then 64, then 128-bit chunks). With v[r]
// the vpmaddwd of a block's 32 codes in value order, h0 and h1 are its two 16-value halves.
inline void sum16(const __m512i v[16], __m512i& h0, __m512i& h1) {
  __m512i a[8], c[4];
  for (int i = 0; i < 8; ++i)  // per 128 bits: rows 2i, 2i+1, 2i, 2i+1
    a[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
  for (int k = 0; k < 4; ++k)  // per 128 bits: rows 4k .. 4k+3
    c[k] = _mm512_add_epi32(_mm512_unpacklo_epi64(a[2 * k], a[2 * k + 1]), _mm512_unpackhi_epi64(a[2 * k], a[2 * k + 1]));
  // chunk j of c[k] covers lanes 4j..4j+3 of rows 4k..4k+3: halves are chunks 0+1 and 2+3
  const __m512i z01 = _mm512_add_epi32(_mm512_shuffle_i32x4(c[0], c[1], 0x88), _mm512_shuffle_i32x4(c[0], c[1], 0xDD));
  const __m512i z23 = _mm512_add_epi32(_mm512_shuffle_i32x4(c[2], c[3], 0x88), _mm512_shuffle_i32x4(c[2], c[3], 0xDD));
  h0 = _mm512_shuffle_i32x4(z01, z23, 0x88);
  h1 = _mm512_shuffle_i32x4(z01, z23, 0xDD);
}

// MS (1-4) activation rows against 16 weight rows: acc[t] lane r = out[row t, weight row r].
// xn[t]: row t's codes in value order (not ACT_ORDER), xd / xs its scales and scaled sums per
// block. Per result, in this order, as the tiles' group_dot (quant_amx.h):
//   acc = fma(float(S) * w_scale, x_scale, acc)   per block (Q6_K: per half block)
//   acc = fma(-w_min, x_sum, acc)                 K formats, after each block
// S, the block's integer dot, is exact in any order of summation; the rest is the same operations
// on the same operands, so the same bits. Per 16 rows and block: 16 widenings and vpmaddwd per
// activation row, one 45-op reduction, 3 scaling ops, where the AVX2 path spends ~12 ops per row.
template <int fmt, int MS>
inline void rows16(DirectRow<fmt> (&dr)[16], const int16_t* const xn[MS], const float* const xd[MS],
                   const float* const xs[MS], int64_t nb, __m512 acc[MS]) {
  constexpr bool halves = fmt == Q6_K, mins = known_layout(fmt).mins;
  alignas(64) float s0[16], s1[16], mn[16];
  for (int t = 0; t < MS; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    __m512i wv[16];
    for (int r = 0; r < 16; ++r) {
      __m256i c;
      dr[r].get(b, c, s0[r], s1[r]);
      wv[r] = _mm512_cvtepi8_epi16(c);
      if constexpr (mins) mn[r] = dr[r].mn[b];
    }
    const __m512 sc0 = _mm512_load_ps(s0), sc1 = _mm512_load_ps(s1);
    for (int t = 0; t < MS; ++t) {
      const __m512i x = _mm512_loadu_si512(xn[t] + 32 * b);
      __m512i p[16];
      for (int r = 0; r < 16; ++r) p[r] = _mm512_madd_epi16(wv[r], x);
      __m512i h0, h1;
      sum16(p, h0, h1);
      const __m512 d = _mm512_set1_ps(xd[t][b]);
      if constexpr (halves) {
        acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(h0), sc0), d, acc[t]);
        acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(h1), sc1), d, acc[t]);
      } else {
        acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(h0, h1)), sc0), d, acc[t]);
      }
      if constexpr (mins)
        acc[t] = _mm512_fmadd_ps(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_load_ps(mn)), _mm512_set1_ps(xs[t][b]), acc[t]);
    }
  }
}

#if defined(__AVX512VNNI__)
// The 32-value formats (Q4_0, Q5_0, Q8_0, Q4_G) in rows16's bits with VNNI byte dots: each int16
// activation code x (|x| <= 32639, quantize_act) is split as x = 256 xh + xl, both signed bytes,
// and a block's 64 bytes hold [xl of values 0-31 | xh of values 0-31] (XV below). The weight
// codes go in as unsigned bytes, in the same places, twice: [0-15, 16-31, 0-15, 16-31]. One
// vpdpbusd per row and block then leaves xl . q in lanes 0-7 and xh . q in lanes 8-15, sum16
// adds each half, and S = h0 + 256 h1 - off * sum(x): the block's exact integer dot, as the
// tiles' and rows16's (so the same bits). Against rows16 per 16 rows and block: no sign
// extension (a port-5 shuffle per row), the scales by one gather instead of 16 scalar loads,
// conversions and stores, the nibbles unpacked from a broadcast load by shifts and masks.
// |S| parts: 256 * 32 * 255 * 128 + 128 * 32 * 32639 < 2^31.
template <int fmt>
__attribute__((always_inline)) inline __m512i vnni_codes(const uint8_t* blk) {
  if constexpr (fmt == Q8_0) {  // q + 128: unsigned, the offset taken back as 128 * sum(x)
    const __m512i q = _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(blk + 2)));
    return _mm512_xor_si512(q, _mm512_set1_epi8(static_cast<char>(0x80)));
  } else {
    const uint8_t* qs = blk + (fmt == Q4_0 ? 2 : fmt == Q5_0 ? 6 : 3);
    const __m512i q = _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(qs)));
    // chunks 1 and 3 take the high nibbles (values 16-31)
    __m512i v = _mm512_and_si512(_mm512_srlv_epi64(q, _mm512_set_epi64(4, 4, 0, 0, 4, 4, 0, 0)),
                                 _mm512_set1_epi8(0x0F));
    if constexpr (fmt == Q5_0) {  // fifth bits: bit i of qh -> value i, in both copies
      uint32_t qh;
      std::memcpy(&qh, blk + 2, 4);
      v = _mm512_mask_add_epi8(v, _cvtu64_mask64(qh | (static_cast<uint64_t>(qh) << 32)), v,
                               _mm512_set1_epi8(0x10));
    }
    return v;
  }
}

// Activation row codes (ACT_ORDER, [K]) -> XV [nb][64] bytes and the blocks' code sums [nb].
inline void vnni_acts(const int16_t* q, int64_t nb, int8_t* xv, int32_t* xsum) {
  for (int64_t b = 0; b < nb; ++b) {
    int32_t sum = 0;
    for (int pos = 0; pos < 32; ++pos) {
      const int32_t x = q[32 * b + pos], l = act_value(pos);
      const int32_t lo = static_cast<int8_t>(x & 0xFF);
      xv[64 * b + l] = static_cast<int8_t>(lo);
      xv[64 * b + 32 + l] = static_cast<int8_t>((x - lo) >> 8);
      sum += x;
    }
    xsum[b] = sum;
  }
}

// MS (1-4) activation rows against 16 weight rows (rows[r]: row r's first block) -> acc[t] lane r.
template <int fmt, int MS>
inline void rows16_b32(const uint8_t* const rows[16], const int8_t* const xv[MS], const int32_t* const xsum[MS],
                       const float* const xd[MS], int64_t nb, __m512 acc[MS]) {
  constexpr int64_t ts = known_layout(fmt).type_size;
  constexpr int off = fmt == Q4_0 ? 8 : fmt == Q5_0 ? 16 : fmt == Q8_0 ? 128 : 0;  // Q4_G: its zero
  alignas(64) int32_t o[16];
  for (int r = 0; r < 16; ++r) o[r] = static_cast<int32_t>(rows[r] - rows[0]);
  const __m512i offs = _mm512_load_si512(o);
  for (int t = 0; t < MS; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* base = rows[0] + b * ts;
    // each block opens with its fp16 scale (Q4_G: then its zero point byte)
    const __m512i g = _mm512_i32gather_epi32(offs, base, 1);
    const __m512 sc = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g));
    __m512i wv[16];
    for (int r = 0; r < 16; ++r) wv[r] = vnni_codes<fmt>(base + o[r]);
    for (int t = 0; t < MS; ++t) {
      const __m512i x = _mm512_loadu_si512(xv[t] + 64 * b);
      __m512i p[16];
      for (int r = 0; r < 16; ++r) p[r] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[r], x);
      __m512i h0, h1;
      sum16(p, h0, h1);
      __m512i S = _mm512_add_epi32(h0, _mm512_slli_epi32(h1, 8));
      if constexpr (fmt == Q4_G)
        S = _mm512_sub_epi32(S, _mm512_mullo_epi32(_mm512_and_si512(_mm512_srli_epi32(g, 16), _mm512_set1_epi32(0xFF)),
                                                   _mm512_set1_epi32(xsum[t][b])));
      else
        S = _mm512_sub_epi32(S, _mm512_set1_epi32(off * xsum[t][b]));
      acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(S), sc), _mm512_set1_ps(xd[t][b]), acc[t]);
    }
  }
}
#endif

// rows16's (and the tiles') result for one activation row (codes xq [K] in ACT_ORDER, scales xd,
// xs [nb]) and one weight row, in their order of float operations (the integer block sums are
// exact in any order): the greedy head's rescoring, which must give the bits the full head's GEMM
// gives.
inline float exact(const Unpacked& u, bool halves, bool mins, const int16_t* xq, const float* xd,
                   const float* xs, int64_t nb) {
  float acc = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    const int8_t* v = u.raw ? reinterpret_cast<const int8_t*>(u.raw + 34 * b + 2) : u.v + 32 * b;
    for (int h = 0; h < (halves ? 2 : 1); ++h) {
      int32_t S = 0;
      if (!halves) {  // the greedy head's candidates (~3k a token): the block's 32 products at once
        // codes in ACT_ORDER (8-byte groups 0, 2, 1, 3) against the stored codes; integer: exact
        const __m256i wv = _mm256_permute4x64_epi64(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(v)), 0xD8);
        S = _mm512_reduce_add_epi32(_mm512_madd_epi16(_mm512_cvtepi8_epi16(wv),
                                                      _mm512_loadu_si512(xq + 32 * b)));
      } else {
        for (int l = 16 * h; l < 16 * h + 16; ++l) S += int32_t(v[l]) * xq[32 * b + act_value(l)];
      }
      const float scale = u.raw ? h2f(u.raw + 34 * b) : u.sc[2 * b + h];
      acc = std::fma(static_cast<float>(S) * scale, xd[b], acc);
    }
    if (mins) acc = std::fma(-u.mn[b], xs[b], acc);
  }
  return acc;
}

#endif

}  // namespace flatserve::qblocks
#endif
