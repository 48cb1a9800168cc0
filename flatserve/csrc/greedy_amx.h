// The greedy head's candidate pass (ops/csrc/amx_gemm_cpu.cpp, greedy_candidates; the copy and
// its bound: flatserve/model/greedy_head.py). Here so that the GEMM kernel's source stays
// within its size budget; only that file includes it.
#pragma once

#include "amx_tiles.h"

#ifdef FLATSERVE_AMX
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <vector>

namespace flatserve::greedy {

// ---- Exact greedy over a 7-bit copy of a plain weight (flatserve/model/greedy_head.py). ----
// Each W row n is held as bytes u[n] = q[n] + 64 with w ~= s[n] q[n], |q| <= 63, and per x row t
// s[n] (x_t . (u[n] + 128) - 192 sum(x_t)) is within |x_t|_1 c[n] of what the bf16 kernel
// computes for W row n (c: the quantization error plus the fp32 rounding, from the Python side).
// The kernel streams the bytes (half the bf16 head's), laid out [N/64][K/32] pieces of 64 rows x
// 32 k so that each 64-row group is one contiguous stream, turns each 2 KB piece into bf16 in L1
// (0x43uu is the bf16 of 128 + u for u < 128: why 7 bits, not 8; u7_piece_to_bf16), and runs
// plain_1x4's tile products. Per token it keeps the best lower bound
// and every row whose upper bound reaches it; rows below the final best lower bound by more
// than the bf16 rounding of the logits cannot be, or tie with, the bf16 head's argmax.
// Into L2, 40 KB ahead (a group at K = 640): of T0 at 4-16 KB and T1 at 16-80 KB, the best on
// the 262k x 640 head, ~5.5-6 ms at 16 rows against 9.2-10.6 for T0 (scratch runs; the rows'
// own layout with plain_1x4's next-group prefetch: ~8-9 ms).
constexpr int64_t kGreedyPrefetch = 40 * 1024;

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

// 64 rows x 32 k of bytes u -> bf16 128 + u, [64][32] at `a`. Each 64 bytes hold a row pair
// (r, r + 1) as, per 16-byte lane j, u[r][8j..8j+7] then u[r + 1][8j..8j+7]
// (greedy_head.py lays them out so): interleaving each lane's low and high 8 bytes with 0x43
// gives rows r and r + 1 in bf16, one instruction per 32 values, against a zero-extend and an OR
// per 32 in the rows' own order: the 262k x 640 head at 16 rows, cold, 9.07 -> 8.06 ms
// (benchmarks/cpu_greedy_ab.py; a scratch loop over 8 groups in L2, the instructions alone:
// 3.0 -> 2.5 ms for the whole head). The conversion, not the bytes, was the part of the pass
// the core's out-of-order window could not hide behind the memory reads.
inline void u7_piece_to_bf16(const uint8_t* w, char* a) {
  const __m512i exp = _mm512_set1_epi8(0x43);  // high byte of bf16 128.0: u fills its 7 mantissa bits
  for (int r = 0; r < 64; r += 2) {
    const __m512i two = _mm512_loadu_si512(w + r * 32);  // rows r, r + 1
    _mm512_store_si512(a + r * 64, _mm512_unpacklo_epi8(two, exp));
    _mm512_store_si512(a + r * 64 + 64, _mm512_unpackhi_epi8(two, exp));
  }
}

// One 64-row group's tile sums, spilled, and how many of its rows have been checked.
struct GreedySpill {
  alignas(64) float acc[4][16][16];  // acc[j][w]: W row g*64 + 16j + w over the 16 token lanes
  int64_t g = 0;
  int done = 64;
};

// The bound check of a group's rows (spill rows done..upto): each row whose upper bound reaches
// `thr` is kept; `best` takes every lower bound. x_t . (u + 128) - 192 sum(x_t) = x_t . q.
struct GreedyCheck {
  const float *s, *c;
  __m512 xabs, xsum192, best, thr;
  __mmask16 live;
  void rows(GreedySpill& sp, int upto, GreedyPart& out) {
    for (; sp.done < upto; ++sp.done) {
      const int j = sp.done / 16, w = sp.done % 16;
      const int64_t n = sp.g * 64 + sp.done;
      const __m512 approx = _mm512_mul_ps(_mm512_sub_ps(_mm512_load_ps(sp.acc[j][w]), xsum192),
                                          _mm512_set1_ps(s[n]));
      const __m512 bound = _mm512_mul_ps(xabs, _mm512_set1_ps(c[n]));
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
    rows(sp, 64, out);
    thr = _mm512_sub_ps(best, tie_margin(best));
  }
};

// A group's bound checks run 4 rows per k step of the next group's conversions and tile
// products (20 steps at K = 640), as gemm_2x2's Spill does for its epilogue. Run after each
// group, they were ~1-1.5 ms of the pass (a scratch copy of this loop, cold, with and without
// them), the reads of the stream stalled behind them; spread out, the out-of-order window
// overlaps them: benchmarks/cpu_greedy_ab.py --rev HEAD --old-layout same, 16 rows cold,
// 7.46 -> 6.80 and 7.70 -> 6.99 ms (two runs), the same candidate lists.
void greedy_rows(const uint8_t* wq, const float* s, const float* c, const float* xstat, const char* xt,
                 int64_t M, int64_t K, int64_t g0, int64_t g1, GreedyPart& out) {
  const int64_t KB = K / 32;
  const int per_step = static_cast<int>((64 + KB - 1) / KB);
  alignas(64) char ab[2][64 * 64];
  GreedySpill spill[2];
  int cur = 0;  // the spill this group's sums go to; the other is the previous group's
  GreedyCheck chk{s, c, _mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_set1_ps(-INFINITY),
                  _mm512_set1_ps(-INFINITY), static_cast<__mmask16>((1u << M) - 1)};  // token lanes in use
  for (int64_t t = 0; t < M; ++t) {
    chk.xabs[t] = xstat[t];
    chk.xsum192[t] = 192.0f * xstat[M + t];
  }
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* wg = wq + g * 64 * K;
    GreedySpill& prev = spill[cur ^ 1];
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    u7_piece_to_bf16(wg, ab[0]);
    for (int64_t kb = 0; kb < KB; ++kb) {
      const uint8_t* wk = wg + kb * 2048;  // [64 rows][32 k]
      for (int b = 0; b < 2048; b += 64)
        _mm_prefetch(reinterpret_cast<const char*>(wk) + kGreedyPrefetch + b, _MM_HINT_T1);
      // Convert the next piece before the tiles read this one: a tile load right after the
      // vector stores to its own bytes waits for them to reach L1.
      if (kb + 1 < KB) u7_piece_to_bf16(wk + 2048, ab[(kb + 1) & 1]);
      const char* a = ab[kb & 1];
      _tile_loadd(6, xt + kb * 1024, 64);
      _tile_loadd(4, a, 64);            _tile_dpbf16ps(0, 4, 6);
      _tile_loadd(5, a + 16 * 64, 64);  _tile_dpbf16ps(1, 5, 6);
      _tile_loadd(4, a + 32 * 64, 64);  _tile_dpbf16ps(2, 4, 6);
      _tile_loadd(5, a + 48 * 64, 64);  _tile_dpbf16ps(3, 5, 6);
      chk.rows(prev, std::min(64, prev.done + per_step), out);
    }
    chk.finish(prev, out);
    GreedySpill& sp = spill[cur];
    _tile_stored(0, sp.acc[0], 64); _tile_stored(1, sp.acc[1], 64);
    _tile_stored(2, sp.acc[2], 64); _tile_stored(3, sp.acc[3], 64);
    sp.g = g;
    sp.done = 0;
    cur ^= 1;
  }
  chk.finish(spill[cur ^ 1], out);
  _mm512_storeu_ps(out.best, chk.best);
}

}  // namespace flatserve::greedy
#endif
