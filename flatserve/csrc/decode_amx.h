// The CPU decode attention's (flatserve/attention/csrc/paged_decode_cpu.cpp) prefetch helper
// and its AMX scores for bf16 caches. Here so that the kernel's source stays within its size
// budget; only that kernel includes it.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>

#include <c10/util/BFloat16.h>

#include "amx_tiles.h"

namespace flatserve::decode {

// A block's K and V rows of one KV head, asked for ahead of use: blocks sit at random places in
// the pool, so the hardware prefetcher restarts on every one of them. Callers spread the asks
// over their score loop, a few rows at a time, instead of all 16 KB (at Gemma's head of 256) at
// once: a burst of 512 prefetches filled the core's line-fill buffers and stalled the scores
// behind them. 18 layers of a captured 16-request decode step (scratch replay, ~11 MB read
// between layers as the linears do): 9.1 -> 8.6 ms; `benchmarks/dev/cpu_decode_ab.py --layers 18
// --sequential --cold`: 12.26 -> 11.52 ms full, 7.70 -> 7.31 windowed. `l2`: into L2 only.
template <typename T>
struct Ahead {
  const T* k = nullptr;
  const T* v = nullptr;
  int64_t rs = 0, bytes = 0, rows = 0, done = 0;
  bool l2 = false;
  void upto(int64_t r) {  // rows [done, r)
    for (r = std::min(r, rows); done < r; ++done)
      for (int64_t o = 0; o < bytes; o += 64) {
        const char* kp = reinterpret_cast<const char*>(k + done * rs) + o;
        const char* vp = reinterpret_cast<const char*>(v + done * rs) + o;
        if (l2) {
          __builtin_prefetch(kp, 0, 2);
          __builtin_prefetch(vp, 0, 2);
        } else {
          __builtin_prefetch(kp);
          __builtin_prefetch(vp);
        }
      }
  }
};

#ifdef FLATSERVE_AMX
// A run's n x g query vectors (<= 16) as AMX B tiles of Q^T: for each 32-dim slice c, tile row
// p holds, for every vector v, its dims (32c + 2p, 32c + 2p + 1) as one 32-bit pair (VNNI);
// vectors past n x g are zero. qc is [n x g, d] bf16.
inline void pack_qt(const c10::BFloat16* qc, int64_t nv, int64_t d, uint32_t* qt) {
  const uint32_t* q32 = reinterpret_cast<const uint32_t*>(qc);
  std::memset(qt, 0, static_cast<size_t>(d / 32) * 256 * sizeof(uint32_t));
  for (int64_t v = 0; v < nv; ++v)
    for (int64_t e = 0; e < d / 2; ++e) qt[e * 16 + v] = q32[v * (d / 2) + e];  // e = 16 c + p
}

// Raw scores of two runs of 16 keys (K rows k0.., k1..; k1 null: k0 alone) for the packed
// vectors: S^T = K Q^T on tiles, K rows read from the cache as A tiles (16 keys x 32 dims, row
// stride rs), one C-tile chain per run sharing each Q^T tile, so the wait on a chain's products
// comes once per 32 keys; -> s0[v * ld + key], s1[v * ld + key] for v < nv. Asks for a2's and
// a3's rows between the slices. At 4 rows x 4 heads this replaces 16 x 16 x d / 32 vdpbf16ps
// per 16 keys with d / 32 tile multiplies, and a decode's 4 vectors take the same number.
template <typename Ahead_>
inline void amx_scores2(const c10::BFloat16* k0, const c10::BFloat16* k1, int64_t rs, int64_t d,
                        const uint32_t* qt, float* s0, float* s1, int64_t ld, int64_t nv, Ahead_& a2,
                        Ahead_& a3) {
  alignas(64) float ct[2][16][16];
  const int64_t nc = d / 32;
  _tile_zero(0);
  _tile_zero(3);
  for (int64_t c = 0; c < nc; ++c) {
    _tile_loadd(2, qt + c * 256, 64);
    _tile_loadd(1, k0 + c * 32, rs * 2);
    _tile_dpbf16ps(0, 1, 2);
    if (k1 != nullptr) {
      _tile_loadd(4, k1 + c * 32, rs * 2);
      _tile_dpbf16ps(3, 4, 2);
    }
    a2.upto((c + 1) * a2.rows / nc);
    a3.upto((c + 1) * a3.rows / nc);
  }
  _tile_stored(0, ct[0], 64);
  if (k1 != nullptr) _tile_stored(3, ct[1], 64);
  // ct[key][v] -> s[v][key]: vector v's 16 scores are column v of the C tile.
  const __m512i idx = _mm512_mullo_epi32(
      _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0), _mm512_set1_epi32(16));
  for (int64_t v = 0; v < nv; ++v) {
    const __m512i iv = _mm512_add_epi32(idx, _mm512_set1_epi32(static_cast<int>(v)));
    _mm512_storeu_ps(s0 + v * ld, _mm512_i32gather_ps(iv, &ct[0][0][0], 4));
    if (k1 != nullptr) _mm512_storeu_ps(s1 + v * ld, _mm512_i32gather_ps(iv, &ct[1][0][0], 4));
  }
}
#endif

}  // namespace flatserve::decode
