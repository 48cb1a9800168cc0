// Maths shared by the CPU C++ kernels (flatserve/attention/csrc, flatserve/ops/csrc).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace flatserve {

// exp(x) in a form the compiler vectorises (libm's expf is a scalar call; with
// -fno-trapping-math GCC turns loops of this into AVX-512). 2^(x log2 e) = 2^i * 2^f with
// i = floor, f in [0, 1); 2^f by a degree-6 least-squares polynomial (relative error 6e-9 in
// exact arithmetic, ~1e-7 in fp32). x is clamped to [-87, 88]: exp(-87) = 1.6e-38 is still a
// normal float, and the kernels only meet larger x as softmax weights <= 1 or activations.
inline float exp_poly(float x) {
  x = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);
  const float t = x * 1.4426950408889634f;
  const float fi = std::floor(t);
  const float f = t - fi;
  float p = 2.1871262307292775e-4f;
  p = p * f + 1.2382415543543816e-3f;
  p = p * f + 9.686186289582578e-3f;
  p = p * f + 5.5478912463380964e-2f;
  p = p * f + 2.40231096761393e-1f;
  p = p * f + 6.931468377007519e-1f;
  p = p * f + 1.000000006158204f;
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

#if defined(__AVX512F__)
// exp of 16 lanes: exp_poly's polynomial with AVX-512's scalef for the 2^i (x clamped below
// at -87 as there; above, scalef saturates to inf instead of wrapping).
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.4426950408889634f));
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
#endif

}  // namespace flatserve
