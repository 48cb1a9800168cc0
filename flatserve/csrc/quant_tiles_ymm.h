// The VNNI tiles' quantized GEMM (csrc/quant_vnni.h) in 256-bit lanes, and rows8 for calls of a few
// rows: every quantized call at the avx2 and avxvnni levels (CPUs without AVX-512: AMD Zen 2/3,
// Intel client cores), with the tiles' bits, as the avx512 and amx levels' calls have them.
//
// Why: there a prompt row's linears were a dense fp32 GEMM on dequantized weights (MKL, AVX2: 8
// multiply-adds an FMA), about half of a served 16-stream run. Here `vpdpwssd` (AVX-VNNI) does 16
// int16 products an instruction, twice the FMA's; without VNNI, `vpmaddwd` + `vpaddd` do them in
// two instructions on different ports. The codes are the int16 ones generated rows already used
// (fidelity: docs/models.md). And with one set of bits at every row count, a 16-row decode step
// takes the tiles too without a token's logits depending on its batch.
//
// How: as quant_vnni.h, with the activation group's 16 rows in two ymm (rows 0-7, 8-15) instead of
// one zmm; 4 or 6 weight rows a step (RMAX: their dot chains, 2 activation vectors and a broadcast
// fill the 16 registers; the float accumulators live in L1 and are updated once a block). The float
// operations after each block's integer dot are the tiles', in their order, so a row's bits are
// those of the tiles on an AVX-512 CPU, whatever its call:
//
//   acc = fma(float(S) * w_scale, x_scale, acc)          per block (or half block), in order
//   acc = fma(-w_min, x_sum, acc)                        K formats' offsets, after each block
#pragma once

#include "cpu_math.h"
#include "quant_blocks.h"
#include "quant_rows.h"

#if QG_AVX2
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

namespace flatserve::qymm {

using namespace flatserve::qblocks;

// Weight rows a step: 6 (12 dot chains, 15 registers) with AVX-VNNI, 4 without (each vpmaddwd
// needs a register before its vpaddd). `cpu_prompt_tiles.py`, 2-core Zen 5: at avxvnni 6 rows
// took 0.95-1.0x 4 rows' time; at avx2 1.0-1.12x.
#if defined(__AVXVNNI__)
constexpr int RMAX = 6;
#else
constexpr int RMAX = 4;
#endif

// With AVX-VNNI the offsets' FMA (Q4_K, Q5_K) follows the scale's on the same registers, as
// fnmadd (the same rounding as fma(-m, s, acc), so the same bits). The two-pass form negated m
// by a sign mask the compiler kept in a register, one too many for the 6-row dot loop: one dot
// chain went through the stack every step. q4_k and q5_k at 16 and 512 rows: 0.85-0.89x the
// time, the other formats within the noise (`FLATSERVE_CPU_ISA=avxvnni benchmarks/dev/
// cpu_prompt_tiles.py --rows 16,512`, the two builds alternated 4 times, 2-core Zen 5,
// 2026-11-28). At avx2 (4 rows, no spill) the fused form measured 1.01-1.12x: left out.
#if defined(__AVXVNNI__)
constexpr bool FUSED_MINS = true;
#else
constexpr bool FUSED_MINS = false;
#endif

// One step (J = 16 pairs: a block; 8: a half block) of R weight rows (wr[i]: its int16 codes)
// against an activation group's pairs xb: S[i][h] lane t = the exact int32 dot of weight row i and
// activation row 8 h + t.
template <int J, int R>
__attribute__((always_inline)) inline void dots(const int16_t* const wr[R], const int16_t* xb, __m256i S[R][2]) {
  for (int i = 0; i < R; ++i) S[i][0] = S[i][1] = _mm256_setzero_si256();
#pragma GCC unroll 16
  for (int j = 0; j < J; ++j) {
    const __m256i x0 = ld(xb + 32 * j), x1 = ld(xb + 32 * j + 16);
#pragma GCC unroll 6
    for (int i = 0; i < R; ++i) {
      int32_t pair;
      std::memcpy(&pair, wr[i] + 2 * j, 4);
      const __m256i w = _mm256_set1_epi32(pair);
#if defined(__AVXVNNI__)
      S[i][0] = _mm256_dpwssd_avx_epi32(S[i][0], x0, w);
      S[i][1] = _mm256_dpwssd_avx_epi32(S[i][1], x1, w);
#else
      S[i][0] = _mm256_add_epi32(S[i][0], _mm256_madd_epi16(x0, w));
      S[i][1] = _mm256_add_epi32(S[i][1], _mm256_madd_epi16(x1, w));
#endif
    }
#if !defined(__AVXVNNI__)
    // An empty asm that holds the 8 chains in registers at each step's end: without it GCC
    // interleaved the unrolled steps and kept 3-4 chains on the stack (`objdump`: 19 stack
    // accesses per 64 vpmaddwd, none with it); q4_k, q5_k, q6_k and q5_0 at 512 rows 0.95-0.98x
    // the time, the rest level (`FLATSERVE_CPU_ISA=avx2 benchmarks/dev/cpu_prompt_tiles.py --rows
    // 16,512`, builds alternated 4 times, 2-core Zen 5, 2026-11-28). The same integers.
    for (int i = 0; i < R; ++i) __asm__ volatile("" : "+x"(S[i][0]), "+x"(S[i][1]));
#endif
  }
}

// R weight rows (codes w16 + r * K, scales scT[2 b + h][16], offsets mnT[b][16], from row r0)
// against activation group g -> acc[i][t]: activation row 16 g + t, weight row r0 + i.
template <int R, bool halves, bool mins>
inline void rows_r(const int16_t* w16, int64_t K, const float* scT, const float* mnT, int r0, const ActPairs& a,
                   int64_t g, float acc[][16], Prefetch& pf) {
  for (int i = 0; i < R; ++i) std::fill(acc[i], acc[i] + 16, 0.f);
  for (int64_t b = 0; b < a.nb; ++b) {
    pf.step();
    const int16_t* xb = a.x_at(g, b);
    const float* xd = a.d_at(g, b);
    const __m256 xd0 = _mm256_loadu_ps(xd), xd1 = _mm256_loadu_ps(xd + 8);
    const int16_t* wr[R];
    for (int i = 0; i < R; ++i) wr[i] = w16 + (r0 + i) * K + 32 * b;
    __m256i S[R][2];
    for (int h = 0; h < (halves ? 2 : 1); ++h) {
      if constexpr (halves) {
        const int16_t* wh[R];
        for (int i = 0; i < R; ++i) wh[i] = wr[i] + 16 * h;
        dots<8, R>(wh, xb + 256 * h, S);
      } else {
        dots<16, R>(wr, xb, S);
      }
      const float* sc = scT + (2 * b + h) * 16 + r0;
      static_assert(!(halves && mins));
      constexpr bool fused = mins && FUSED_MINS;
      __m256 xs0 = xd0, xs1 = xd1;
      if constexpr (fused) xs0 = _mm256_loadu_ps(a.s_at(g, b)), xs1 = _mm256_loadu_ps(a.s_at(g, b) + 8);
      for (int i = 0; i < R; ++i) {
        const __m256 s = _mm256_set1_ps(sc[i]);
        const __m256 a0 = _mm256_mul_ps(_mm256_cvtepi32_ps(S[i][0]), s);
        const __m256 a1 = _mm256_mul_ps(_mm256_cvtepi32_ps(S[i][1]), s);
        __m256 c0 = _mm256_fmadd_ps(a0, xd0, _mm256_loadu_ps(acc[i]));
        __m256 c1 = _mm256_fmadd_ps(a1, xd1, _mm256_loadu_ps(acc[i] + 8));
        if constexpr (fused) {
          const __m256 m = _mm256_set1_ps(mnT[16 * b + r0 + i]);
          c0 = _mm256_fnmadd_ps(m, xs0, c0);
          c1 = _mm256_fnmadd_ps(m, xs1, c1);
        }
        _mm256_storeu_ps(acc[i], c0);
        _mm256_storeu_ps(acc[i] + 8, c1);
      }
    }
    if constexpr (mins && !FUSED_MINS) {
      const float* xs = a.s_at(g, b);
      const __m256 xs0 = _mm256_loadu_ps(xs), xs1 = _mm256_loadu_ps(xs + 8);
      for (int i = 0; i < R; ++i) {
        const __m256 m = _mm256_set1_ps(-mnT[16 * b + r0 + i]);
        _mm256_storeu_ps(acc[i], _mm256_fmadd_ps(m, xs0, _mm256_loadu_ps(acc[i])));
        _mm256_storeu_ps(acc[i] + 8, _mm256_fmadd_ps(m, xs1, _mm256_loadu_ps(acc[i] + 8)));
      }
    }
  }
}

// 16 weight rows as int16 codes [16][K], scales transposed scT[K / 16][16] and offsets mnT[K /
// 32][16], each block read from its stored bytes by DirectRow (its float products: the tiles'
// bits); rows past N (r >= nn) repeat row nn - 1 (read, never stored). Once per 16 weight rows,
// against every activation group of the call. Through unpack_block's int8 buffer and scalar
// scale loops instead (ad6ee13), a 16-row call of the q5_0 4,096 x 640 took 0.59-0.65 ms against
// 0.34-0.38 (the LM head 35-38 against 20-23; q4_k 640 x 2,048 0.23-0.27 against 0.26-0.30: a
// wash): `FLATSERVE_CPU_ISA=avxvnni benchmarks/dev/cpu_ymm_paths.py`'s tiles column at both
// commits, one sitting, 2-core Zen 5.
template <int fmt>
struct WGroup {
  std::vector<int16_t> w16;
  std::vector<float> scT, mnT, mnbuf;
  explicit WGroup(int64_t K) : w16(16 * K, 0), scT(K, 0.f), mnT(K / 2, 0.f), mnbuf(K / 32, 0.f) {}

  void load(const uint8_t* w, int64_t n0, int64_t nn, int64_t row_bytes, int64_t K) {
    const int64_t nb = K / 32;
    DirectRow<fmt> dr{nullptr, mnbuf.data(), {}};
    for (int64_t r = 0; r < 16; ++r) {
      dr.row = w + (n0 + std::min(r, nn - 1)) * row_bytes;
      int16_t* dst = w16.data() + r * K;
      for (int64_t b = 0; b < nb; ++b) {
        __m256i wv;
        dr.get(b, wv, scT[(2 * b) * 16 + r], scT[(2 * b + 1) * 16 + r]);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 32 * b), _mm256_cvtepi8_epi16(_mm256_castsi256_si128(wv)));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + 32 * b + 16),
                            _mm256_cvtepi8_epi16(_mm256_extracti128_si256(wv, 1)));
      }
      for (int64_t b = 0; b < nb; ++b) mnT[b * 16 + r] = mnbuf[b];
    }
  }
};

// A group's results, tile[r][t] (weight row n0 + r, activation row m0 + t), stored as out's rows:
// transposed in 8 x 8 register blocks, then a full row of 16 bf16 or fp32 values in one or two
// vector stores (c10's rounding: the same bits as `store`). The 256 scalar conversions and
// strided 2-byte stores took 9-11% of a 640-wide call (q5_0 4,096 x 640 and 1,024 x 640 at 512
// rows, FLATSERVE_CPU_ISA=avxvnni, 2-core Zen 5, 2026-11-29).
template <typename T, typename Store>
inline void store_tile(float tile[16][16], int64_t mt, int64_t nn, T* out, int64_t ldo, Store store) {
  alignas(32) float rows[16][16];  // [t][r]
  for (int r0 = 0; r0 < 16; r0 += 8)
    for (int t0 = 0; t0 < 16; t0 += 8) {
      __m256 v[8];
      for (int i = 0; i < 8; ++i) v[i] = _mm256_load_ps(tile[r0 + i] + t0);
      flatserve::transpose8x8(v);
      for (int i = 0; i < 8; ++i) _mm256_store_ps(rows[t0 + i] + r0, v[i]);
    }
  for (int64_t t = 0; t < mt; ++t) {
    T* o = out + t * ldo;
    if constexpr (std::is_same_v<T, c10::BFloat16>) {
      if (nn == 16) {
        const __m256i h = flatserve::bf16x16_rne(_mm256_load_ps(rows[t]), _mm256_load_ps(rows[t] + 8));
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(o), h);
        continue;
      }
    } else if constexpr (std::is_same_v<T, float>) {
      if (nn == 16) {
        _mm256_storeu_ps(o, _mm256_load_ps(rows[t]));
        _mm256_storeu_ps(o + 8, _mm256_load_ps(rows[t] + 8));
        continue;
      }
    }
    for (int64_t r = 0; r < nn; ++r) store(o + r, rows[t][r]);
  }
}

template <int fmt, typename T, typename Store>
void gemm_t(const ActPairs& a, int64_t M, const uint8_t* w, int64_t N, int64_t row_bytes, T* out, int64_t ldo,
            Store store) {
  constexpr bool halves = fmt == Q6_K, mins = known_layout(fmt).mins;
  const int64_t K = 32 * a.nb;
  at::parallel_for(0, (N + 15) / 16, 1, [&](int64_t c0, int64_t c1) {
    WGroup<fmt> wg(K);
    alignas(32) float tile[16][16];  // rows_r's results, [weight row][activation row]
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t n0 = 16 * c, nn = std::min<int64_t>(16, N - n0);
      wg.load(w, n0, nn, row_bytes, K);
      Prefetch pf;  // the next 16 rows' bytes, spread over this group's steps (quant_blocks.h)
      if (c + 1 < c1)
        pf.spread(w + (n0 + 16) * row_bytes, std::min<int64_t>(16, N - n0 - 16) * row_bytes, (RMAX == 4 ? 4 : 3) * a.groups * a.nb);
      for (int64_t g = 0; g < a.groups; ++g) {
        for (int r0 = 0; r0 < nn;) {
          const int rr = RMAX == 4 || r0 == 12 ? 4 : 6;  // 16 rows: 6 + 6 + 4, or 4 x 4
          if (rr == 6) rows_r<6, halves, mins>(wg.w16.data(), K, wg.scT.data(), wg.mnT.data(), r0, a, g, tile + r0, pf);
          else rows_r<4, halves, mins>(wg.w16.data(), K, wg.scT.data(), wg.mnT.data(), r0, a, g, tile + r0, pf);
          r0 += rr;
        }
        store_tile(tile, std::min<int64_t>(16, M - 16 * g), nn, out + 16 * g * ldo + n0, ldo, store);
      }
    }
  });
}

// rows8: calls of a few rows (decode steps) with the tiles' bits, as rows16 (csrc/quant_rows.h)
// gives them at the avx512 level: 8 weight rows in the lanes, each block's integer dot of each
// (activation row, weight row) exact in int32 whatever its order, then the tiles' float operations
// per lane. The weight rows' blocks come from their stored bytes (DirectRow), widened to int16 in
// ACT_ORDER once a block into wb for the call's activation rows; per activation row 8 madd2 and a
// 6-hadd tree leave row r's sums of values 0-15 and 16-31 in lane r of S0, S1.
template <int MS, bool halves, bool mins, typename Rows>
inline void rows8(Rows& rows, const int16_t* const xq[MS], const float* const xd[MS], const float* const xs[MS],
                  int64_t nb, __m256 acc[MS], Prefetch& pf) {
  alignas(32) int16_t wb[8][32];
  alignas(32) float s0[8], s1[8], mn[8];
  for (int t = 0; t < MS; ++t) acc[t] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    pf.step();
    for (int r = 0; r < 8; ++r) {
      __m256i wv;
      rows[r].get(b, wv, s0[r], s1[r]);
      wv = _mm256_permute4x64_epi64(wv, 0xD8);  // values 0-7, 16-23 | 8-15, 24-31: ACT_ORDER
      _mm256_store_si256(reinterpret_cast<__m256i*>(wb[r]), _mm256_cvtepi8_epi16(_mm256_castsi256_si128(wv)));
      _mm256_store_si256(reinterpret_cast<__m256i*>(wb[r] + 16), _mm256_cvtepi8_epi16(_mm256_extracti128_si256(wv, 1)));
      if constexpr (mins) mn[r] = -rows[r].mn[b];
    }
    const __m256 sc0 = _mm256_load_ps(s0), sc1 = _mm256_load_ps(s1);
    for (int t = 0; t < MS; ++t) {
      const __m256i xa = ld(xq[t] + 32 * b), xb = ld(xq[t] + 32 * b + 16);
      __m256i p[8];
      for (int r = 0; r < 8; ++r) p[r] = madd2(ld(wb[r]), xa, ld(wb[r] + 16), xb);  // lanes 0-3: 0-15
      const __m256i q0 = _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
      const __m256i q1 = _mm256_hadd_epi32(_mm256_hadd_epi32(p[4], p[5]), _mm256_hadd_epi32(p[6], p[7]));
      const __m256i S0 = _mm256_permute2x128_si256(q0, q1, 0x20), S1 = _mm256_permute2x128_si256(q0, q1, 0x31);
      const __m256 d = _mm256_set1_ps(xd[t][b]);
      if constexpr (halves) {
        acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(S0), sc0), d, acc[t]);
        acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(S1), sc1), d, acc[t]);
      } else {
        acc[t] = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_add_epi32(S0, S1)), sc0), d, acc[t]);
      }
      if constexpr (mins) acc[t] = _mm256_fmadd_ps(_mm256_load_ps(mn), _mm256_set1_ps(xs[t][b]), acc[t]);
    }
  }
}

// out[m, n] for m < M (quantize_act's codes q, scales d, sums s) and weight row n, by rows8.
template <int fmt, typename T, typename Store>
void gemm_rows8(const int16_t* q, const float* d, const float* s, int64_t K, int64_t M, const uint8_t* w, int64_t N,
                int64_t row_bytes, T* out, int64_t ldo, Store store) {
  constexpr bool halves = fmt == Q6_K, mins = known_layout(fmt).mins;
  const int64_t nb = K / 32;
  at::parallel_for(0, (N + 7) / 8, 1, [&](int64_t c0, int64_t c1) {
    std::vector<float> mnbuf(8 * nb);
    DirectRow<fmt> rows[8];
    for (int r = 0; r < 8; ++r) rows[r].mn = mnbuf.data() + r * nb;
    alignas(32) float res[8];
    __m256 acc[4];
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t n0 = 8 * c, nn = std::min<int64_t>(8, N - n0);
      for (int r = 0; r < 8; ++r) rows[r].row = w + (n0 + std::min<int64_t>(r, nn - 1)) * row_bytes;
      Prefetch pf;  // 8 interleaved row streams: the next 8 rows requested a few lines a block
      if (c + 1 < c1)
        pf.spread(w + (n0 + 8) * row_bytes, std::min<int64_t>(8, N - n0 - 8) * row_bytes, (M + 3) / 4 * nb);
      for (int64_t m0 = 0; m0 < M; m0 += 4) {
        const int64_t ms = std::min<int64_t>(4, M - m0);
        const int16_t* xq[4];
        const float *xd[4], *xs[4];
        for (int64_t t = 0; t < 4; ++t) {
          const int64_t m = m0 + std::min(t, ms - 1);
          xq[t] = q + m * K, xd[t] = d + m * nb, xs[t] = s + m * nb;
        }
        if (ms == 1) rows8<1, halves, mins>(rows, xq, xd, xs, nb, acc, pf);
        else if (ms == 2) rows8<2, halves, mins>(rows, xq, xd, xs, nb, acc, pf);
        else if (ms == 3) rows8<3, halves, mins>(rows, xq, xd, xs, nb, acc, pf);
        else rows8<4, halves, mins>(rows, xq, xd, xs, nb, acc, pf);
        for (int64_t t = 0; t < ms; ++t) {
          _mm256_store_ps(res, acc[t]);
          for (int64_t r = 0; r < nn; ++r) store(out + (m0 + t) * ldo + n0 + r, res[r]);
        }
      }
    }
  });
}

template <typename T, typename Store>
void gemm_rows8_any(int fmt, const int16_t* q, const float* d, const float* s, int64_t K, int64_t M,
                    const uint8_t* w, int64_t N, int64_t row_bytes, T* out, int64_t ldo, Store store) {
  by_format(fmt, [&](auto F) { gemm_rows8<decltype(F)::value>(q, d, s, K, M, w, N, row_bytes, out, ldo, store); });
}

// One Q8_0 row's logit for one activation row (codes xq in ACT_ORDER, scales xd), rows8's bits:
// the greedy heads' rescoring at these levels.
inline float exact_q8(const uint8_t* raw, const int16_t* xq, const float* xd, int64_t nb) {
  float acc = 0.f;
  for (int64_t b = 0; b < nb; ++b) {
    const __m256i wv = _mm256_permute4x64_epi64(ld(raw + 34 * b + 2), 0xD8);
    const __m256i p = madd2(_mm256_cvtepi8_epi16(_mm256_castsi256_si128(wv)), ld(xq + 32 * b),
                            _mm256_cvtepi8_epi16(_mm256_extracti128_si256(wv, 1)), ld(xq + 32 * b + 16));
    const __m128i h = _mm_add_epi32(_mm256_castsi256_si128(p), _mm256_extracti128_si256(p, 1));
    const __m128i h2 = _mm_add_epi32(h, _mm_shuffle_epi32(h, 0x4E));
    const int32_t S = _mm_cvtsi128_si32(_mm_add_epi32(h2, _mm_shuffle_epi32(h2, 0xB1)));
    acc = std::fma(static_cast<float>(S) * h2f(raw + 34 * b), xd[b], acc);
  }
  return acc;
}

// out[m, n] for every activation row m of `a` and weight row n of W (`fmt` blocks, [N, row_bytes]);
// store(T*, float) writes one result.
template <typename T, typename Store>
void gemm(const ActPairs& a, int64_t M, const uint8_t* w, int64_t N, int64_t row_bytes, int fmt, T* out,
          int64_t ldo, Store store) {
  by_format(fmt, [&](auto F) { gemm_t<decltype(F)::value>(a, M, w, N, row_bytes, out, ldo, store); });
}

}  // namespace flatserve::qymm
#endif
