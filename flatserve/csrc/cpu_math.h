// Maths shared by the CPU C++ kernels (flatserve/attention/csrc, flatserve/ops/csrc).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX2__)
#include <immintrin.h>
#endif

namespace flatserve {

// exp(x) in a form the compiler vectorises (libm's expf is a scalar call; with
// -fno-trapping-math GCC turns loops of this into AVX-512). 2^(x log2 e) = 2^i * 2^f with
// i = floor, f in [0, 1); 2^f by a degree-6 least-squares polynomial (relative error 6e-9 in
// exact arithmetic, ~1e-7 in fp32). x is clamped to [-87, 88]: exp(-87) = 1.6e-38 is still a
// normal float, and the kernels only meet larger x as softmax weights <= 1 or activations.
// 2^f for f in [0, 1): the polynomial, on a float or on a vector of them (paged_prompt_cpu.cpp).
template <typename V>
inline V exp2_frac(V f) {
  V p = f * 2.1871262307292775e-4f + 1.2382415543543816e-3f;
  p = p * f + 9.686186289582578e-3f;
  p = p * f + 5.5478912463380964e-2f;
  p = p * f + 2.40231096761393e-1f;
  p = p * f + 6.931468377007519e-1f;
  return p * f + 1.000000006158204f;
}

inline float exp_poly(float x) {
  x = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);
  const float t = x * 1.4426950408889634f;
  const float fi = std::floor(t);
  const float p = exp2_frac(t - fi);
  const uint32_t bits = static_cast<uint32_t>(static_cast<int32_t>(fi) + 127) << 23;
  float s;
  std::memcpy(&s, &bits, sizeof(s));
  return p * s;
}

// 16 fp32 lanes as one value (GCC/clang vector extension): one AVX-512 register, two AVX2 ones.
typedef float f32x16 __attribute__((vector_size(64)));

// 16 bf16 values (raw bits) -> fp32 lanes: bf16 -> fp32 is a 16-bit shift.
inline f32x16 bf16x16_to_f32(const uint16_t* p) {
  typedef uint16_t u16x16 __attribute__((vector_size(32)));
  typedef uint32_t u32x16 __attribute__((vector_size(64)));
  u16x16 h;
  std::memcpy(&h, p, sizeof(h));
  const u32x16 w = __builtin_convertvector(h, u32x16) << 16;
  f32x16 f;
  std::memcpy(&f, &w, sizeof(f));
  return f;
}

#if defined(__AVX2__)
// AVX2 kernels write their 8-lane code with these intrinsics: GCC's 64-byte generic vectors
// above compile to stack round trips on AVX2.
inline __m256 widen8(const uint16_t* p) {  // 8 bf16 (raw bits) -> 8 fp32: a 16-bit shift
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline float hsum8(__m256 v) {
  const __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 t = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)));
}

// An 8 x 8 fp32 block transposed in registers: r[i] lane j becomes r[j] lane i.
inline void transpose8x8(__m256 r[8]) {
  __m256 t[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_ps(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_ps(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    r[i] = _mm256_shuffle_ps(t[i], t[i + 2], 0x44);
    r[i + 1] = _mm256_shuffle_ps(t[i], t[i + 2], 0xEE);
    r[i + 2] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0x44);
    r[i + 3] = _mm256_shuffle_ps(t[i + 1], t[i + 3], 0xEE);
  }
  // r[i]: columns i | i + 4 of rows 0-3; r[i + 4] the same of rows 4-7
  for (int i = 0; i < 4; ++i) {
    t[i] = _mm256_permute2f128_ps(r[i], r[i + 4], 0x20);
    t[i + 4] = _mm256_permute2f128_ps(r[i], r[i + 4], 0x31);
  }
  for (int i = 0; i < 8; ++i) r[i] = t[i];
}

// 16 floats -> bf16 bits as c10::BFloat16(float) rounds them: to nearest even, NaN -> 0x7FC0
// (bf16_rne below in one zmm).
inline __m256i bf16x16_rne(__m256 lo, __m256 hi) {
  const __m256i one = _mm256_set1_epi32(1), half = _mm256_set1_epi32(0x7FFF), nan = _mm256_set1_epi32(0x7FC0);
  __m256i r[2];
  const __m256 v[2] = {lo, hi};
  for (int h = 0; h < 2; ++h) {
    const __m256i u = _mm256_castps_si256(v[h]);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), one);
    r[h] = _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(lsb, half)), 16);
    r[h] = _mm256_blendv_epi8(r[h], nan, _mm256_castps_si256(_mm256_cmp_ps(v[h], v[h], _CMP_UNORD_Q)));
  }
  // packus interleaves the 128-bit halves: lo[0-3] hi[0-3] lo[4-7] hi[4-7] -> back in order
  return _mm256_permute4x64_epi64(_mm256_packus_epi32(r[0], r[1]), 0xD8);
}
#endif

#if defined(__AVX512F__)
// 16 floats -> bfloat16 bits as c10::BFloat16(float) rounds them: to nearest even, NaN -> 0x7FC0
// (bf16x16_rne above in two ymm).
inline __m256i bf16_rne(__m512 v) {
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
  r = _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7FC0));
  return _mm512_cvtepi32_epi16(r);
}

// exp of 16 lanes: exp_poly's polynomial with AVX-512's scalef for the 2^i (x clamped below
// at -87 as there; above, scalef saturates to inf instead of wrapping).
// 2^t for t >= -125.5 (t = x log2 e below); callers clamp.
inline __m512 exp2_16_unclamped(__m512 t) {
  const __m512 fi = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_sub_ps(t, fi);
  __m512 p = _mm512_set1_ps(2.1871262307292775e-4f);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.2382415543543816e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(9.686186289582578e-3f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(5.5478912463380964e-2f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(2.40231096761393e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(6.931468377007519e-1f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.000000006158204f));
  return _mm512_scalef_ps(p, fi);
}

inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  return exp2_16_unclamped(_mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f)));
}

// 2^t, t clamped below at -125.5 (exp16's -87 in base 2): for callers that fold log2 e into
// an FMA they need anyway (a softmax's scale and shift).
inline __m512 exp2_16(__m512 t) { return exp2_16_unclamped(_mm512_max_ps(t, _mm512_set1_ps(-125.5f))); }
#endif

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// x rounded to bf16 (RNE) and back to fp32 lanes.
inline __m512 round_bf16(__m512 x) {
  const __m256i b = reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}

// act(a) * u for 16 lanes of bf16-valued gate a and up u -> 16 bf16: both activations as
// a / (1 + exp(-t)), SiLU's t = a and GELU-tanh's 0.5 a (1 + tanh z) = a * sigmoid(2z), t = 2z;
// act rounded to bf16, then act * u rounded (the roundings of the torch reference). Shared by
// the fused act_and_mul (ops/csrc/fused_cpu.cpp) and the gate_up GEMM's epilogue
// (ops/csrc/amx_gemm_cpu.cpp), so the two give the same bits.
template <bool GELU>
inline __m256i act_mul_bf16x16(__m512 a, __m512 u) {
  __m512 t = a;
  if (GELU) {  // 2z = 2 * sqrt(2 / pi) * (a + 0.044715 a^3)
    const __m512 a2 = _mm512_mul_ps(a, a);
    t = _mm512_mul_ps(a, _mm512_fmadd_ps(a2, _mm512_set1_ps(2.f * 0.7978845608028654f * 0.044715f),
                                         _mm512_set1_ps(2.f * 0.7978845608028654f)));
  }
  // exp(-t) overflows to inf for t < -88, and a / inf is the signed 0 torch's division gives.
  const __m512 den = _mm512_add_ps(_mm512_set1_ps(1.f), exp16(_mm512_sub_ps(_mm512_setzero_ps(), t)));
  const __m512 act = round_bf16(_mm512_div_ps(a, den));
  return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(_mm512_mul_ps(act, u)));
}
#endif

}  // namespace flatserve
