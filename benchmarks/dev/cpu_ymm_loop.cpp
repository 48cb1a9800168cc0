// The prompt tiles' inner loop in 256-bit lanes (csrc/quant_tiles_ymm.h: dots + rows_r's per-block
// scaling, 6 + 6 + 4 weight rows with AVX-VNNI, 4 x 4 without) alone from L1, against the
// multiply instruction's own issue rate (12 independent chains): a ceiling for the tiles'
// calls, quoted in docs/performance-cpu.md (floor, gap and cause at 16 streams). One core.
//
//   g++ -O3 -mavx2 -mfma -mf16c -mavxvnni -o /tmp/cpu_ymm_loop benchmarks/dev/cpu_ymm_loop.cpp   # vpdpwssd
//   g++ -O3 -mavx2 -mfma -mf16c -o /tmp/cpu_ymm_loop benchmarks/dev/cpu_ymm_loop.cpp             # vpmaddwd + vpaddd
//   (add -mavx512f -mavx512vl to the first for the issue-rate line; take the tiles' lines from the
//   build without it, whose code is the kernel's: with it GCC 12 compiled the loop ~20% slower)
//   /tmp/cpu_ymm_loop
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>

#if defined(__AVXVNNI__)
constexpr int R1 = 6;  // rows a step, as quant_tiles_ymm.h's RMAX
#define DOT(S, x, w) S = _mm256_dpwssd_avx_epi32(S, x, w)
#else
constexpr int R1 = 4;
#define DOT(S, x, w) S = _mm256_add_epi32(S, _mm256_madd_epi16(x, w))
#endif

static inline __m256i ld(const void* p) { return _mm256_loadu_si256(static_cast<const __m256i*>(p)); }

template <int R, bool SCALE>
__attribute__((noinline)) void rows_r(const int16_t* w16, const float* sc, const int16_t* X, const float* XD,
                                      int nb, float acc[][16]) {
  for (int i = 0; i < R; ++i) std::fill(acc[i], acc[i] + 16, 0.f);
  for (int b = 0; b < nb; ++b) {
    const int16_t* xb = X + b * 512;
    __m256i S[R][2];
    for (int i = 0; i < R; ++i) S[i][0] = S[i][1] = _mm256_setzero_si256();
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) {
      const __m256i x0 = ld(xb + 32 * j), x1 = ld(xb + 32 * j + 16);
#pragma GCC unroll 6
      for (int i = 0; i < R; ++i) {
        int32_t pair;
        std::memcpy(&pair, w16 + i * 640 + 32 * b + 2 * j, 4);
        const __m256i w = _mm256_set1_epi32(pair);
        DOT(S[i][0], x0, w);
        DOT(S[i][1], x1, w);
      }
#if !defined(__AVXVNNI__)
      for (int i = 0; i < R; ++i) __asm__ volatile("" : "+x"(S[i][0]), "+x"(S[i][1]));
#endif
    }
    const __m256 xd0 = _mm256_loadu_ps(XD + b * 16), xd1 = _mm256_loadu_ps(XD + b * 16 + 8);
    for (int i = 0; i < R; ++i) {
      __m256 c0, c1;
      if (SCALE) {  // rows_r's float operations
        const __m256 s = _mm256_set1_ps(sc[2 * b * 16 + i]);
        c0 = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(S[i][0]), s), xd0, _mm256_loadu_ps(acc[i]));
        c1 = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_cvtepi32_ps(S[i][1]), s), xd1, _mm256_loadu_ps(acc[i] + 8));
      } else {  // only kept live
        c0 = _mm256_add_ps(_mm256_loadu_ps(acc[i]), _mm256_castsi256_ps(S[i][0]));
        c1 = _mm256_add_ps(_mm256_loadu_ps(acc[i] + 8), _mm256_castsi256_ps(S[i][1]));
      }
      _mm256_storeu_ps(acc[i], c0);
      _mm256_storeu_ps(acc[i] + 8, c1);
    }
  }
}

alignas(64) int16_t W16[16 * 640];
alignas(64) int16_t X[20 * 512];
alignas(64) float XD[20 * 16], SC[40 * 16];

template <bool SCALE>
void tiles(const char* name) {
  alignas(32) float acc[16][16];
  double sink = 0;
  const long reps = 200000;
  const auto t0 = std::chrono::steady_clock::now();
  for (long n = 0; n < reps; ++n) {  // 16 weight rows x 16 activation rows x K = 640
    for (int r0 = 0; r0 < 16;) {
      const int r = 16 - r0 >= R1 ? R1 : 4;
      if (r == 6) rows_r<6, SCALE>(W16 + r0 * 640, SC + r0, X, XD, 20, acc + r0);
      else rows_r<4, SCALE>(W16 + r0 * 640, SC + r0, X, XD, 20, acc + r0);
      r0 += r;
    }
    sink += acc[0][0];
  }
  const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() / reps;
  std::printf("%-26s %7.1f ns per 16 x 16 x 640, %.2f multiplies a ns (%g)\n", name, ns, 16 * 20 * 2 * 16 / ns, sink);
}

// The multiply's issue rate: 12 independent chains of 256-bit vpdpwssd. Built only with
// -mavx512vl added (a CPU with AVX-512): with 16 ymm registers GCC 12 stored the chains to the
// stack every step and the loop measured its stores, not the multiply.
#if defined(__AVXVNNI__) && defined(__AVX512VL__)
void peak() {
  __m256i S[12];
  for (int i = 0; i < 12; ++i) S[i] = _mm256_set1_epi32(i);
  __m256i x0 = _mm256_set1_epi16(3), x1 = _mm256_set1_epi16(7);
  const long reps = 100000000;
  const auto t0 = std::chrono::steady_clock::now();
  for (long n = 0; n < reps; ++n) {
    __asm__ volatile("" : "+x"(x0), "+x"(x1));
#pragma GCC unroll 12
    for (int i = 0; i < 12; ++i) S[i] = _mm256_dpwssd_avx_epi32(S[i], x0, x1);
  }
  const double ns = std::chrono::duration<double, std::nano>(std::chrono::steady_clock::now() - t0).count() / reps;
  int s = 0;
  for (int i = 0; i < 12; ++i) s += _mm256_extract_epi32(S[i], 0);
  std::printf("%-26s %.2f multiplies a ns (%d)\n", "issue rate, 12 chains", 12 / ns, s);
}
#else
void peak() {}
#endif

int main() {
  for (int i = 0; i < 16 * 640; ++i) W16[i] = static_cast<int16_t>((i * 7) % 15 - 7);
  for (int i = 0; i < 20 * 512; ++i) X[i] = static_cast<int16_t>((i * 13) % 2001 - 1000);
  std::fill(XD, XD + 20 * 16, 0.01f);
  std::fill(SC, SC + 40 * 16, 0.5f);
  std::printf("%s\n", R1 == 6 ? "vpdpwssd (AVX-VNNI)" : "vpmaddwd + vpaddd (AVX2)");
  peak();
  tiles<true>("tiles' loop with scaling");
  tiles<false>("tiles' loop, no scaling");
}
