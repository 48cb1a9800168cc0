// The quantized GEMM on AMX-INT8 tiles (ops/csrc/quant_gemm_cpu.cpp's amx level): the same
// int16 activation codes and weight codes as the vector path, calls of more than 4 rows.
//
// Why: the vector path spends ~6 vector ops on each (activation row, weight row, 32 values):
// two vpmaddwd, an add, and a convert, multiply and FMA to scale the block's int32 sums into
// the fp32 result. At 16 generated rows that is compute, not bytes: the default model's
// 262k x 640 Q8_0 head took 97-122 ms of a ~200 ms step on a 2-core Xeon (AMX), its 178 MB read
// in ~9 ms. Tiles do the integer part for 16 weight rows x 16 activation rows per instruction,
// and the scaling runs on 16 activation rows per vector op.
//
// How: a weight tile A holds 16 weight rows' codes of one block (int8; K formats' 0..31 fit),
// straight from the stored Q8_0 rows or from the unpacked common form. An int16 code is
// 256 * hi + lo (hi signed, lo unsigned bytes), so two tiles of activation bytes B_hi, B_lo
// (VNNI layout: row kk holds values 4kk..4kk+3 of 16 activation rows) give the block's exact
// int32 dots S = 256 * (A . B_hi) + (A . B_lo) (|S| <= 32 x 128 x 32767 < 2^31). Q6_K's 16-value
// scales take one pair of tiles per half block. Then, per output, in this order for every row
// count, for `exact` (the greedy head's rescoring) and for csrc/quant_rows.h's rows16 (the
// calls of 1-4 rows), so a row's bits never depend on its call:
//
//   acc = fma(float(S) * w_scale, x_scale, acc)          per block (or half block), in order
//   acc = fma(-w_min, x_sum, acc)                        K formats' offsets, after each block
#pragma once

#include "amx_tiles.h"

#ifdef FLATSERVE_AMX
#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "quant_blocks.h"

namespace flatserve::qamx {

using namespace flatserve::qblocks;

// One call's activation rows in groups of 16 (ActGroups): per group and block the hi and lo byte
// tiles [8][16][4].
struct ActTiles : ActGroups {
  std::vector<int8_t> hi;
  std::vector<uint8_t> lo;
  const int8_t* hi_at(int64_t g, int64_t b) const { return hi.data() + (g * nb + b) * 512; }
  const uint8_t* lo_at(int64_t g, int64_t b) const { return lo.data() + (g * nb + b) * 512; }
};

inline void act_tiles(const int16_t* q, const float* d, const float* s, int64_t M, int64_t K, ActTiles& a) {
  a.shape(M, K);
  a.hi.assign(a.groups * a.nb * 512, 0);
  a.lo.assign(a.groups * a.nb * 512, 0);
  a.fill(q, d, s, M, [&](int64_t i, int64_t t, const int16_t* x) {
    int8_t* hi = a.hi.data() + i * 512 + 4 * t;
    uint8_t* lo = a.lo.data() + i * 512 + 4 * t;
    for (int l = 0; l < 32; ++l) {  // value l: tile row l / 4, byte l % 4 of column t
      const int16_t c = x[act_value(l)];
      hi[(l / 4) * 64 + l % 4] = static_cast<int8_t>(c >> 8);
      lo[(l / 4) * 64 + l % 4] = static_cast<uint8_t>(c & 0xFF);
    }
  });
}

// Tiles: 0 weights (16 rows x kb bytes), 1 / 2 activation hi / lo (kb / 4 rows x 4 cols bytes),
// 3 / 4 and 5 / 6 the hi / lo int32 dots (16 x 16) of even and odd steps. kb = 32 (a block) or
// 16 (Q6_K's half blocks).
inline void load_config(int kb) {
  constexpr int cols = 16;  // activation rows
  TileConfig cfg;
  cfg.rows[0] = 16; cfg.colsb[0] = static_cast<uint16_t>(kb);
  for (int t = 1; t <= 2; ++t) { cfg.rows[t] = static_cast<uint8_t>(kb / 4); cfg.colsb[t] = static_cast<uint16_t>(4 * cols); }
  for (int t = 3; t <= 6; ++t) { cfg.rows[t] = 16; cfg.colsb[t] = static_cast<uint16_t>(4 * cols); }
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// One step (a block, or a half block with 16-value scales): its dots into tiles CH / CL (a macro:
// the tile intrinsics take literal register numbers).
#define FLATSERVE_QAMX_STEP(CH, CL, a_tile, vs, bhi, blo) \
  do {                                                   \
    _tile_zero(CH);                                      \
    _tile_zero(CL);                                      \
    _tile_loadd(0, a_tile, vs);                          \
    _tile_loadd(1, bhi, 64);                             \
    _tile_loadd(2, blo, 64);                             \
    _tile_dpbssd(CH, 0, 1);                              \
    _tile_dpbsud(CL, 0, 2);                              \
  } while (0)

// 16 weight rows: block b's codes at v + r * vs + bstride * b; scales scT[K / 16][16] and
// offsets mnT[nb][16] (row r in lane r).
struct WGroup {
  const int8_t* v;
  int64_t vs, bstride;
  const float* scT;
  const float* mnT;
};

// Every step's dots of one weight group against activation group g, pipelined: step s + 1's dots
// are issued before step s - 1's results are scaled (`scale(block, half, chi, clo)`), from
// buffers stored an iteration earlier, so that neither the dots' latency nor the tile store the
// vector loads wait on stalls the scaling. (Against one step at a time: the head at 64 rows
// 100-116 -> 81-110 ms, at 1-16 rows within this VM's noise.) C tiles are stored 64 bytes a row.
template <typename Scale>
inline void steps(const WGroup& wg, int64_t nb, bool halves, const ActTiles& a, int64_t g, Scale scale) {
  alignas(64) int32_t chi[2][256], clo[2][256];
  const int hs = halves ? 2 : 1;
  const int64_t n = nb * hs, cs = 64;
  auto issue = [&](int64_t st) {
    const int64_t b = st / hs, h = st % hs;
    const int8_t* at = wg.v + wg.bstride * b + 16 * h;
    if (st % 2 == 0) FLATSERVE_QAMX_STEP(3, 4, at, wg.vs, a.hi_at(g, b) + 256 * h, a.lo_at(g, b) + 256 * h);
    else FLATSERVE_QAMX_STEP(5, 6, at, wg.vs, a.hi_at(g, b) + 256 * h, a.lo_at(g, b) + 256 * h);
  };
  issue(0);
  for (int64_t st = 0; st < n; ++st) {
    if (st % 2 == 0) { _tile_stored(3, chi[0], cs); _tile_stored(4, clo[0], cs); }
    else { _tile_stored(5, chi[1], cs); _tile_stored(6, clo[1], cs); }
    if (st + 1 < n) issue(st + 1);
    if (st > 0) scale((st - 1) / hs, (st - 1) % hs, chi[(st - 1) % 2], clo[(st - 1) % 2]);
  }
  scale((n - 1) / hs, (n - 1) % hs, chi[(n - 1) % 2], clo[(n - 1) % 2]);
}

inline __m512 scaled(__m512i hi, __m512i lo, __m512 sc) {  // float(256 hi + lo) * sc
  return _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_add_epi32(_mm512_slli_epi32(hi, 8), lo)), sc);
}

// 16 activation rows of group g in lanes: acc[r] for weight row r.
inline void group_dot(const WGroup& wg, int64_t nb, bool halves, bool mins, const ActTiles& a, int64_t g,
                      __m512 acc[16]) {
  for (int r = 0; r < 16; ++r) acc[r] = _mm512_setzero_ps();
  const int hs = halves ? 2 : 1;
  steps(wg, nb, halves, a, g, [&](int64_t b, int h, const int32_t* chi, const int32_t* clo) {
    const __m512 xd = _mm512_loadu_ps(a.d_at(g, b));
    const float* sc = wg.scT + (2 * b + h) * 16;
    for (int r = 0; r < 16; ++r)
      acc[r] = _mm512_fmadd_ps(scaled(_mm512_load_si512(chi + 16 * r), _mm512_load_si512(clo + 16 * r),
                                      _mm512_set1_ps(sc[r])), xd, acc[r]);
    if (mins && h == hs - 1) {
      const __m512 xs = _mm512_loadu_ps(a.s_at(g, b));
      for (int r = 0; r < 16; ++r) acc[r] = _mm512_fmadd_ps(_mm512_set1_ps(-wg.mnT[16 * b + r]), xs, acc[r]);
    }
  });
}

// out[m, n] for every activation row m of `a` and weight row n of W (`fmt` blocks, [N, row_bytes]);
// store(T*, float) writes one result.
template <typename T, typename Store>
void gemm(const ActTiles& a, int64_t M, const uint8_t* w, int64_t N, int64_t row_bytes, int fmt, T* out,
          int64_t ldo, Store store) {
  const Layout L = layout(fmt);
  const int64_t nb = a.nb, K = 32 * nb;
  const bool halves = fmt == Q6_K, raw_q8 = fmt == Q8_0;
  at::parallel_for(0, (N + 15) / 16, 1, [&](int64_t c0, int64_t c1) {
    load_config(halves ? 16 : 32);
    std::vector<int8_t> vbuf(16 * K, 0);
    std::vector<float> scbuf(16 * 2 * nb, 0.f), mnbuf(16 * nb, 0.f), scT(2 * nb * 16), mnT(nb * 16);
    alignas(64) float res[16];
    __m512 acc[16];
    for (int64_t c = c0; c < c1; ++c) {
      const int64_t n0 = 16 * c, nn = std::min<int64_t>(16, N - n0);
      WGroup wg{vbuf.data(), K, 32, scT.data(), mnT.data()};
      if (raw_q8 && nn == 16) {  // the stored rows are the tile: codes at 34 b + 2
        wg = {reinterpret_cast<const int8_t*>(w + n0 * row_bytes + 2), row_bytes, 34, scT.data(), mnT.data()};
        // block b's 16 fp16 scales in one gather (the dword's upper half is the block's first codes)
        const __m512i rows = _mm512_mullo_epi32(_mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
                                                _mm512_set1_epi32(static_cast<int>(row_bytes)));
        for (int64_t b = 0; b < nb; ++b) {
          const __m512i h = _mm512_i32gather_epi32(rows, w + n0 * row_bytes + 34 * b, 1);
          _mm512_storeu_ps(scT.data() + 32 * b, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(h)));
        }
      } else {
        for (int64_t r = 0; r < 16; ++r) {
          if (r < nn) {
            unpack_row(w + (n0 + r) * row_bytes, L, fmt, K, {vbuf.data() + r * K, scbuf.data() + r * 2 * nb,
                                                              mnbuf.data() + r * nb});
          } else {  // rows past N: zeros
            std::memset(vbuf.data() + r * K, 0, K);
          }
        }
        for (int64_t i = 0; i < 2 * nb; ++i)
          for (int r = 0; r < 16; ++r) scT[16 * i + r] = scbuf[r * 2 * nb + i];
        if (L.mins)
          for (int64_t b = 0; b < nb; ++b)
            for (int r = 0; r < 16; ++r) mnT[16 * b + r] = mnbuf[r * nb + b];
      }
      for (int64_t g = 0; g < a.groups; ++g) {
        group_dot(wg, nb, halves, L.mins, a, g, acc);
        for (int r = 0; r < nn; ++r) {  // lane t of acc[r]: activation row 16 g + t, column n0 + r
          _mm512_store_ps(res, acc[r]);
          for (int64_t t = 0; t < 16 && 16 * g + t < M; ++t) store(out + (16 * g + t) * ldo + n0 + r, res[t]);
        }
      }
    }
    _tile_release();
  });
}

}  // namespace flatserve::qamx
#endif
