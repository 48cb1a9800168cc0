// The VNNI tiles' inner loop (csrc/quant_vnni.h, rows8 / dots8) alone, from L1: ns per
// instruction for `vpdpwssd` against `vpmaddwd` + `vpaddd`, each with a broadcast pair of weight
// codes, 8 weight rows x 16 pairs x 20 blocks. docs/performance-cpu.md ("AVX-512 (AMD EPYC, Zen
// 4)") quotes it for the kernel's floor.
//
//   g++ -O2 -mavx512f -mavx512bw -mavx512vnni -o /tmp/cpu_vnni_loop benchmarks/dev/cpu_vnni_loop.cpp
//   /tmp/cpu_vnni_loop
#include <immintrin.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>

alignas(64) int16_t X[512 * 20];
alignas(64) int16_t W[16 * 640];

template <bool dpwssd>
__attribute__((noinline)) void run(long reps, __m512i* out) {
  __m512i S[8];
  for (int i = 0; i < 8; ++i) S[i] = _mm512_setzero_si512();
  for (long n = 0; n < reps; ++n) {
    for (int b = 0; b < 20; ++b) {
      const int16_t* xb = X + 512 * b;
      const int16_t* wr[8];
      for (int i = 0; i < 8; ++i) wr[i] = W + i * 640 + 32 * b;
#pragma GCC unroll 16
      for (int j = 0; j < 16; ++j) {
        const __m512i x = _mm512_load_si512(xb + 32 * j);
#pragma GCC unroll 8
        for (int i = 0; i < 8; ++i) {
          int32_t p;
          std::memcpy(&p, wr[i] + 2 * j, 4);
          if constexpr (dpwssd) S[i] = _mm512_dpwssd_epi32(S[i], x, _mm512_set1_epi32(p));
          else S[i] = _mm512_add_epi32(S[i], _mm512_madd_epi16(x, _mm512_set1_epi32(p)));
        }
      }
    }
  }
  for (int i = 0; i < 8; ++i) out[i] = S[i];
}

int main() {
  __m512i o[8];
  const long reps = 200000;
  const double ops = double(reps) * 20 * 16 * 8;
  for (int round = 0; round < 2; ++round) {
    auto t0 = std::chrono::steady_clock::now();
    run<true>(reps, o);
    auto t1 = std::chrono::steady_clock::now();
    run<false>(reps, o);
    auto t2 = std::chrono::steady_clock::now();
    std::printf("vpdpwssd %.3f ns an op, vpmaddwd + vpaddd %.3f ns an op\n",
                std::chrono::duration<double>(t1 - t0).count() / ops * 1e9,
                std::chrono::duration<double>(t2 - t1).count() / ops * 1e9);
  }
}
