// This CPU's AMX bf16 rate: tile products with no loads, then the GEMM kernels' 2 x 2 tile loop
// (two A tiles of x rows, two B tiles of a weight half-group per k step) over a B working set
// of a given size, on 1 and 2 threads. Context for the AMX figures (docs/performance-cpu.md; the
// older ones in `git log -- docs/benchmarks/cpu.md`): how far the engine's GEMMs and attention
// are from what the tile unit can do, and where the data must sit for it.
//
//     g++ -O2 -march=native -fopenmp benchmarks/dev/cpu_amx_peak.cpp -o /tmp/amx_peak && /tmp/amx_peak
#include <immintrin.h>
#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>

struct alignas(64) Cfg {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

static void tiles_on() {
  Cfg c;
  for (int t = 0; t < 8; ++t) { c.rows[t] = 16; c.colsb[t] = 64; }
  // GCC does not see _tile_loadconfig read `c` and dropped the stores above (a #GP on load).
  asm volatile("" : : "r"(&c) : "memory");
  _tile_loadconfig(&c);
}

constexpr double kFlops = 2.0 * 16 * 16 * 32;  // one TDPBF16PS

// Four independent tile products per iteration, operands already in tiles.
static void registers_only(int threads) {
  const long iters = 2000000;
  alignas(64) static char buf[4096] = {};
  const double t0 = omp_get_wtime();
#pragma omp parallel num_threads(threads)
  {
    tiles_on();
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    _tile_loadd(4, buf, 64); _tile_loadd(5, buf + 1024, 64);
    _tile_loadd(6, buf + 2048, 64); _tile_loadd(7, buf + 3072, 64);
    for (long i = 0; i < iters; ++i) {
      _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
    }
    _tile_release();
  }
  const double dt = omp_get_wtime() - t0;
  std::printf("registers only, %d thread(s): %.2f TFLOP/s\n", threads, 4.0 * iters * threads * kFlops / dt / 1e12);
}

// 32 rows of x (K wide, row stride 2K bytes) against `halves` B half-groups cycled in turn
// (each K/32 k steps x 2 KB), the C tiles stored after each half as the GEMM's epilogue does.
static void two_by_two(int K, long halves, int threads) {
  const int KB = K / 32;
  const long units = 200000000L / (KB * 4) / 50;
  long dps = 0;
  const double t0 = omp_get_wtime();
#pragma omp parallel num_threads(threads) reduction(+ : dps)
  {
    tiles_on();
    char* A = static_cast<char*>(std::aligned_alloc(64, 32L * K * 2));
    char* B = static_cast<char*>(std::aligned_alloc(64, halves * KB * 2048));
    std::memset(A, 1, 32L * K * 2);
    std::memset(B, 1, halves * KB * 2048);
    alignas(64) float c[4][256];
    for (long u = 0; u < units;) {
      for (long h = 0; h < halves && u < units; ++h, ++u) {
        const char* b = B + h * KB * 2048;
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int kb = 0; kb < KB; ++kb) {
          _tile_loadd(4, A + kb * 64, K * 2);
          _tile_loadd(6, b + kb * 2048, 64);        _tile_dpbf16ps(0, 4, 6);
          _tile_loadd(7, b + kb * 2048 + 1024, 64); _tile_dpbf16ps(1, 4, 7);
          _tile_loadd(5, A + 16L * K * 2 + kb * 64, K * 2);
          _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, c[0], 64); _tile_stored(1, c[1], 64);
        _tile_stored(2, c[2], 64); _tile_stored(3, c[3], 64);
        dps += 4L * KB;
      }
    }
    _tile_release();
    std::free(A);
    std::free(B);
  }
  const double dt = omp_get_wtime() - t0;
  std::printf("2x2 loop, K %4d, B working set %6ld KB, %d thread(s): %.2f TFLOP/s\n", K,
              halves * KB * 2, threads, dps * kFlops / dt / 1e12);
}

int main() {
  if (syscall(SYS_arch_prctl, 0x1023, 18) != 0) {  // ARCH_REQ_XCOMP_PERM, XTILEDATA
    std::printf("no AMX tile state granted here\n");
    return 1;
  }
  for (int t = 1; t <= 2; ++t) registers_only(t);
  const struct { int K; long halves; } cases[] = {{640, 1}, {640, 8}, {320, 16}, {2048, 4}, {640, 64}, {640, 1024}};
  for (const auto& c : cases)
    for (int t = 1; t <= 2; ++t) two_by_two(c.K, c.halves, t);
}
