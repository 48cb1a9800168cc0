// Decode-sized calls of the quantized GEMM (ops/csrc/quant_gemm_cpu.cpp), each weight row's
// stored blocks read straight into registers, no unpack buffer:
//
// - the AVX2 vector path (1-4 activation rows; at the avx512 level the formats
//   quant.ROWS16_FORMATS leaves out: none by default), one row at a time: DirectRow, through
//   which the avx2 and avxvnni levels' rows8 (csrc/quant_tiles_ymm.h) also reads its blocks;
// - at the amx level, and at the avx512 level for the formats quant.ROWS16_FORMATS names (all),
//   `rows16` (rows16_b32, rows16_k below): 16 weight rows at a time in AVX-512 lanes by VNNI
//   byte dots, computing the AMX tiles' bits (csrc/quant_amx.h) for any format, so a call takes
//   the tiles (or their VNNI form, csrc/quant_vnni.h) or this path by row count alone and a row's
//   result never depends on its call.
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

#if defined(__AVX512VNNI__)
// rows16: any format by VNNI byte dots (the amx and avx512 levels' calls of a few rows). Each int16
// activation code x (|x| <= 32639, quantize_act) is split as x = 256 xh + xl, both signed bytes,
// and a block's 64 bytes hold [xl of values 0-31 | xh of values 0-31] (vnni_acts). The weight
// codes go in as unsigned bytes in the same places, twice: [values 0-31 | values 0-31], so a
// 32-byte format (Q8_0, the K formats) is one broadcast load. One vpdpbusd per row and block
// leaves xl . q in lanes 0-7 and xh . q in lanes 8-15 (4 lanes per 16 values); sum16v weighs the
// xh lanes by 256 and adds them up per row, per block or per 16-value half. S = that - off *
// sum(x) is the block's exact integer dot, the tiles' own, so the float operations
// after it (the same ones, in the same order) give the same bits. Against the int16 vpmaddwd
// version this replaced (246651e), per 16 rows and block: no sign extension (a port-5 shuffle per
// row), the rows' scales by gathers instead of 16 scalar loads, conversions and stores, nibbles
// unpacked by shifts and masks in place. |S| <= 32 * 255 * 32639 < 2^28 before the offset, and
// the offset term 128 * 32 * 32639 < 2^28.

// Sixteen vpdpbusd results -> h0, h1 lane r: row r's sums with the xh lanes weighed by 256. The
// whole block is h0 + h1 (h0 the xl part, h1 the xh part); with halves, h0 is values 0-15 and
// h1 values 16-31. A 45-op shuffle and add tree plus four variable shifts.
template <bool halves>
inline void sum16v(const __m512i v[16], __m512i& h0, __m512i& h1) {
  __m512i a[8], c[4];
  for (int i = 0; i < 8; ++i)
    a[i] = _mm512_add_epi32(_mm512_unpacklo_epi32(v[2 * i], v[2 * i + 1]), _mm512_unpackhi_epi32(v[2 * i], v[2 * i + 1]));
  const __m512i by256 = _mm512_set_epi32(8, 8, 8, 8, 8, 8, 8, 8, 0, 0, 0, 0, 0, 0, 0, 0);  // chunks 2, 3: xh
  for (int k = 0; k < 4; ++k)  // chunk j of c[k]: rows 4k..4k+3's sums over v's chunk j
    c[k] = _mm512_sllv_epi32(
        _mm512_add_epi32(_mm512_unpacklo_epi64(a[2 * k], a[2 * k + 1]), _mm512_unpackhi_epi64(a[2 * k], a[2 * k + 1])),
        by256);
  // chunks: 0 = xl . values 0-15, 1 = xl . 16-31, 2 = xh . 0-15, 3 = xh . 16-31
  constexpr int lo = halves ? 0x44 : 0x88, hi = halves ? 0xEE : 0xDD;  // halves: 0 + 2, 1 + 3
  const __m512i z01 = _mm512_add_epi32(_mm512_shuffle_i32x4(c[0], c[1], lo), _mm512_shuffle_i32x4(c[0], c[1], hi));
  const __m512i z23 = _mm512_add_epi32(_mm512_shuffle_i32x4(c[2], c[3], lo), _mm512_shuffle_i32x4(c[2], c[3], hi));
  h0 = _mm512_shuffle_i32x4(z01, z23, 0x88);
  h1 = _mm512_shuffle_i32x4(z01, z23, 0xDD);
}

// One activation block (its 64 vnni bytes) against 16 rows' codes -> sum16v's h0, h1.
template <bool halves>
__attribute__((always_inline)) inline void dots16(const __m512i wv[16], const int8_t* xblk, __m512i& h0, __m512i& h1) {
  const __m512i x = _mm512_loadu_si512(xblk);
  __m512i p[16];
  for (int r = 0; r < 16; ++r) p[r] = _mm512_dpbusd_epi32(_mm512_setzero_si512(), wv[r], x);
  sum16v<halves>(p, h0, h1);
}

// Activation row codes (ACT_ORDER, [K]) -> their vnni bytes [nb][64] and the code sums of each
// block's two 16-value halves [nb][2].
inline void vnni_acts(const int16_t* q, int64_t nb, int8_t* xv, int32_t* xsum) {
  for (int64_t b = 0; b < nb; ++b) {
    int32_t sum[2] = {0, 0};
    for (int pos = 0; pos < 32; ++pos) {
      const int32_t x = q[32 * b + pos], l = act_value(pos);
      const int32_t lo = static_cast<int8_t>(x & 0xFF);
      xv[64 * b + l] = static_cast<int8_t>(lo);
      xv[64 * b + 32 + l] = static_cast<int8_t>((x - lo) >> 8);
      sum[l / 16] += x;
    }
    xsum[2 * b] = sum[0], xsum[2 * b + 1] = sum[1];
  }
}

inline __m512i bcast32(const uint8_t* p) {  // 32 bytes, twice: one load
  return _mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// The 32-value formats' block at blk -> its codes as unsigned bytes [0-31 | 0-31]; the offset
// S takes back is vnni_off (Q4_G: the block's zero point).
template <int fmt>
__attribute__((always_inline)) inline __m512i vnni_b32(const uint8_t* blk) {
  if constexpr (fmt == Q8_0) {  // q + 128
    return _mm512_xor_si512(bcast32(blk + 2), _mm512_set1_epi8(static_cast<char>(0x80)));
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
template <int fmt>
constexpr int vnni_off = fmt == Q4_0 ? 8 : fmt == Q5_0 ? 16 : fmt == Q8_0 ? 128 : fmt == Q6_K ? 32 : 0;

// MS (1-4) activation rows against 16 weight rows of a 32-value format (rows[r]: row r's
// first block) -> acc[t] lane r. xv, xsum: vnni_acts; xd: the rows' block scales.
template <int fmt, int MS>
inline void rows16_b32(const uint8_t* const rows[16], const int8_t* const xv[MS], const int32_t* const xsum[MS],
                       const float* const xd[MS], int64_t nb, __m512 acc[MS], Prefetch& pf) {
  constexpr int64_t ts = known_layout(fmt).type_size;
  alignas(64) int32_t o[16];
  for (int r = 0; r < 16; ++r) o[r] = static_cast<int32_t>(rows[r] - rows[0]);
  const __m512i offs = _mm512_load_si512(o);
  for (int t = 0; t < MS; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    pf.step();
    const uint8_t* base = rows[0] + b * ts;
    const __m512i g = _mm512_i32gather_epi32(offs, base, 1);  // fp16 scale (Q4_G: then its zero)
    const __m512 sc = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g));
    __m512i wv[16];
    for (int r = 0; r < 16; ++r) wv[r] = vnni_b32<fmt>(base + o[r]);
    for (int t = 0; t < MS; ++t) {
      __m512i h0, h1;
      dots16<false>(wv, xv[t] + 64 * b, h0, h1);
      const int32_t sx = xsum[t][2 * b] + xsum[t][2 * b + 1];
      __m512i S = _mm512_add_epi32(h0, h1);
      if constexpr (fmt == Q4_G)
        S = _mm512_sub_epi32(S, _mm512_mullo_epi32(_mm512_and_si512(_mm512_srli_epi32(g, 16), _mm512_set1_epi32(0xFF)),
                                                   _mm512_set1_epi32(sx)));
      else
        S = _mm512_sub_epi32(S, _mm512_set1_epi32(vnni_off<fmt> * sx));
      acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(S), sc), _mm512_set1_ps(xd[t][b]), acc[t]);
    }
  }
}

// A K format's sub-block c (0-7) of the super-block at sb -> its codes [0-31 | 0-31], unsigned.
template <int fmt>
__attribute__((always_inline)) inline __m512i vnni_k(const uint8_t* sb, int c) {
  const __m512i m4 = _mm512_set1_epi8(0x0F);
  if constexpr (fmt == Q6_K) {
    const int half = c / 4, p = c % 4;
    const __m512i l = bcast32(sb + 64 * half + 32 * (p % 2)), h = bcast32(sb + 128 + 32 * half);
    const __m512i lo = _mm512_and_si512(p < 2 ? l : _mm512_srli_epi16(l, 4), m4);
    const __m512i hi = _mm512_and_si512(_mm512_srl_epi16(h, _mm_cvtsi32_si128(2 * p)), _mm512_set1_epi8(3));
    return _mm512_or_si512(lo, _mm512_slli_epi16(hi, 4));
  } else {
    const __m512i q = bcast32(sb + (fmt == Q4_K ? 16 : 48) + 32 * (c / 2));
    __m512i v = _mm512_and_si512(c % 2 ? _mm512_srli_epi16(q, 4) : q, m4);
    if constexpr (fmt == Q5_K) {
      const __m512i bit = _mm512_and_si512(_mm512_srl_epi16(bcast32(sb + 16), _mm_cvtsi32_si128(c)), _mm512_set1_epi8(1));
      v = _mm512_or_si512(v, _mm512_slli_epi16(bit, 4));
    }
    return v;
  }
}

// The 16 rows' scales of one super-block (gathered at sb + offs), as DirectRow computes them:
// Q4_K / Q5_K sc[c] = d * s_c, mn[c] = dmin * m_c (8 each); Q6_K sc[i] = d * scales[i] (16).
template <int fmt>
inline void vnni_k_scales(const uint8_t* sb, __m512i offs, __m512 sc[16], __m512 mn[8]) {
  const __m512i m8 = _mm512_set1_epi32(0xFF);
  if constexpr (fmt == Q6_K) {
    // d is the super-block's last 2 bytes (208-209 of 210): gathered as the high half of the
    // dword at 206, so no read passes the block (the last row's would pass the weights' end)
    const __m512i gd = _mm512_srli_epi32(_mm512_i32gather_epi32(offs, sb + 206, 1), 16);
    const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(gd));
    for (int w = 0; w < 4; ++w) {
      const __m512i g = _mm512_i32gather_epi32(offs, sb + 192 + 4 * w, 1);
      for (int j = 0; j < 4; ++j)  // byte j, sign-extended
        sc[4 * w + j] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(g, 24 - 8 * j), 24)));
    }
  } else {
    const __m512i g = _mm512_i32gather_epi32(offs, sb, 1);
    const __m512 d = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(g));
    const __m512 dmin = _mm512_cvtph_ps(_mm512_cvtepi32_epi16(_mm512_srli_epi32(g, 16)));
    const __m512i s0 = _mm512_i32gather_epi32(offs, sb + 4, 1), s1 = _mm512_i32gather_epi32(offs, sb + 8, 1),
                  s2 = _mm512_i32gather_epi32(offs, sb + 12, 1);
    const __m512i m6 = _mm512_set1_epi32(63), m4 = _mm512_set1_epi32(15);
    for (int j = 0; j < 4; ++j) {  // k_scales, 16 rows at once
      const __m512i b0 = _mm512_and_si512(_mm512_srli_epi32(s0, 8 * j), m8),
                    b1 = _mm512_and_si512(_mm512_srli_epi32(s1, 8 * j), m8),
                    b2 = _mm512_and_si512(_mm512_srli_epi32(s2, 8 * j), m8);
      const __m512i sj = _mm512_and_si512(b0, m6), mj = _mm512_and_si512(b1, m6);
      const __m512i sj4 = _mm512_or_si512(_mm512_and_si512(b2, m4), _mm512_slli_epi32(_mm512_srli_epi32(b0, 6), 4));
      const __m512i mj4 = _mm512_or_si512(_mm512_srli_epi32(b2, 4), _mm512_slli_epi32(_mm512_srli_epi32(b1, 6), 4));
      sc[j] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sj)), sc[j + 4] = _mm512_mul_ps(d, _mm512_cvtepi32_ps(sj4));
      mn[j] = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(mj)), mn[j + 4] = _mm512_mul_ps(dmin, _mm512_cvtepi32_ps(mj4));
    }
  }
}

// MS (1-4) activation rows against 16 weight rows of a K format -> acc[t] lane r; xs: the
// rows' scaled block sums (the mins term).
template <int fmt, int MS>
inline void rows16_k(const uint8_t* const rows[16], const int8_t* const xv[MS], const int32_t* const xsum[MS],
                     const float* const xd[MS], const float* const xs[MS], int64_t nb, __m512 acc[MS],
                     Prefetch& pf) {
  constexpr int64_t ts = known_layout(fmt).type_size;
  constexpr bool halves = fmt == Q6_K;
  alignas(64) int32_t o[16];
  for (int r = 0; r < 16; ++r) o[r] = static_cast<int32_t>(rows[r] - rows[0]);
  const __m512i offs = _mm512_load_si512(o);
  for (int t = 0; t < MS; ++t) acc[t] = _mm512_setzero_ps();
  __m512 sc[16], mn[8];
  for (int64_t b = 0; b < nb; ++b) {
    pf.step();
    const int c = static_cast<int>(b & 7);
    const uint8_t* sb = rows[0] + (b >> 3) * ts;
    if (c == 0) vnni_k_scales<fmt>(sb, offs, sc, mn);
    __m512i wv[16];
    for (int r = 0; r < 16; ++r) wv[r] = vnni_k<fmt>(sb + o[r], c);
    for (int t = 0; t < MS; ++t) {
      __m512i h0, h1;
      dots16<halves>(wv, xv[t] + 64 * b, h0, h1);
      const __m512 d = _mm512_set1_ps(xd[t][b]);
      if constexpr (halves) {
        const __m512i S0 = _mm512_sub_epi32(h0, _mm512_set1_epi32(32 * xsum[t][2 * b]));
        const __m512i S1 = _mm512_sub_epi32(h1, _mm512_set1_epi32(32 * xsum[t][2 * b + 1]));
        acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(S0), sc[2 * c]), d, acc[t]);
        acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(S1), sc[2 * c + 1]), d, acc[t]);
      } else {
        acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(h0, h1)), sc[c]), d, acc[t]);
        acc[t] = _mm512_fmadd_ps(_mm512_sub_ps(_mm512_setzero_ps(), mn[c]), _mm512_set1_ps(xs[t][b]), acc[t]);
      }
    }
  }
}
#endif

#if defined(__AVX512BW__)
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
