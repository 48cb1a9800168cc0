// Fused element-wise ops for the CPU path: the counterparts of flatserve/ops/triton_ops.py.
//
// Why: in bf16 every torch op is its own pass over memory with a conversion each way; a Gemma
// prefill step spent about half its time in them (RMSNorm alone is cast, pow, mean, add, rsqrt,
// mul, mul, cast; the git history of docs/benchmarks/cpu.md). Each function here reads its rows once,
// works in fp32, and rounds to the model dtype exactly where the torch layer rounds, so it
// matches the torch reference up to summation order (tests/test_fused_ops_cpu.py).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_math.h"

namespace {

// Loads, stores and rounding per storage type, all inline and branch-free so the row loops
// vectorise (a runtime dtype switch inside them kept them scalar: 2x slower than torch).
template <typename T> struct Cv;
template <> struct Cv<float> {
  static float ld(const float* p, int64_t i) { return p[i]; }
  static float rnd(float x) { return x; }
  static void st(float* p, int64_t i, float x) { p[i] = x; }
};
template <> struct Cv<at::BFloat16> {
  static float ld(const at::BFloat16* p, int64_t i) {
    const uint32_t b = static_cast<uint32_t>(reinterpret_cast<const uint16_t*>(p)[i]) << 16;
    float x;
    std::memcpy(&x, &b, 4);
    return x;
  }
  // Round to nearest even on the bits (as a torch op storing a bf16 result); finite values.
  static float rnd(float x) {
    uint32_t b;
    std::memcpy(&b, &x, 4);
    b = (b + 0x7FFFu + ((b >> 16) & 1u)) & 0xFFFF0000u;
    std::memcpy(&x, &b, 4);
    return x;
  }
  static void st(at::BFloat16* p, int64_t i, float x) {  // x already rounded: keep the top half
    uint32_t b;
    std::memcpy(&b, &x, 4);
    reinterpret_cast<uint16_t*>(p)[i] = static_cast<uint16_t>(b >> 16);
  }
};
template <> struct Cv<at::Half> {
  static float ld(const at::Half* p, int64_t i) { return static_cast<float>(p[i]); }
  static float rnd(float x) { return static_cast<float>(static_cast<at::Half>(x)); }
  static void st(at::Half* p, int64_t i, float x) { p[i] = static_cast<at::Half>(x); }
};

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// Lanes k of 16 bf16 values -> fp32 (the others 0).
inline __m512 bf16_lanes(const uint16_t* p, __mmask16 k) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(k, p)), 16));
}
// bf16 RMSNorm and q/k norm + rotary rows in 16-lane vectors (norm_row and rope_head hand them
// over), with the generic loops' roundings (the sum of squares in 16 lanes, then one
// reduction). GCC kept those loops on 256-bit vectors with scalar reductions and remainders; a
// prompt step's q/k norm + rotary took ~0.9 ms a layer at 2,016 tokens (~2 cycles an element,
// cpu_profile_step.py 16 --generate).
using flatserve::round_bf16;

// 16 bf16 values (unaligned, all lanes) -> fp32; 16 fp32 values -> bf16, rounded to nearest even.
inline __m256i bf16_pack(__m512 x) { return reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(x)); }
inline __m512 bf16_unpack(__m256i b) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(b), 16));
}
inline __m512 bf16_load(const uint16_t* p) {
  return bf16_unpack(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// norm_row for bf16 rows of n % 16 == 0, the weight given as fp32 `wf` (1 + w with the offset,
// else w: the same fp32 value the generic loop forms per element, made once per call). Each
// rounded value is packed once and both stored and unpacked from that; the generic maths and
// bits. Against unpacking w per row and packing twice: fewer instructions where a prompt step's
// norms run 2,048 rows x 640 (benchmarks/dev/cpu_fused_ops.py --rev).
void norm_row_bf16(const at::BFloat16* x_, at::BFloat16* r_, const float* wf, at::BFloat16* y_,
                   int64_t n, float eps, bool offset, float* buf) {
  const uint16_t* x = reinterpret_cast<const uint16_t*>(x_);
  uint16_t* r = reinterpret_cast<uint16_t*>(r_);
  uint16_t* y = reinterpret_cast<uint16_t*>(y_);
  __m512 ss = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; i += 16) {
    __m512 v = bf16_load(x + i);
    if (r != nullptr) {
      const __m256i p = bf16_pack(_mm512_add_ps(v, bf16_load(r + i)));  // torch's add rounds once
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(r + i), p);
      v = bf16_unpack(p);
    }
    _mm512_storeu_ps(buf + i, v);
    ss = _mm512_fmadd_ps(v, v, ss);
  }
  const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(ss) / static_cast<float>(n) + eps));
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(buf + i), inv);
    const __m512 w = _mm512_loadu_ps(wf + i);
    const __m256i out = offset ? bf16_pack(_mm512_mul_ps(v, w))
                               : bf16_pack(_mm512_mul_ps(w, bf16_unpack(bf16_pack(v))));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + i), out);
  }
}

// rope_head for bf16 heads of half % 16 == 0; wf: the norm weight as fp32 (1 + w with the
// offset), made once a call, as norm_row_bf16 takes it. The results are packed to bf16 once.
void rope_head_bf16(at::BFloat16* h_, const float* wf, const float* cosp, const float* sinp,
                    int64_t half, float eps, bool norm, bool offset, float* buf) {
  uint16_t* h = reinterpret_cast<uint16_t*>(h_);
  const int64_t d = 2 * half;
  __m512 ss = _mm512_setzero_ps();
  for (int64_t i = 0; i < d; i += 16) {
    const __m512 v = bf16_load(h + i);
    _mm512_storeu_ps(buf + i, v);
    ss = _mm512_fmadd_ps(v, v, ss);
  }
  if (norm) {
    const float mean = _mm512_reduce_add_ps(ss) / static_cast<float>(d);
    const __m512 inv = _mm512_set1_ps(1.f / std::sqrt(mean + eps));
    for (int64_t i = 0; i < d; i += 16) {
      const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(buf + i), inv), w = _mm512_loadu_ps(wf + i);
      _mm512_storeu_ps(buf + i, offset ? round_bf16(_mm512_mul_ps(v, w))
                                       : round_bf16(_mm512_mul_ps(w, round_bf16(v))));
    }
  }
  for (int64_t i = 0; i < half; i += 16) {
    const __m512 c = round_bf16(_mm512_loadu_ps(cosp + i)), s = round_bf16(_mm512_loadu_ps(sinp + i));
    const __m512 x1 = _mm512_loadu_ps(buf + i), x2 = _mm512_loadu_ps(buf + half + i);
    // rnd(x1 c) + rnd(-x2 s) == rnd(x1 c) - rnd(x2 s): RNE is symmetric
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(h + i), bf16_pack(_mm512_sub_ps(
                            round_bf16(_mm512_mul_ps(x1, c)), round_bf16(_mm512_mul_ps(x2, s)))));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(h + half + i), bf16_pack(_mm512_add_ps(
                            round_bf16(_mm512_mul_ps(x2, c)), round_bf16(_mm512_mul_ps(x1, s)))));
  }
}
#endif

// One row: [r += x]; y = norm(r or x) (w * round(x * inv), or round(x * inv * (1 + w))).
// wf: the weight as fp32 (1 + w with the offset), for the bf16 rows' vector path; or null.
template <typename T>
void norm_row(const T* x, T* r, const T* w, T* y, int64_t n, float eps, bool offset, float* buf,
              const float* wf = nullptr) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (wf != nullptr) return norm_row_bf16(x, r, wf, y, n, eps, offset, buf);
  }
#endif
  using C = Cv<T>;
  float ss = 0.f;
  if (r != nullptr) {
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < n; ++i) {
      const float v = C::rnd(C::ld(x, i) + C::ld(r, i));  // torch's add rounds once
      buf[i] = v;
      ss += v * v;
    }
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) C::st(r, i, buf[i]);
  } else {
#pragma omp simd reduction(+ : ss)
    for (int64_t i = 0; i < n; ++i) {
      buf[i] = C::ld(x, i);
      ss += buf[i] * buf[i];
    }
  }
  const float inv = 1.f / std::sqrt(ss / static_cast<float>(n) + eps);
  if (offset) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) C::st(y, i, C::rnd(buf[i] * inv * (1.f + C::ld(w, i))));
  } else {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) C::st(y, i, C::rnd(C::ld(w, i) * C::rnd(buf[i] * inv)));
  }
}

// A norm weight [n] as the bf16 vector paths take it: fp32, 1 + w with the offset (the value the
// generic loops form per element), zeros for no weight; empty for other dtypes, for rows the
// vector path does not take (`fits` false), or without AVX512-BF16.
template <typename T>
std::vector<float> vector_weight(const T* w, int64_t n, bool offset, bool fits) {
  std::vector<float> out;
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  if (!std::is_same_v<T, at::BFloat16> || !fits) return out;
  out.assign(n, 0.f);
  for (int64_t i = 0; w != nullptr && i < n; ++i)
    out[i] = offset ? 1.f + static_cast<float>(w[i]) : static_cast<float>(w[i]);
#endif
  return out;
}

// y = norm(x) with w, or with residual r: r += x first and y = norm(r). With w2 (the pair):
// t = norm(x) with w rounded to T as a call would store it, then r += t and y = norm(r) with w2,
// t never leaving the row buffer (Gemma's post-attention norm, then the pre-MLP norm of the
// running sum; or a layer's post-MLP norm, then the next layer's input norm).
template <typename T>
void rms_norm_t(const at::Tensor& x, const at::Tensor& w, const at::Tensor* w2, at::Tensor& y,
                at::Tensor* res, double eps, bool offset) {
  const int64_t N = x.size(0), H = x.size(1);
  const T* xp = x.data_ptr<T>();
  const T* wp = w.data_ptr<T>();
  const T* w2p = w2 != nullptr ? w2->data_ptr<T>() : nullptr;
  T* yp = y.data_ptr<T>();
  T* rp = res != nullptr ? res->data_ptr<T>() : nullptr;
  const int64_t sx = x.stride(0), sr = res != nullptr ? res->stride(0) : 0;
  const float e = static_cast<float>(eps);
  // The bf16 vector path's fp32 weights (empty where the generic loop runs).
  const std::vector<float> wf = vector_weight<T>(wp, H, offset, H % 16 == 0);
  const std::vector<float> wf2 = w2p ? vector_weight<T>(w2p, H, offset, H % 16 == 0) : std::vector<float>();
  auto ptr = [](const std::vector<float>& v) { return v.empty() ? nullptr : v.data(); };
  at::parallel_for(0, N, 16, [&](int64_t b, int64_t end) {
    std::vector<float> buf(H);
    std::vector<T> mid(w2p != nullptr ? H : 0);
    auto row = [&](const T* in, T* r, const T* wr, const float* f, T* out) {
      norm_row<T>(in, r, wr, out, H, e, offset, buf.data(), f);
    };
    for (int64_t i = b; i < end; ++i) {
      T* r = rp ? rp + i * sr : nullptr;
      if (w2p == nullptr) {
        row(xp + i * sx, r, wp, ptr(wf), yp + i * H);
      } else {
        row(xp + i * sx, nullptr, wp, ptr(wf), mid.data());
        row(mid.data(), r, w2p, ptr(wf2), yp + i * H);
      }
    }
  });
}

template <typename T, bool GELU>
void act_row(const T* g, const T* u, T* y, int64_t I) {
  using C = Cv<T>;
#pragma omp simd
  for (int64_t i = 0; i < I; ++i) {
    const float a = C::ld(g, i);
    float act;
    if (GELU) {  // tanh approximation; tanh(z) = 1 - 2 / (exp(2z) + 1)
      const float z = 0.7978845608028654f * (a + 0.044715f * a * a * a);
      act = 0.5f * a * (2.f - 2.f / (flatserve::exp_poly(2.f * z) + 1.f));
    } else {  // silu = a * sigmoid(a), sigmoid from e = exp(-|a|) <= 1 on both sides of 0
      // (exact-form a / (1 + exp(-a)) compiled to masked divisions that ran 5x slower in bf16:
      // benchmarks/dev/cpu_fused_ops.py, 2,048 rows bf16: 8.4 -> 1.7 ms, torch 2.3; a - a / (exp(a) + 1)
      // was as fast but cancels for a < 0).
      const float e = flatserve::exp_poly(-std::fabs(a));
      const float r = 1.f / (1.f + e);
      act = a * (a >= 0.f ? r : e * r);
    }
    C::st(y, i, C::rnd(C::rnd(act) * C::ld(u, i)));
  }
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// bf16 rows in AVX-512 intrinsics, both activations as a / (1 + exp(-t)): SiLU's t = a, and
// GELU-tanh's 0.5 a (1 + tanh z) = a * sigmoid(2z), t = 2z. GELU was 10% of the prompt steps
// at 16 requests (cpu_profile_step.py --by-kernel --prefill); benchmarks/dev/cpu_fused_ops.py, 2,048
// rows: GELU 2.13 -> 1.31 ms, SiLU 1.58 -> 1.04. A reciprocal (rcp14 + one Newton step) instead
// of the division was 1.05 / 0.97 ms but flipped more bf16 roundings against torch's division:
// an act one ulp off becomes two in act * up, past the tests' bar.
// Same roundings as the generic path: act to bf16, then act * up to bf16 (RNE, cvtneps).
template <bool GELU>
void act_row_bf16(const uint16_t* g, const uint16_t* u, uint16_t* y, int64_t I) {
  for (int64_t i = 0; i < I; i += 16) {
    const __mmask16 k = I - i >= 16 ? static_cast<__mmask16>(0xFFFF)
                                    : static_cast<__mmask16>((1u << (I - i)) - 1);
    const __m256i out = flatserve::act_mul_bf16x16<GELU>(bf16_lanes(g + i, k), bf16_lanes(u + i, k));
    _mm256_mask_storeu_epi16(y + i, k, out);
  }
}
#endif

template <typename T>
void act_mul_t(const at::Tensor& x, at::Tensor& y, bool gelu) {
  const int64_t N = x.size(0), I = x.size(1) / 2, sx = x.stride(0);
  const T* xp = x.data_ptr<T>();
  T* yp = y.data_ptr<T>();
  at::parallel_for(0, N, 4, [&](int64_t b, int64_t e) {
    for (int64_t row = b; row < e; ++row) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, at::BFloat16>) {
        const uint16_t* g = reinterpret_cast<const uint16_t*>(xp + row * sx);
        uint16_t* o = reinterpret_cast<uint16_t*>(yp + row * I);
        if (gelu) act_row_bf16<true>(g, g + I, o, I);
        else act_row_bf16<false>(g, g + I, o, I);
        continue;
      }
#endif
      if (gelu) act_row<T, true>(xp + row * sx, xp + row * sx + I, yp + row * I, I);
      else act_row<T, false>(xp + row * sx, xp + row * sx + I, yp + row * I, I);
    }
  });
}

// In place on one head [2 * half]: optional RMSNorm, then neox rotary from cos/sin rows.
template <typename T>
void rope_head(T* h, const T* w, const float* cosp, const float* sinp, int64_t half, float eps,
               bool norm, bool offset, float* buf, const float* wf = nullptr) {
#if defined(__AVX512F__) && defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (wf != nullptr) return rope_head_bf16(h, wf, cosp, sinp, half, eps, norm, offset, buf);
  }
#endif
  using C = Cv<T>;
  const int64_t d = 2 * half;
  float ss = 0.f;
#pragma omp simd reduction(+ : ss)
  for (int64_t i = 0; i < d; ++i) {
    buf[i] = C::ld(h, i);
    ss += buf[i] * buf[i];
  }
  if (norm) {
    const float inv = 1.f / std::sqrt(ss / static_cast<float>(d) + eps);
    if (offset) {
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) buf[i] = C::rnd(buf[i] * inv * (1.f + C::ld(w, i)));
    } else {
#pragma omp simd
      for (int64_t i = 0; i < d; ++i) buf[i] = C::rnd(C::ld(w, i) * C::rnd(buf[i] * inv));
    }
  }
#pragma omp simd
  for (int64_t i = 0; i < half; ++i) {
    const float c = C::rnd(cosp[i]), s = C::rnd(sinp[i]);  // torch casts the table first
    const float x1 = buf[i], x2 = buf[half + i];
    C::st(h, i, C::rnd(C::rnd(x1 * c) + C::rnd(-x2 * s)));
    C::st(h, half + i, C::rnd(C::rnd(x2 * c) + C::rnd(x1 * s)));
  }
}

template <typename T>
void qk_rope_t(at::Tensor& q, at::Tensor& k, const at::Tensor& pos, const at::Tensor& cs,
               const at::Tensor& qw, const at::Tensor& kw, double eps, bool norm, bool offset) {
  const int64_t T_ = q.size(0), Hq = q.size(1), Hk = k.size(1), d = q.size(2), P = cs.size(1);
  T* qp = q.data_ptr<T>();
  T* kp = k.data_ptr<T>();
  const int64_t* pp = pos.data_ptr<int64_t>();
  const float* cp = cs.data_ptr<float>();
  const T* qwp = norm ? qw.data_ptr<T>() : nullptr;
  const T* kwp = norm ? kw.data_ptr<T>() : nullptr;
  // The bf16 vector path's fp32 norm weights (zeros without the norm; empty where the generic
  // loop runs).
  const std::vector<float> qv = vector_weight<T>(qwp, d, offset, d % 32 == 0);
  const std::vector<float> kv = vector_weight<T>(kwp, d, offset, d % 32 == 0);
  const float* qwf = qv.empty() ? nullptr : qv.data();
  const float* kwf = kv.empty() ? nullptr : kv.data();
  at::parallel_for(0, T_, 8, [&](int64_t b, int64_t e) {
    std::vector<float> buf(d);
    for (int64_t t = b; t < e; ++t) {
      const float* cosp = cp + pp[t] * d;
      const float* sinp = cp + (P + pp[t]) * d;
      for (int64_t h = 0; h < Hq; ++h)
        rope_head<T>(qp + t * q.stride(0) + h * q.stride(1), qwp, cosp, sinp, d / 2,
                     static_cast<float>(eps), norm, offset, buf.data(), qwf);
      for (int64_t h = 0; h < Hk; ++h)
        rope_head<T>(kp + t * k.stride(0) + h * k.stride(1), kwp, cosp, sinp, d / 2,
                     static_cast<float>(eps), norm, offset, buf.data(), kwf);
    }
  });
}

#define DISPATCH(dt, CALL)                                                               \
  switch (dt) {                                                                          \
    case at::kFloat: { using T = float; CALL; break; }                                   \
    case at::kBFloat16: { using T = at::BFloat16; CALL; break; }                         \
    case at::kHalf: { using T = at::Half; CALL; break; }                                 \
    default: TORCH_CHECK(false, "fused CPU ops: dtype must be float32, bfloat16 or float16"); \
  }

// Row argmax, torch.max(dim=-1).indices' rule: the largest value, NaN above everything, the
// first index among equals. 16 lanes each keep their own best (value, index); a lane only moves
// on a strictly better value, so each keeps its first index, and the lanes are merged by index.
using vf16 = flatserve::f32x16;
typedef int32_t vi16 __attribute__((vector_size(64)));

template <typename T>
inline vf16 load16(const T* p) {
  vf16 v;
  for (int k = 0; k < 16; ++k) v[k] = Cv<T>::ld(p, k);
  return v;
}
template <>
inline vf16 load16(const at::BFloat16* p) {
  return flatserve::bf16x16_to_f32(reinterpret_cast<const uint16_t*>(p));
}

struct Best {
  float v;
  int64_t i;
};
inline bool better(float v, int64_t i, const Best& b) {  // (v, i) beats b under the rule above
  if (v != v) return b.v == b.v || i < b.i;
  if (b.v != b.v) return false;
  return v > b.v || (v == b.v && i < b.i);
}

#if defined(__AVX2__) && !defined(__AVX512F__)
// AVX2: the same 16 lanes as two __m256 with intrinsics. GCC's 64-byte generic vectors above
// compiled to stack round trips on AVX2: 16 rows of 262k bf16 values took 11.5 ms, slower than
// torch's 4.6; 0.47 ms with these (`benchmarks/dev/cpu_argmax.py`, 2-core AMD EPYC, 2026-11-26).
inline __m256 ld8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 ld8(const at::BFloat16* p) { return flatserve::widen8(reinterpret_cast<const uint16_t*>(p)); }
// Lanes where v beats best under the rule (greater, or NaN over a number).
inline __m256 beats(__m256 v, __m256 best) {
  return _mm256_or_ps(_mm256_cmp_ps(v, best, _CMP_GT_OQ),
                      _mm256_and_ps(_mm256_cmp_ps(v, v, _CMP_UNORD_Q), _mm256_cmp_ps(best, best, _CMP_ORD_Q)));
}
template <typename T>
Best scan_avx2(const T* p, int64_t lo, int64_t hi, int64_t& i) {
  __m256 b0 = ld8(p + lo), b1 = ld8(p + lo + 8);
  const __m256i l0 = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), l1 = _mm256_setr_epi32(8, 9, 10, 11, 12, 13, 14, 15);
  __m256 i0 = _mm256_castsi256_ps(l0), i1 = _mm256_castsi256_ps(l1);  // lane indices as bits
  for (i = lo + 16; i + 16 <= hi; i += 16) {
    const __m256i off = _mm256_set1_epi32(static_cast<int32_t>(i - lo));
    const __m256 v0 = ld8(p + i), v1 = ld8(p + i + 8);
    const __m256 m0 = beats(v0, b0), m1 = beats(v1, b1);
    b0 = _mm256_blendv_ps(b0, v0, m0);
    b1 = _mm256_blendv_ps(b1, v1, m1);
    i0 = _mm256_blendv_ps(i0, _mm256_castsi256_ps(_mm256_add_epi32(l0, off)), m0);
    i1 = _mm256_blendv_ps(i1, _mm256_castsi256_ps(_mm256_add_epi32(l1, off)), m1);
  }
  float bv[16];
  int32_t iv[16];
  _mm256_storeu_ps(bv, b0);
  _mm256_storeu_ps(bv + 8, b1);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(iv), _mm256_castps_si256(i0));
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(iv + 8), _mm256_castps_si256(i1));
  Best b{bv[0], lo + iv[0]};
  for (int k = 1; k < 16; ++k)
    if (better(bv[k], lo + iv[k], b)) b = Best{bv[k], lo + iv[k]};
  return b;
}
#endif

template <typename T>
Best scan(const T* p, int64_t lo, int64_t hi) {
  Best b{Cv<T>::ld(p, lo), lo};
  int64_t i = lo;
#if defined(__AVX2__) && !defined(__AVX512F__)
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, at::BFloat16>) {
    if (hi - lo >= 16) b = scan_avx2<T>(p, lo, hi, i);
    for (; i < hi; ++i) {
      const float v = Cv<T>::ld(p, i);
      if (better(v, i, b)) b = Best{v, i};
    }
    return b;
  }
#endif
  if (hi - lo >= 16) {
    vf16 best = load16(p + lo);
    vi16 idx = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
    const vi16 lane = idx;
    for (i = lo + 16; i + 16 <= hi; i += 16) {
      const vf16 v = load16(p + i);
      const vi16 m = (v > best) | ((v != v) & (best == best));
      best = m ? v : best;
      idx = m ? lane + static_cast<int32_t>(i - lo) : idx;
    }
    b = Best{best[0], lo + idx[0]};
    for (int k = 1; k < 16; ++k)
      if (better(best[k], lo + idx[k], b)) b = Best{best[k], lo + idx[k]};
  }
  for (; i < hi; ++i) {
    const float v = Cv<T>::ld(p, i);
    if (better(v, i, b)) b = Best{v, i};
  }
  return b;
}

template <typename T>
void argmax_t(const at::Tensor& x, at::Tensor& out) {
  const int64_t R = x.size(0), V = x.size(1), ld = x.stride(0);
  const T* p = x.data_ptr<T>();
  int64_t* o = out.data_ptr<int64_t>();
  // Rows split in chunks so that even one row (a single request) keeps every thread busy.
  const int64_t C = std::max<int64_t>(1, std::min<int64_t>(V / 4096, (at::get_num_threads() + R - 1) / R));
  const int64_t span = (V + C - 1) / C;
  std::vector<Best> part(R * C);
  at::parallel_for(0, R * C, 1, [&](int64_t b, int64_t e) {
    for (int64_t w = b; w < e; ++w) {
      const int64_t r = w / C, lo = (w % C) * span, hi = std::min(V, lo + span);
      part[w] = scan<T>(p + r * ld, lo, hi);
    }
  });
  for (int64_t r = 0; r < R; ++r) {
    Best b = part[r * C];
    for (int64_t c = 1; c < C; ++c)
      if (better(part[r * C + c].v, part[r * C + c].i, b)) b = part[r * C + c];
    o[r] = b.i;
  }
}

}  // namespace

// x [N, H] (rows contiguous), w [H]; residual [N, H] or empty (then updated in place: r += x).
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& w, double eps, bool offset,
                    at::Tensor residual) {
  TORCH_CHECK(x.is_cpu() && w.is_cpu(), "rms_norm: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && w.is_contiguous() && w.scalar_type() == x.scalar_type() &&
              w.numel() == x.size(1), "rms_norm: x [N, H] with contiguous rows, w [H] of x's dtype");
  at::Tensor y = at::empty({x.size(0), x.size(1)}, x.options());
  const bool has_res = residual.numel() > 0;
  TORCH_CHECK(!has_res || (residual.sizes() == x.sizes() && residual.stride(1) == 1 &&
                           residual.scalar_type() == x.scalar_type()),
              "rms_norm: residual [N, H] with contiguous rows, x's dtype");
  DISPATCH(x.scalar_type(), rms_norm_t<T>(x, w, nullptr, y, has_res ? &residual : nullptr, eps, offset));
  return y;
}

// norm(residual += norm(x) with w1) with w2 -> [N, H]: two rms_norm calls' results, bits
// included, in one pass (rms_norm_t). residual [N, H] is updated in place.
at::Tensor rms_norm_pair(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2,
                         double eps, bool offset, at::Tensor residual) {
  TORCH_CHECK(x.is_cpu() && w1.is_cpu() && w2.is_cpu() && residual.is_cpu(), "rms_norm_pair: CPU tensors only");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && residual.sizes() == x.sizes() && residual.stride(1) == 1 &&
              residual.scalar_type() == x.scalar_type(), "rms_norm_pair: x, residual [N, H], rows contiguous");
  for (const at::Tensor* w : {&w1, &w2})
    TORCH_CHECK(w->is_contiguous() && w->scalar_type() == x.scalar_type() && w->numel() == x.size(1),
                "rms_norm_pair: weights [H] of x's dtype");
  at::Tensor y = at::empty({x.size(0), x.size(1)}, x.options());
  DISPATCH(x.scalar_type(), rms_norm_t<T>(x, w1, &w2, y, &residual, eps, offset));
  return y;
}

// x [N, 2I] = gate | up -> act(gate) * up [N, I].
at::Tensor act_and_mul(const at::Tensor& x, bool gelu) {
  TORCH_CHECK(x.is_cpu() && x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0,
              "act_and_mul: CPU x [N, 2I]");
  at::Tensor y = at::empty({x.size(0), x.size(1) / 2}, x.options());
  DISPATCH(x.scalar_type(), act_mul_t<T>(x, y, gelu));
  return y;
}

// In place on q [T, Hq, D], k [T, Hk, D] (last dim contiguous); table [2, P, D] fp32.
void qk_norm_rope(at::Tensor q, at::Tensor k, const at::Tensor& positions, const at::Tensor& table,
                  const at::Tensor& q_w, const at::Tensor& k_w, double eps, bool norm, bool offset) {
  TORCH_CHECK(q.is_cpu() && k.is_cpu() && positions.is_cpu() && table.is_cpu(),
              "qk_norm_rope: CPU tensors only");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && table.scalar_type() == at::kFloat &&
              table.is_contiguous() && positions.scalar_type() == at::kLong && positions.is_contiguous(),
              "qk_norm_rope: q/k rows contiguous, fp32 table, int64 positions");
  const int64_t d = q.size(2);
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && k.size(2) == d && d % 2 == 0 && q.size(0) == k.size(0) &&
              positions.numel() == q.size(0) && table.dim() == 3 && table.size(0) == 2 &&
              table.size(2) == d, "qk_norm_rope: q [T, Hq, D], k [T, Hk, D], positions [T], table [2, P, D]");
  TORCH_CHECK(!norm || (q_w.numel() == d && k_w.numel() == d && q_w.is_contiguous() && k_w.is_contiguous() &&
                        q_w.scalar_type() == q.scalar_type() && k_w.scalar_type() == q.scalar_type()),
              "qk_norm_rope: q/k norm weights [D] of q's dtype");
  if (positions.numel()) {
    const auto [lo, hi] = std::minmax_element(positions.data_ptr<int64_t>(),
                                              positions.data_ptr<int64_t>() + positions.numel());
    TORCH_CHECK(*lo >= 0 && *hi < table.size(1), "qk_norm_rope: positions outside the table");
  }
  DISPATCH(q.scalar_type(), qk_rope_t<T>(q, k, positions, table, q_w, k_w, eps, norm, offset));
}

// x [R, V] (rows contiguous, V >= 1) -> int64 [R]: x.max(dim=-1).indices.
at::Tensor argmax_rows(const at::Tensor& x) {
  TORCH_CHECK(x.is_cpu() && x.dim() == 2 && x.stride(1) == 1 && x.size(1) > 0,
              "argmax_rows: CPU x [R, V] with contiguous rows");
  at::Tensor out = at::empty({x.size(0)}, x.options().dtype(at::kLong));
  DISPATCH(x.scalar_type(), argmax_t<T>(x, out));
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("argmax_rows", &argmax_rows, "row argmax: largest, NaN first, first index among equals");
  mod.def("rms_norm", &rms_norm, "RMSNorm with an optional residual add folded in");
  mod.def("rms_norm_pair", &rms_norm_pair, "norm(residual += norm(x, w1), w2), residual in place");
  mod.def("act_and_mul", &act_and_mul, "SiLU/GELU-tanh(gate) * up");
  mod.def("qk_norm_rope", &qk_norm_rope, "per-head q/k RMSNorm + neox rotary, in place");
}

// For the C++ decoder stack (decoder_stack_cpu.cpp), which calls them through torch's dispatcher.
// The op namespace is the module's name: a copy built under another name (an A/B) is its own.
TORCH_LIBRARY_FRAGMENT(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm(Tensor x, Tensor w, float eps, bool offset, Tensor(a!) residual) -> Tensor",
        &rms_norm);
  m.def("rms_norm_pair(Tensor x, Tensor w1, Tensor w2, float eps, bool offset, Tensor(a!) residual) "
        "-> Tensor", &rms_norm_pair);
  m.def("qk_norm_rope(Tensor(a!) q, Tensor(b!) k, Tensor positions, Tensor table, Tensor q_w, "
        "Tensor k_w, float eps, bool norm, bool offset) -> ()", &qk_norm_rope);
  m.def("act_and_mul(Tensor x, bool gelu) -> Tensor", &act_and_mul);
}
