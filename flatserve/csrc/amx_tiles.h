// What the AMX kernels share (ops/csrc/amx_gemm_cpu.cpp, attention/csrc/paged_prefill_amx.cpp):
// FLATSERVE_AMX where the build targets AMX bf16 and int8 (every AMX CPU has both), one tile
// shape, and the OS grant.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AMX_INT8__) && defined(__AVX512BF16__)
#define FLATSERVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace flatserve {

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Every tile used is 16 rows x 64 bytes: C tiles hold 16x16 fp32, A 16x32 bf16, B 16 k-pairs x 16.
inline void load_tile_config() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
  // GCC may not see _tile_loadconfig read cfg and drop the stores above (then the load faults:
  // it did in benchmarks/cpu_amx_peak.cpp); the barrier keeps them.
  asm volatile("" : : "r"(&cfg) : "memory");
  _tile_loadconfig(&cfg);
}

// 16 x 16 fp32 transpose: r[i][j] -> r[j][i] (unpack ps, unpack pd, two 128-bit lane shuffles).
inline void transpose16(__m512 r[16]) {
  __m512 a[16], b[16];
  for (int i = 0; i < 16; i += 2) {
    a[i] = _mm512_unpacklo_ps(r[i], r[i + 1]);
    a[i + 1] = _mm512_unpackhi_ps(r[i], r[i + 1]);
  }
  auto pd = [](__m512 x) { return _mm512_castps_pd(x); };
  for (int m = 0; m < 16; m += 4) {  // b[m + c], lane L: column 4L + c of rows m..m+3
    b[m] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(a[m]), pd(a[m + 2])));
    b[m + 1] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(a[m]), pd(a[m + 2])));
    b[m + 2] = _mm512_castpd_ps(_mm512_unpacklo_pd(pd(a[m + 1]), pd(a[m + 3])));
    b[m + 3] = _mm512_castpd_ps(_mm512_unpackhi_pd(pd(a[m + 1]), pd(a[m + 3])));
  }
  for (int c = 0; c < 4; ++c) {  // gather lane L of b[c], b[4 + c], b[8 + c], b[12 + c]
    const __m512 e0 = _mm512_shuffle_f32x4(b[c], b[4 + c], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512 e1 = _mm512_shuffle_f32x4(b[c], b[4 + c], _MM_SHUFFLE(3, 2, 3, 2));
    const __m512 e2 = _mm512_shuffle_f32x4(b[8 + c], b[12 + c], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512 e3 = _mm512_shuffle_f32x4(b[8 + c], b[12 + c], _MM_SHUFFLE(3, 2, 3, 2));
    r[c] = _mm512_shuffle_f32x4(e0, e2, _MM_SHUFFLE(2, 0, 2, 0));
    r[4 + c] = _mm512_shuffle_f32x4(e0, e2, _MM_SHUFFLE(3, 1, 3, 1));
    r[8 + c] = _mm512_shuffle_f32x4(e1, e3, _MM_SHUFFLE(2, 0, 2, 0));
    r[12 + c] = _mm512_shuffle_f32x4(e1, e3, _MM_SHUFFLE(3, 1, 3, 1));
  }
}

}  // namespace flatserve
#endif

namespace flatserve {

// AMX compiled in and tile state granted: Linux hands out the 8 KB tile state only on request
// (ARCH_REQ_XCOMP_PERM, XTILEDATA); the grant is process-wide, so one call covers torch's
// worker threads.
inline bool amx_available() {
#ifdef FLATSERVE_AMX
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
#else
  return false;
#endif
}

}  // namespace flatserve
