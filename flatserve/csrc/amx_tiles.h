// What the AMX kernels share (ops/csrc/amx_gemm_cpu.cpp, attention/csrc/paged_prefill_amx.cpp):
// FLATSERVE_AMX where the build targets AMX bf16, one tile shape, and the OS grant.
#pragma once

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
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
  _tile_loadconfig(&cfg);
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
