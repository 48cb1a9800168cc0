// The greedy head's candidate pass (ops/csrc/amx_gemm_cpu.cpp, greedy_candidates; the copy and
// its bound: flatserve/model/greedy_head.py). Here so that the GEMM kernel's source stays
// within its size budget; only that file includes it.
#pragma once

#include "amx_tiles.h"

#ifdef FLATSERVE_AMX
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace flatserve::greedy {

// ---- Exact greedy over a 7-bit copy of a plain weight (flatserve/model/greedy_head.py). ----
// Each W row n is held as bytes u[n] = q[n] + 64 with w ~= s[n] q[n], |q| <= 63. Each x row t
// is split into integers, x_t ~= sx_t (256 xh_t + xl_t), xh and xl in [-128, 127] (pack_x8 below;
// E_t = |x_t - sx_t (256 xh_t + xl_t)|_1 is what that leaves: 16 bits of max|x_t|), and the
// tile unit's u8 x s8 products (TDPBUSD) sum u . xh and u . xl exactly in int32. Then
//   s[n] sx_t (256 (u . xh - 64 sum xh) + (u . xl - 64 sum xl)) = s[n] sx_t (q . x^_t)
// is within |x_t|_1 c[n] + 63 s[n] E_t of what the bf16 kernel computes for W row n (c: the
// weight's quantization error plus fp32 rounding, from the Python side).
// Why int8 tiles and not bf16 ones: the bytes go to the tiles as they are. The bf16 kernel
// before this turned each 2 KB piece into 4 KB of bf16 in L1 and loaded tiles from there; in a
// scratch stream of the 168 MB copy (cold, both cores) those tile loads alone cost ~0.9 ms over
// the plain read (5.5-5.9 ms), the conversion itself ~0.2, and tiles straight from the stream on
// TDPBUSD ~0.2-0.4. Layout [N/32][K/64] pieces of 32 rows x 64 k (greedy_layout), so each
// 32-row group is one contiguous stream and a piece is two 1 KB A tiles. Per token it keeps the
// best lower bound and every row whose upper bound reaches it; rows below the final best lower
// bound by more than the bf16 rounding of the logits cannot be, or tie with, the bf16 head's argmax.
// Into L2, 40 KB ahead: of T0 at 4-16 KB and T1 at 16-80 KB, the best on the 262k x 640 head
// (bf16 kernel, scratch runs), and with no prefetch the int8 stream read 6.4 against 5.9 ms.
// Then into L1, 4 KB ahead, for the tile loads (benchmarks/dev/cpu_greedy_ab.py, two runs: 6.58 ->
// 6.31 and 6.36 -> 6.08 ms; 8 KB ahead 6.37 against 6.31).
constexpr int64_t kGreedyPrefetch = 40 * 1024;
constexpr int64_t kGreedyPrefetchL1 = 4 * 1024;
constexpr int kGreedyX = 32639;  // |x^| <= 127 * 256 + 127

struct Cand {
  int32_t n;
  float upper;
};

struct GreedyPart {  // one thread's share of the rows
  float best[16];
  std::vector<Cand> cand[16];
};

// Below `lo` by this much, a value's bf16 rounding is below lo's: 2^-6 of |lo| is at least two
// bf16 ulps at lo's magnitude (8 significant bits), one more for a crossing of a power of two.
inline float tie_margin(float lo) { return std::fabs(lo) * 0x1p-6f + 1e-30f; }
inline __m512 tie_margin(__m512 lo) {
  return _mm512_fmadd_ps(_mm512_abs_ps(lo), _mm512_set1_ps(0x1p-6f), _mm512_set1_ps(1e-30f));
}

// x [M <= 16, K] (bf16 values as fp32) -> the two B tiles of every 64-k step (xh, then xl:
// [K/64][2][16 k quads][16 tokens][4 bytes], zero past K and past M) and per token sx, the
// offsets 64 sum xh and 64 sum xl, and 63 E_t rounded up. A token with a NaN or infinity gets
// e63 = NaN: its bounds compare false and it gets no candidate (the caller takes the full head).
struct X8 {
  std::vector<int8_t> tiles;
  alignas(64) float sx[16] = {}, e63[16] = {};
  alignas(64) int32_t offh[16] = {}, offl[16] = {};
  const char* at(int64_t kb) const { return reinterpret_cast<const char*>(tiles.data()) + kb * 2048; }
};

inline void pack_x8(const float* x, int64_t M, int64_t K, X8& out) {
  const int64_t KS = (K + 63) / 64;
  out.tiles.assign(KS * 2048, 0);
  for (int64_t t = 0; t < M; ++t) {
    const float* xt = x + t * K;
    float mx = 0.f;
    bool finite = true;
    for (int64_t k = 0; k < K; ++k) {
      finite = finite && std::isfinite(xt[k]);
      mx = std::max(mx, std::fabs(xt[k]));
    }
    if (!finite) {
      out.e63[t] = NAN;
      continue;
    }
    const float sx = mx > 0.f ? mx / kGreedyX : 1.f;
    double e = 0.0;
    int32_t sh = 0, sl = 0;
    for (int64_t k = 0; k < K; ++k) {
      const int q = std::clamp(static_cast<int>(std::nearbyint(xt[k] / sx)), -kGreedyX, kGreedyX);
      const int h = (q + 128) >> 8, l = q - 256 * h;  // floor: l in [-128, 127], h in [-128, 127]
      int8_t* tile = out.tiles.data() + (k / 64) * 2048 + ((k % 64) / 4) * 64 + t * 4 + k % 4;
      tile[0] = static_cast<int8_t>(h);
      tile[1024] = static_cast<int8_t>(l);
      sh += h;
      sl += l;
      e += std::fabs(static_cast<double>(xt[k]) - static_cast<double>(sx) * q);
    }
    out.sx[t] = sx;
    out.offh[t] = 64 * sh;
    out.offl[t] = 64 * sl;
    out.e63[t] = static_cast<float>(63.0 * e * (1 + 0x1p-20));  // covers the rounding to float
  }
}

// One 32-row group's int32 tile sums, spilled, and how many of its rows have been checked.
struct GreedySpill {
  alignas(64) int32_t acc[2][2][16][16];  // acc[j][part][w]: W row g*32 + 16j + w over the 16 token lanes
  int64_t g = 0;
  int done = 32;
};

// The bound check of a group's rows (spill rows done..upto): each row whose upper bound reaches
// `thr` is kept; `best` takes every lower bound.
struct GreedyCheck {
  const float *s, *c;
  __m512 xabs, e63, sx, best, thr;
  __m512i offh, offl;
  __mmask16 live;
  void rows(GreedySpill& sp, int upto, GreedyPart& out) {
    for (; sp.done < upto; ++sp.done) {
      const int j = sp.done / 16, w = sp.done % 16;
      const int64_t n = sp.g * 32 + sp.done;
      // q . x^ = 256 (u . xh - 64 sum xh) + (u . xl - 64 sum xl), the differences exact in int32.
      const __m512 hi = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_load_si512(sp.acc[j][0][w]), offh));
      const __m512 lo = _mm512_cvtepi32_ps(_mm512_sub_epi32(_mm512_load_si512(sp.acc[j][1][w]), offl));
      const __m512 sn = _mm512_set1_ps(s[n]);
      const __m512 qx = _mm512_fmadd_ps(_mm512_set1_ps(256.f), hi, lo);
      const __m512 approx = _mm512_mul_ps(qx, _mm512_mul_ps(sx, sn));
      const __m512 bound = _mm512_fmadd_ps(xabs, _mm512_set1_ps(c[n]), _mm512_mul_ps(e63, sn));
      const __m512 upper = _mm512_add_ps(approx, bound);
      best = _mm512_max_ps(best, _mm512_sub_ps(approx, bound));
      uint32_t m = _mm512_mask_cmp_ps_mask(live, upper, thr, _CMP_GE_OQ);
      if (!m) continue;
      alignas(64) float up[16];
      _mm512_store_ps(up, upper);
      for (; m; m &= m - 1) {
        const int t = __builtin_ctz(m);
        out.cand[t].push_back({static_cast<int32_t>(n), up[t]});
      }
    }
  }
  // A group finished: the threshold a row must reach is the best lower bound so far, lower than
  // the final one, so it keeps a few more rows (filtered at the end) and costs no reduction.
  void finish(GreedySpill& sp, GreedyPart& out) {
    rows(sp, 32, out);
    thr = _mm512_sub_ps(best, tie_margin(best));
  }
};

// A group's bound checks run a few rows per k step of the next group's tile products (4 of 10
// steps at K = 640), as gemm_2x2's Spill does for its epilogue: run after each group, they
// stalled the stream's reads (bf16 kernel, benchmarks/dev/cpu_greedy_ab.py: 7.46 -> 6.80 ms).
void greedy_rows(const uint8_t* wq, const float* s, const float* c, const float* xabs, const X8& x8,
                 int64_t M, int64_t K, int64_t g0, int64_t g1, GreedyPart& out) {
  const int64_t KS = (K + 63) / 64;
  const int per_step = static_cast<int>((32 + KS - 1) / KS);
  GreedySpill spill[2];
  int cur = 0;  // the spill this group's sums go to; the other is the previous group's
  GreedyCheck chk{s, c, _mm512_setzero_ps(), _mm512_load_ps(x8.e63), _mm512_load_ps(x8.sx),
                  _mm512_set1_ps(-INFINITY), _mm512_set1_ps(-INFINITY), _mm512_load_si512(x8.offh),
                  _mm512_load_si512(x8.offl), static_cast<__mmask16>((1u << M) - 1)};  // token lanes in use
  for (int64_t t = 0; t < M; ++t) chk.xabs[t] = xabs[t];
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* wg = wq + g * 32 * KS * 64;
    GreedySpill& prev = spill[cur ^ 1];
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t kb = 0; kb < KS; ++kb) {
      const uint8_t* wk = wg + kb * 2048;  // [32 rows][64 k]
      for (int b = 0; b < 2048; b += 64) {
        _mm_prefetch(reinterpret_cast<const char*>(wk) + kGreedyPrefetch + b, _MM_HINT_T1);
        _mm_prefetch(reinterpret_cast<const char*>(wk) + kGreedyPrefetchL1 + b, _MM_HINT_T0);
      }
      _tile_loadd(6, x8.at(kb), 64);
      _tile_loadd(7, x8.at(kb) + 1024, 64);
      _tile_loadd(4, wk, 64);         _tile_dpbusd(0, 4, 6); _tile_dpbusd(1, 4, 7);
      _tile_loadd(5, wk + 1024, 64);  _tile_dpbusd(2, 5, 6); _tile_dpbusd(3, 5, 7);
      chk.rows(prev, std::min(32, prev.done + per_step), out);
    }
    chk.finish(prev, out);
    GreedySpill& sp = spill[cur];
    _tile_stored(0, sp.acc[0][0], 64); _tile_stored(1, sp.acc[0][1], 64);
    _tile_stored(2, sp.acc[1][0], 64); _tile_stored(3, sp.acc[1][1], 64);
    sp.g = g;
    sp.done = 0;
    cur ^= 1;
  }
  chk.finish(spill[cur ^ 1], out);
  _mm512_storeu_ps(out.best, chk.best);
}

}  // namespace flatserve::greedy
#endif
