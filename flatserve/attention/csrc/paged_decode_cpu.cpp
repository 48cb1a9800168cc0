// Paged decode attention on the CPU: one query token per sequence, KV read in place.
//
// The torch backend gathers each sequence's blocks into a new tensor and converts them to fp32
// before two small matmuls: at 16 concurrent Gemma-3-270M requests that was ~40% of a decode
// step (index + copy ops), ~25x the time of reading the same bytes once. Here each (sequence,
// KV head) walks its block table and streams every K/V row from the cache exactly once, with an
// online softmax in fp32 (the same maths as the torch reference: fp32 scores, scale, optional
// softcap, sliding window, sinks; output rounded to the cache dtype once).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "cpu_math.h"

namespace {

// 16 fp32 lanes as one value (GCC/clang vector extension): one AVX-512 register, two AVX2 ones.
// Written out because the plain loops below it ran at ~4 FMAs per cycle (the compiler kept the
// accumulators in memory); head sizes are multiples of 16 (the Python side checks).
constexpr int64_t kLanes = 16;
typedef float vf __attribute__((vector_size(kLanes * sizeof(float))));
typedef uint16_t vh __attribute__((vector_size(kLanes * sizeof(uint16_t))));
typedef uint32_t vw __attribute__((vector_size(kLanes * sizeof(uint32_t))));

inline vf ld(const float* p) { vf v; std::memcpy(&v, p, sizeof(v)); return v; }
inline void st(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }
inline float hsum(vf v) {
  float s = 0.f;
  for (int64_t k = 0; k < kLanes; ++k) s += v[k];
  return s;
}

// 16 cache values -> fp32 lanes. bf16 -> fp32 is a 16-bit shift.
inline vf cvt(const float* p) { return ld(p); }
inline vf cvt(const at::BFloat16* p) {
  vh h;
  std::memcpy(&h, p, sizeof(h));
  const vw w = __builtin_convertvector(h, vw) << 16;
  vf f;
  std::memcpy(&f, &w, sizeof(f));
  return f;
}
inline vf cvt(const at::Half* p) {
  vf f;
  for (int64_t k = 0; k < kLanes; ++k) f[k] = static_cast<float>(p[k]);
  return f;
}

struct Dims {
  int64_t hq, hkv, g, d, bs, max_blocks;
  float scale, softcap;  // softcap <= 0: off
  int64_t window;        // <= 0: off; keys with pos > q_pos - window are visible
};

// Scores of one block's rows for the g query heads: sc[j * bs + t] = scale * q_j . k_t.
inline void block_scores(const float* qf, const float* kb, int64_t t0, int64_t t1, const Dims& m,
                         float* sc) {
  for (int64_t t = t0; t < t1; ++t) {
    const float* kr = kb + t * m.d;
    for (int64_t j = 0; j < m.g; ++j) {
      const float* qj = qf + j * m.d;
      vf s = {};
      for (int64_t c = 0; c < m.d; c += kLanes) s += ld(qj + c) * ld(kr + c);
      float x = hsum(s) * m.scale;
      if (m.softcap > 0.f) x = std::tanh(x / m.softcap) * m.softcap;
      sc[j * m.bs + t] = x;
    }
  }
}

// One (sequence, KV head): the g query heads that share the KV head read each K/V row once.
template <typename T>
void attend(const T* q, const T* kc, const T* vc, const int32_t* table, int64_t len,
            const float* sinks, T* out, int64_t h, const Dims& m, float* qf, float* acc,
            float* sc, float* kb, float* vb) {
  const int64_t g = m.g, d = m.d, bs = m.bs;
  const float ninf = -std::numeric_limits<float>::infinity();
  std::vector<float> mx(g, ninf), den(g, 0.f);
  for (int64_t c = 0; c < g * d; c += kLanes) st(qf + c, cvt(q + h * g * d + c));
  std::fill(acc, acc + g * d, 0.f);
  const int64_t k0 = m.window > 0 ? std::max<int64_t>(0, len - m.window) : 0;
  for (int64_t b = k0 / bs; b * bs < len; ++b) {
    const int64_t base = static_cast<int64_t>(table[b]) * bs;
    const int64_t t0 = std::max(k0, b * bs) - b * bs, t1 = std::min(len, (b + 1) * bs) - b * bs;
    // Rows of this block as fp32, converted once and shared by the g query heads.
    for (int64_t t = t0; t < t1; ++t) {
      const T* kp = kc + ((base + t) * m.hkv + h) * d;
      const T* vp = vc + ((base + t) * m.hkv + h) * d;
      for (int64_t c = 0; c < d; c += kLanes) {
        st(kb + t * d + c, cvt(kp + c));
        st(vb + t * d + c, cvt(vp + c));
      }
    }
    block_scores(qf, kb, t0, t1, m, sc);
    for (int64_t j = 0; j < g; ++j) {
      float* sj = sc + j * bs;
      float bm = ninf;
      for (int64_t t = t0; t < t1; ++t) bm = std::max(bm, sj[t]);
      const float nm = std::max(mx[j], bm), corr = std::exp(mx[j] - nm);
      float* aj = acc + j * d;
      float sum = 0.f;
#pragma omp simd reduction(+ : sum)
      for (int64_t t = t0; t < t1; ++t) {
        sj[t] = flatserve::exp_poly(sj[t] - nm);  // scores -> weights, in place
        sum += sj[t];
      }
      den[j] = den[j] * corr + sum;
      // acc = acc * corr + weights . V, one 16-lane slice at a time held across the block's
      // rows: one load and one store per slice per block, not per row.
      for (int64_t c = 0; c < d; c += kLanes) {
        vf a = ld(aj + c) * corr;
        for (int64_t t = t0; t < t1; ++t) a += sj[t] * ld(vb + t * d + c);
        st(aj + c, a);
      }
      mx[j] = nm;
    }
  }
  for (int64_t j = 0; j < g; ++j) {
    float dj = den[j], corr = 1.f;
    if (sinks != nullptr) {  // a logit that takes softmax mass but carries no value
      const float s = sinks[h * g + j], nm = std::max(mx[j], s);
      corr = std::exp(mx[j] - nm);
      dj = dj * corr + std::exp(s - nm);
    }
    const float f = dj > 0.f ? corr / dj : 0.f;
    for (int64_t i = 0; i < d; ++i) out[(h * g + j) * d + i] = static_cast<T>(acc[j * d + i] * f);
  }
}

template <typename T>
void run(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& table,
         const at::Tensor& lens, const float* sinks, at::Tensor& out, const Dims& m) {
  const int64_t S = q.size(0);
  const T* qp = q.data_ptr<T>();
  const T* kp = kc.data_ptr<T>();
  const T* vp = vc.data_ptr<T>();
  const int32_t* tp = table.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  T* op = out.data_ptr<T>();
  // Longest sequences first, handed out one at a time: contexts are ragged (10..1,500 tokens in
  // the CPU benchmark), and at::parallel_for's equal static halves left one core idle for much
  // of a layer (one Gemma layer, 16 ragged decodes, benchmarks/cpu_decode_attention.py: 1.55 ->
  // 1.32 ms full attention, 0.86 -> 0.81 ms with the 512 window).
  std::vector<int64_t> order(S * m.hkv);
  for (int64_t w = 0; w < S * m.hkv; ++w) order[w] = w;
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t a, int64_t b) { return lp[a / m.hkv] > lp[b / m.hkv]; });
  const int64_t n = static_cast<int64_t>(order.size());
#pragma omp parallel num_threads(static_cast<int>(std::min<int64_t>(at::get_num_threads(), n)))
  {
    std::vector<float> qf(m.g * m.d), acc(m.g * m.d), sc(m.g * m.bs), kb(m.bs * m.d), vb(m.bs * m.d);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) {
      const int64_t s = order[i] / m.hkv, h = order[i] % m.hkv;
      attend<T>(qp + s * m.hq * m.d, kp, vp, tp + s * m.max_blocks, lp[s], sinks,
                op + s * m.hq * m.d, h, m, qf.data(), acc.data(), sc.data(), kb.data(), vb.data());
    }
  }
}

}  // namespace

// q [S, Hq, D]; caches [num_blocks, block_size, Hkv, D]; block_table [S, max_blocks] int32;
// seq_lens [S] int32 (the query token sits at position seq_lens - 1); sinks [Hq] fp32 or empty.
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_table, const at::Tensor& seq_lens, double scale,
                        int64_t window, double softcap, const at::Tensor& sinks) {
  TORCH_CHECK(q.is_cpu() && k_cache.is_cpu() && v_cache.is_cpu() && block_table.is_cpu() &&
              seq_lens.is_cpu(), "paged_decode: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && q.is_contiguous() && k_cache.is_contiguous() &&
              v_cache.is_contiguous(), "paged_decode: contiguous q [S,Hq,D] and caches [N,bs,Hkv,D]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              "paged_decode: q and caches must share a dtype");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
              block_table.is_contiguous() && seq_lens.is_contiguous(), "paged_decode: int32 metadata");
  Dims m{q.size(1), k_cache.size(2), q.size(1) / k_cache.size(2), q.size(2), k_cache.size(1),
         block_table.size(1), static_cast<float>(scale), static_cast<float>(softcap), window};
  TORCH_CHECK(m.hq % m.hkv == 0 && k_cache.size(3) == m.d && m.d % kLanes == 0,
              "paged_decode: head shapes (head size a multiple of 16)");
  at::Tensor sk = sinks.numel() ? sinks.to(at::kFloat).contiguous() : sinks;
  const float* sp = sinks.numel() ? sk.data_ptr<float>() : nullptr;
  at::Tensor out = at::empty_like(q);
  switch (q.scalar_type()) {
    case at::kFloat: run<float>(q, k_cache, v_cache, block_table, seq_lens, sp, out, m); break;
    case at::kBFloat16: run<at::BFloat16>(q, k_cache, v_cache, block_table, seq_lens, sp, out, m); break;
    case at::kHalf: run<at::Half>(q, k_cache, v_cache, block_table, seq_lens, sp, out, m); break;
    default: TORCH_CHECK(false, "paged_decode: dtype must be float32, bfloat16 or float16");
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("paged_decode", &paged_decode, "paged decode attention, KV read in place");
}
