// Paged decode attention on the CPU: one query token per sequence, or a short run of them
// (draft-verify), KV read in place.
//
// flatserve-cflags: -ffp-contract=off
// No implicit fused multiply-adds: the FMAs are written (fmadd), so a run's rows and the same rows
// decoded alone round alike whatever the compiler (GCC 12 here contracted both paths alike; the
// GPU host's compiler did not: a verify row differed from its decode, tests/attention/
// test_cpu_kernel.py, 2026-11-27).
//
// The torch backend gathers each sequence's blocks into a new tensor and converts them to fp32
// before two small matmuls: at 16 concurrent Gemma-3-270M requests that was ~40% of a decode
// step (index + copy ops), ~25x the time of reading the same bytes once. Here each (sequence,
// KV head) walks its block table and streams every K/V row from the cache exactly once, with an
// online softmax in fp32 (the same maths as the torch reference: fp32 scores, scale, optional
// softcap, sliding window, sinks; output rounded to the cache dtype once). Runs of bf16 whose
// rows x query heads fit one AMX tile (<= 16 vectors) take their scores on tiles (amx_scores2 in
// csrc/decode_amx.h; one-row decodes too since commit 5ea2024, amx_scores_fit): at 4 rows x 4 heads
// the vector FMAs, not the bytes, had set the pace (benchmarks/dev/cpu_decode_ab.py --rows 4: 1.55
// -> 1.26 ms a full layer, 0.95 -> 0.77 windowed).
// At Gemma's shape a decode is bound by these instructions, not by the bytes (18 layers' caches
// from DRAM read in 0.39 ms by a plain stream against 0.66 ms for the kernel), so an earlier version
// trimmed them: one shuffle tree for each 4 keys x 4 heads' 16 sums, the 16 keys of a block's
// softmax as one vector per head, and V widened 32 values per shift + mask (bit-identical):
// `cpu_decode_ab.py --layers 18 --sequential`, 0.66 -> 0.59 ms full, 0.35 -> 0.30 windowed,
// --rows 4: 1.35 -> 1.07. AMX tiles for a decode's scores on one C tile's chain ran 10-25%
// slower than these vector instructions then; on more chains they are faster (amx_scores_fit).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "amx_tiles.h"
#include "cpu_math.h"
#include "decode_amx.h"
#include "decode_bf16.h"
#include "seq_list.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512BF16__)
using flatserve::decode::scores_bf16;
#endif
using flatserve::decode::Ahead;
#ifdef FLATSERVE_AMX
using flatserve::decode::amx_scores2;
using flatserve::decode::pack_qt;
#endif
#if defined(__AVX512F__)
using flatserve::decode::pv_bf16_split;
#endif
using flatserve::decode::split_acc_index;

// 16 fp32 lanes as one value (cpu_math.h). Written out because the plain loops below it ran at
// ~4 FMAs per cycle (the compiler kept the accumulators in memory); head sizes are multiples of
// 16 (the Python side checks).
constexpr int64_t kLanes = 16;
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
// AVX2: the 16 lanes as two ymm values, written with intrinsics. GCC's 64-byte generic vectors
// compiled to stack round trips on AVX2 (vpinsrq from general registers, every accumulator
// spilled): one sequence of 800 keys at Gemma's shape took 581 us a layer against 363 for the
// portable build, 104 us with these (`benchmarks/dev/cpu_decode_attention.py --lens 300,800`,
// 2-core AMD EPYC, 2026-11-26).
struct vf {
  __m256 lo, hi;
};
inline vf operator+(vf a, vf b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline vf operator*(vf a, vf b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline vf operator*(vf a, float s) { return a * vf{_mm256_set1_ps(s), _mm256_set1_ps(s)}; }
inline vf operator*(float s, vf a) { return a * s; }
inline vf& operator+=(vf& a, vf b) { return a = a + b; }
inline vf fmadd(vf a, vf b, vf c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline vf fmadd(float s, vf b, vf c) { return fmadd(vf{_mm256_set1_ps(s), _mm256_set1_ps(s)}, b, c); }
inline vf ld(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void st(float* p, vf v) {
  _mm256_storeu_ps(p, v.lo);
  _mm256_storeu_ps(p + 8, v.hi);
}
inline float hsum(vf v) { return flatserve::hsum8(_mm256_add_ps(v.lo, v.hi)); }
inline vf cvt(const float* p) { return ld(p); }
inline vf cvt(const at::BFloat16* p) {
  const uint16_t* u = reinterpret_cast<const uint16_t*>(p);
  return {flatserve::widen8(u), flatserve::widen8(u + 8)};
}
inline vf cvt(const at::Half* p) {  // exact, as static_cast<float> is
  const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm256_cvtph_ps(_mm256_castsi256_si128(w)), _mm256_cvtph_ps(_mm256_extracti128_si256(w, 1))};
}
#else
using vf = flatserve::f32x16;

inline vf ld(const float* p) { vf v; std::memcpy(&v, p, sizeof(v)); return v; }
inline void st(float* p, vf v) { std::memcpy(p, &v, sizeof(v)); }
inline vf fmadd(vf a, vf b, vf c) {
#if defined(__AVX512F__)
  return reinterpret_cast<vf>(_mm512_fmadd_ps(reinterpret_cast<__m512>(a), reinterpret_cast<__m512>(b),
                                              reinterpret_cast<__m512>(c)));
#else
  return a * b + c;  // portable C++: a multiply and an add (the file builds without contraction)
#endif
}
inline vf fmadd(float s, vf b, vf c) { return fmadd(vf{} + s, b, c); }
// Sum of the 16 lanes by a shuffle tree (4 shuffles + 4 adds). Summing v[0..15] one lane at a
// time compiled to 16 extracts and a serial chain of adds, once per (key, query head).
inline float hsum(vf v) {
  v += __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  v += __builtin_shufflevector(v, v, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  v += __builtin_shufflevector(v, v, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  v += __builtin_shufflevector(v, v, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  return v[0];
}

// 16 cache values -> fp32 lanes.
inline vf cvt(const float* p) { return ld(p); }
inline vf cvt(const at::BFloat16* p) {
  return flatserve::bf16x16_to_f32(reinterpret_cast<const uint16_t*>(p));
}
inline vf cvt(const at::Half* p) {
  vf f;
  for (int64_t k = 0; k < kLanes; ++k) f[k] = static_cast<float>(p[k]);
  return f;
}
#endif

struct Dims {
  int64_t hq, hkv, g, d, bs, max_blocks;
  float scale, softcap;  // softcap <= 0: off
  int64_t window;        // <= 0: off; keys with pos > q_pos - window are visible
};

// Raw scores of NK consecutive cache rows (row stride rs) for G query heads (fp32 q rows qf,
// stride d): sc[j * bs + i] = q_j . k_i. The NK x G accumulators stay in registers while each
// 16-lane slice of a K row is loaded and converted once for all G heads.
// On AVX2 not inlined: inlined into attend, GCC 12 kept 6 of its 8 ymm accumulators on the stack
// (a store and a reload around each FMA; perf put ~2/3 of the kernel's samples in this loop), and
// a call per key costs less (`cpu_decode_ab.py --rev 1a4d25e --layers 18 --cold`, avxvnni,
// 2-core Zen 5, 2026-11-29: 12.5 -> 8.9 ms a pass full, 7.9 -> 5.9 windowed; --rows 4 37.4 ->
// 27.6). More than 4 heads go in passes of 4 (each head's sums the same).
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
#define FLATSERVE_SCORES_ATTR __attribute__((noinline))
#else
#define FLATSERVE_SCORES_ATTR inline
#endif
template <typename T, int G, int NK>
FLATSERVE_SCORES_ATTR void scores(const float* qf, const T* k, int64_t rs, int64_t d, float* sc,
                                    int64_t bs) {
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
  if constexpr (G > 4) {  // 16 registers hold 4 heads' accumulators: more heads in two passes
    scores<T, 4, NK>(qf, k, rs, d, sc, bs);
    scores<T, G - 4, NK>(qf + 4 * d, k, rs, d, sc + 4 * bs, bs);
    return;
  }
#endif
  vf s[NK][G] = {};
  for (int64_t c = 0; c < d; c += kLanes) {
    vf kv[NK];
    for (int i = 0; i < NK; ++i) kv[i] = cvt(k + i * rs + c);
    for (int j = 0; j < G; ++j) {
      const vf qj = ld(qf + j * d + c);
      for (int i = 0; i < NK; ++i) s[i][j] = fmadd(qj, kv[i], s[i][j]);
    }
  }
  for (int i = 0; i < NK; ++i)
    for (int j = 0; j < G; ++j) sc[j * bs + i] = hsum(s[i][j]);
}


// Whether attend's accumulators for T and head size d are in pv_bf16_split's order (every
// block_step then writes them so, whatever its G).
template <typename T>
inline bool split_acc(int64_t d) {
#if defined(__AVX512F__)
  return std::is_same_v<T, at::BFloat16> && d % 32 == 0;
#else
  return false;
#endif
}


// One block's rows t0..t1 for G query heads (starting at head j0 of the group): scores, online
// softmax update of (mx, den), then acc = acc * corr + weights . V, one 16-lane slice of the G
// accumulators held across the block's rows, each V slice loaded and converted once.
// With `scored`, sc already holds the raw scores (the AMX path below) and only the softmax and
// P V run. The next block's rows are asked for by the time the scores are done (`ahead`).
template <typename T, int G>
void block_step(const T* q, const float* qf, const T* kb, const T* vb, int64_t rs, int64_t t0,
                int64_t t1, const Dims& m, float* mx, float* den, float* acc, float* sc,
                Ahead<T>& ahead, bool scored = false) {
  const int64_t d = m.d, bs = m.bs;
#if defined(__AVX512F__)
  constexpr int NK = G > 4 ? 2 : 4;  // NK x G score accumulators stay within the 32 registers
#else
  // AVX2 has 16 registers and each 16-lane value takes two: NK x G <= 4 accumulators (8), with
  // the NK K slices and one q slice. NK = 4 at G = 4 spilled 16 of its 32 halves to the stack.
  constexpr int NK = G <= 2 ? 2 : 1;
#endif
  int64_t t = scored ? t1 : t0;
  // The next block's share of rows for keys t0..t + NK of this one.
  auto share = [&](int64_t key) { return ((key + NK - t0) * ahead.rows + t1 - t0 - 1) / (t1 - t0); };
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (d % 32 == 0) {
      for (; t + NK <= t1; t += NK) {
        ahead.upto(share(t));
        scores_bf16<G, NK>(q, kb + t * rs, rs, d, sc + t, bs);
      }
      for (; t < t1; ++t) scores_bf16<G, 1>(q, kb + t * rs, rs, d, sc + t, bs);
    }
  }
#endif
  for (; t + NK <= t1; t += NK) {
    ahead.upto(share(t));
    scores<T, G, NK>(qf, kb + t * rs, rs, d, sc + t, bs);
  }
  for (; t < t1; ++t) scores<T, G, 1>(qf, kb + t * rs, rs, d, sc + t, bs);
  ahead.upto(ahead.rows);
  float corr[G];
#if defined(__AVX512F__)
  if (bs == 16 && m.softcap <= 0.f) {  // one vector per head: the scalar loops below cost more
    const __mmask16 k = static_cast<__mmask16>(((1u << t1) - 1) & ~((1u << t0) - 1));
    const __m512 scale = _mm512_set1_ps(m.scale);
    const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
    for (int j = 0; j < G; ++j) {
      float* sj = sc + j * bs;
      const __m512 x = _mm512_mask_mul_ps(ninf, k, _mm512_loadu_ps(sj), scale);
      const float nm = std::max(mx[j], _mm512_reduce_max_ps(x));
      corr[j] = std::exp(mx[j] - nm);
      const __m512 e = _mm512_maskz_mov_ps(k, flatserve::exp16(_mm512_sub_ps(x, _mm512_set1_ps(nm))));
      _mm512_storeu_ps(sj, e);
      den[j] = den[j] * corr[j] + _mm512_reduce_add_ps(e);
      mx[j] = nm;
    }
  } else
#endif
  for (int j = 0; j < G; ++j) {
    float* sj = sc + j * bs;
    float bm = -std::numeric_limits<float>::infinity();
    for (int64_t i = t0; i < t1; ++i) {
      float x = sj[i] * m.scale;
      if (m.softcap > 0.f) x = std::tanh(x / m.softcap) * m.softcap;
      sj[i] = x;
      bm = std::max(bm, x);
    }
    const float nm = std::max(mx[j], bm);
    corr[j] = std::exp(mx[j] - nm);
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t i = t0; i < t1; ++i) {
      sj[i] = flatserve::exp_poly(sj[i] - nm);  // scores -> weights, in place
      sum += sj[i];
    }
    den[j] = den[j] * corr[j] + sum;
    mx[j] = nm;
  }
#if defined(__AVX512F__)
  if constexpr (std::is_same_v<T, at::BFloat16>) {
    if (split_acc<T>(d)) {
      pv_bf16_split<G>(reinterpret_cast<const uint16_t*>(vb), rs, t0, t1, d, bs, corr, acc, sc);
      return;
    }
  }
#endif
  // Even and odd rows go to separate accumulators: with one chain per head the FMAs waited on
  // each other's latency (4 cycles) and PV ran at one FMA per cycle. On AVX2 (16 registers,
  // two per 16-lane value) only up to 2 heads: 4 x 2 chains would not fit, and G >= 3 heads'
  // chains are independent enough to cover the latency.
#if defined(__AVX512F__)
  constexpr bool kTwoChains = true;
#else
  constexpr bool kTwoChains = G <= 2;
#endif
  for (int64_t c = 0; c < d; c += kLanes) {
    vf a[G], b[G] = {};
    for (int j = 0; j < G; ++j) a[j] = ld(acc + j * d + c) * corr[j];
    int64_t i = t0;
    for (; kTwoChains && i + 2 <= t1; i += 2) {
      const vf v0 = cvt(vb + i * rs + c), v1 = cvt(vb + (i + 1) * rs + c);
      for (int j = 0; j < G; ++j) {
        a[j] = fmadd(sc[j * bs + i], v0, a[j]);
        b[j] = fmadd(sc[j * bs + i + 1], v1, b[j]);
      }
    }
    for (; i < t1; ++i) {
      const vf v0 = cvt(vb + i * rs + c);
      for (int j = 0; j < G; ++j) a[j] = fmadd(sc[j * bs + i], v0, a[j]);
    }
    for (int j = 0; j < G; ++j) st(acc + j * d + c, a[j] + b[j]);
  }
}

// Whether a run takes the AMX scores: bf16, at most 16 vectors, whole 16-key tiles and 32-dim
// slices. One-row decodes take them too since commit 5ea2024 (an earlier measurement had a decode's 4
// vectors on one C-tile chain slower than the vector scores). With a block's slices on two
// chains and the next block asked for between them, `cpu_decode_ab.py --layers 18 --sequential
// --cold` went 12.12 -> 11.42 ms full, 7.65 -> 7.23 windowed, verify runs (--rows 4) 20.08 ->
// 17.73 and 12.81 -> 11.30; then two blocks per call (attend, below) a further ~5%.
template <typename T>
inline bool amx_scores_fit(const Dims& m) {
#ifdef FLATSERVE_AMX
  return std::is_same_v<T, at::BFloat16> && m.g <= 8 && m.bs % 16 == 0 && m.d % 32 == 0 &&
         m.d <= 256 && flatserve::amx_available();
#else
  return false;
#endif
}
template <typename T>
inline bool use_amx_scores(int64_t n, const Dims& m) {
  return n * m.g <= 16 && amx_scores_fit<T>(m);
}

// One (sequence, KV head) with its run of n query rows (n = 1 for a decode; k + 1 for a
// draft-verify run): row r sits at position len - n + r and sees keys up to it (and at most the
// window). The g query heads of each row that share the KV head read each K/V row once, in
// chunks of up to 4 heads per pass over a block; a block's rows stay in L1 between the passes of
// every head chunk and every row of the run, so the run reads the sequence's KV from memory once.
template <typename T>
void attend(const T* q, const T* kc, const T* vc, const int32_t* table, int64_t len, int64_t n,
            const float* sinks, T* out, int64_t h, const Dims& m, float* qf, T* qc, float* acc,
            float* sc) {
  const int64_t g = m.g, d = m.d, bs = m.bs, rs = m.hkv * d, qs = m.hq * d;
  std::vector<float> mx(n * g, -std::numeric_limits<float>::infinity()), den(n * g, 0.f);
  // The run's query vectors for this KV head, [n, g, d], contiguous in fp32 (qf) and in the
  // cache dtype (qc), so that 8 / g consecutive rows form one block_step of 8 vectors.
  for (int64_t r = 0; r < n; ++r) {
    std::copy(q + r * qs + h * g * d, q + r * qs + (h + 1) * g * d, qc + r * g * d);
    for (int64_t c = 0; c < g * d; c += kLanes) st(qf + r * g * d + c, cvt(q + r * qs + h * g * d + c));
  }
  // Rows that see the same keys of a block are packed 8 / g at a time (g dividing 8): each K/V
  // slice is then loaded and converted once for 8 query vectors instead of g. A row must sum in
  // the same order packed or alone (greedy output with draft verification equals it without
  // only so): below AVX-512 block_step<8> sums P V on one chain and block_step<g <= 2> on two,
  // so there g <= 2 is not packed (tests/attention/test_cpu_kernel.py's verify-row test).
#if defined(__AVX512F__)
  const int64_t pack = (g < 8 && 8 % g == 0) ? 8 / g : 1;
#else
  const int64_t pack = (g > 2 && g < 8 && 8 % g == 0) ? 8 / g : 1;
#endif
  std::fill(acc, acc + n * g * d, 0.f);
  const bool amx = use_amx_scores<T>(n, m);
#ifdef FLATSERVE_AMX
  alignas(64) uint32_t qt[256 / 32 * 256];  // d <= 256 here: d / 32 tiles of 16 x 16 pairs
  if (amx) pack_qt(reinterpret_cast<const at::BFloat16*>(qc), n * g, d, qt);
#endif
  auto lo = [&](int64_t lr) { return m.window > 0 ? std::max<int64_t>(0, lr - m.window) : 0; };
  const int64_t b_end = (len + bs - 1) / bs;
  const int64_t b_first = lo(len - n + 1) / bs;
  // Offset of block b's first row of this KV head in either cache.
  auto row0 = [&](int64_t b) { return (static_cast<int64_t>(table[b]) * bs * m.hkv + h) * d; };
  auto ahead_of = [&](int64_t b) {  // block b's rows to ask for (none past the end)
    Ahead<T> a;
    if (b < b_end)
      a = {kc + row0(b), vc + row0(b), rs, d * static_cast<int64_t>(sizeof(T)), std::min(bs, len - b * bs), 0};
    return a;
  };
  // AMX scores go 32 keys per call: two blocks of 16 (the next two asked for meanwhile, the
  // farther into L2), or a block's halves. Against one block per call with the next block asked
  // for (commit 56f5d04), cpu_decode_ab.py --layers 18 --sequential --cold: 10.99 -> 10.33 ms full,
  // 6.94 -> 6.67 windowed; --rows 4 17.51 -> 16.42 and 11.17 -> 10.63.
  const bool pairs = amx && bs == 16;
#ifdef FLATSERVE_AMX
  alignas(64) float sp[2][16 * 16];  // pairs: two blocks' raw scores, [vector][key]
#endif
#ifdef FLATSERVE_AMX
  using BF = c10::BFloat16;
#endif
  for (int64_t b = b_first; b < b_end; ++b) {
    const T* kb = kc + row0(b);
    const T* vb = vc + row0(b);
    Ahead<T> ahead;  // the first block_step of this block asks for the next one's rows
    if (!pairs) ahead = ahead_of(b + 1);
#ifdef FLATSERVE_AMX
    if (pairs && (b - b_first) % 2 == 0) {
      Ahead<T> a2 = ahead_of(b + 2), a3 = ahead_of(b + 3);
      a3.l2 = true;  // T0 for both measured no better
      if (b == b_first) {  // the first two blocks are asked for here
        Ahead<T> f0 = ahead_of(b), f1 = ahead_of(b + 1);
        f0.upto(f0.rows);
        f1.upto(f1.rows);
      }
      const T* kn = b + 1 < b_end ? kc + row0(b + 1) : nullptr;
      amx_scores2(reinterpret_cast<const BF*>(kb), reinterpret_cast<const BF*>(kn), rs, d, qt, sp[0], sp[1],
                  16, n * g, a2, a3);
    } else if (amx && !pairs) {
      Ahead<T> none;
      for (int64_t k0 = 0; k0 < bs; k0 += 32) {
        const T* k1 = k0 + 16 < bs ? kb + (k0 + 16) * rs : nullptr;
        amx_scores2(reinterpret_cast<const BF*>(kb + k0 * rs), reinterpret_cast<const BF*>(k1), rs, d, qt,
                    sc + k0, sc + k0 + 16, bs, n * g, ahead, none);
      }
    }
    if (pairs) sc = sp[(b - b_first) % 2];
#endif
    auto span = [&](int64_t r) {  // this block's keys that row r sees, as [t0, t1) in the block
      const int64_t lr = len - n + r + 1;  // keys the row sees: [lo(lr), lr)
      return std::pair<int64_t, int64_t>(std::max(lo(lr), b * bs) - b * bs,
                                         std::min(lr, (b + 1) * bs) - b * bs);
    };
    for (int64_t r = 0; r < n; ++r) {
      const auto [t0, t1] = span(r);
      if (t1 <= t0) continue;
      if (pack > 1 && r + pack <= n && span(r + pack - 1) == span(r)) {  // rows r..r+pack-1 alike
        const int64_t i = r * g;
        block_step<T, 8>(qc + i * d, qf + i * d, kb, vb, rs, t0, t1, m, &mx[i], &den[i], acc + i * d,
                         sc + (amx ? i * bs : 0), ahead, amx);
        r += pack - 1;
        continue;
      }
      for (int64_t j = 0; j < g;) {
        const int64_t c = std::min<int64_t>(4, g - j), i = r * g + j;
        float* a = acc + i * d;
        const float* qj = qf + i * d;
        const T* qr = qc + i * d;
        float* si = sc + (amx ? i * bs : 0);
        if (c == 4) block_step<T, 4>(qr, qj, kb, vb, rs, t0, t1, m, &mx[i], &den[i], a, si, ahead, amx);
        else if (c == 3) block_step<T, 3>(qr, qj, kb, vb, rs, t0, t1, m, &mx[i], &den[i], a, si, ahead, amx);
        else if (c == 2) block_step<T, 2>(qr, qj, kb, vb, rs, t0, t1, m, &mx[i], &den[i], a, si, ahead, amx);
        else block_step<T, 1>(qr, qj, kb, vb, rs, t0, t1, m, &mx[i], &den[i], a, si, ahead, amx);
        j += c;
      }
    }
  }
  for (int64_t r = 0; r < n; ++r)
    for (int64_t j = 0; j < g; ++j) {
      const int64_t i = r * g + j;
      float dj = den[i], corr = 1.f;
      if (sinks != nullptr) {  // a logit that takes softmax mass but carries no value
        const float s = sinks[h * g + j], nm = std::max(mx[i], s);
        corr = std::exp(mx[i] - nm);
        dj = dj * corr + std::exp(s - nm);
      }
      const float f = dj > 0.f ? corr / dj : 0.f;
      T* o = out + r * qs + (h * g + j) * d;
#if defined(__AVX512BF16__)
      if constexpr (std::is_same_v<T, at::BFloat16>) {
        if (split_acc<T>(d)) {
          flatserve::decode::store_split_bf16(acc + i * d, f, d, reinterpret_cast<uint16_t*>(o));
          continue;
        }
      }
#endif
      if (split_acc<T>(d))
        for (int64_t e = 0; e < d; ++e) o[e] = static_cast<T>(acc[i * d + split_acc_index(e)] * f);
      else
        for (int64_t e = 0; e < d; ++e) o[e] = static_cast<T>(acc[i * d + e] * f);
    }
}

// Runs: sequence s owns q rows cu[s]..cu[s + 1] (cu == nullptr: row s alone); `which` lists
// the sequences to run.
template <typename T>
void run(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& table,
         const at::Tensor& lens, const int32_t* cu, const float* sinks, at::Tensor& out,
         const Dims& m, const std::vector<int64_t>& which) {
  const int64_t S = static_cast<int64_t>(which.size());
  if (S == 0) return;
  const T* qp = q.data_ptr<T>();
  const T* kp = kc.data_ptr<T>();
  const T* vp = vc.data_ptr<T>();
  const int32_t* tp = table.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  T* op = out.data_ptr<T>();
  auto first = [&](int64_t s) { return cu ? static_cast<int64_t>(cu[s]) : s; };
  auto rows = [&](int64_t s) { return cu ? static_cast<int64_t>(cu[s + 1] - cu[s]) : 1; };
  int64_t max_rows = 1;
  for (const int64_t s : which) max_rows = std::max(max_rows, rows(s));
  // Most work first (context x rows), handed out one at a time: contexts are ragged (10..1,500
  // tokens in the CPU benchmark), and at::parallel_for's equal static halves left one core idle
  // for much of a layer (one Gemma layer, 16 ragged decodes, benchmarks/dev/cpu_decode_attention.py:
  // 1.55 -> 1.32 ms full attention, 0.86 -> 0.81 ms with the 512 window).
  std::vector<int64_t> order(S * m.hkv);  // (sequence, KV head) flattened
  for (int64_t w = 0; w < S * m.hkv; ++w) order[w] = which[w / m.hkv] * m.hkv + w % m.hkv;
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) {
    return lp[a / m.hkv] * rows(a / m.hkv) > lp[b / m.hkv] * rows(b / m.hkv);
  });
  const int64_t n = static_cast<int64_t>(order.size());
#pragma omp parallel num_threads(static_cast<int>(std::min<int64_t>(at::get_num_threads(), n)))
  {
    std::vector<float> qf(max_rows * m.g * m.d), acc(max_rows * m.g * m.d), sc(16 * m.bs);
    std::vector<T> qc(max_rows * m.g * m.d);
#ifdef FLATSERVE_AMX
    const bool tiles = amx_scores_fit<T>(m);  // some run may take them
    if (tiles) flatserve::load_tile_config();
#endif
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < n; ++i) {
      const int64_t s = order[i] / m.hkv, h = order[i] % m.hkv, f = first(s);
      attend<T>(qp + f * m.hq * m.d, kp, vp, tp + s * m.max_blocks, lp[s], rows(s), sinks,
                op + f * m.hq * m.d, h, m, qf.data(), qc.data(), acc.data(), sc.data());
    }
#ifdef FLATSERVE_AMX
    if (tiles) _tile_release();
#endif
  }
}

}  // namespace

// q [R, Hq, D]; caches [num_blocks, block_size, Hkv, D]; block_table [S, max_blocks] int32;
// seq_lens [S] int32; cu_seqlens_q [S + 1] int32 or empty (then R == S, one row each); sequence
// s's rows are q[cu[s]:cu[s + 1]], the last at position seq_lens[s] - 1; sinks [Hq] fp32 or empty.
// seqs (int32, optional): only these sequences, their rows written into `out` (optional, q's
// shape; its other rows untouched): the decodes of a step that also has prefill chunks.
at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_table, const at::Tensor& seq_lens,
                        const at::Tensor& cu_seqlens_q, double scale, int64_t window,
                        double softcap, const at::Tensor& sinks,
                        const c10::optional<at::Tensor>& seqs, const c10::optional<at::Tensor>& out_) {
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
  const int64_t S = seq_lens.size(0);
  TORCH_CHECK(block_table.size(0) == S, "paged_decode: one block-table row per sequence");
  const int32_t* cu = nullptr;
  if (cu_seqlens_q.numel()) {
    TORCH_CHECK(cu_seqlens_q.scalar_type() == at::kInt && cu_seqlens_q.is_contiguous() &&
                cu_seqlens_q.numel() == S + 1, "paged_decode: int32 cu_seqlens_q [S + 1]");
    cu = cu_seqlens_q.data_ptr<int32_t>();
    const int32_t* lp = seq_lens.data_ptr<int32_t>();
    TORCH_CHECK(cu[0] == 0 && cu[S] == q.size(0), "paged_decode: cu_seqlens_q must span q's rows");
    for (int64_t s = 0; s < S; ++s)
      TORCH_CHECK(cu[s + 1] > cu[s] && cu[s + 1] - cu[s] <= lp[s],
                  "paged_decode: each sequence needs 1..seq_len rows");
  } else {
    TORCH_CHECK(q.size(0) == S, "paged_decode: without cu_seqlens_q, one q row per sequence");
  }
  const std::vector<int64_t> which = flatserve::sequence_list(seqs, S, "paged_decode");
  at::Tensor out = flatserve::output_for(q, out_, "paged_decode");
  switch (q.scalar_type()) {
    case at::kFloat: run<float>(q, k_cache, v_cache, block_table, seq_lens, cu, sp, out, m, which); break;
    case at::kBFloat16: run<at::BFloat16>(q, k_cache, v_cache, block_table, seq_lens, cu, sp, out, m, which); break;
    case at::kHalf: run<at::Half>(q, k_cache, v_cache, block_table, seq_lens, cu, sp, out, m, which); break;
    default: TORCH_CHECK(false, "paged_decode: dtype must be float32, bfloat16 or float16");
  }
  return out;
}

// k, v [T, Hkv, D] (rows may be strided, as views of the fused qkv output are; each row's
// Hkv x D contiguous) -> caches [num_blocks, block_size, Hkv, D] at slot_mapping[T] (int64,
// < 0 skipped), same dtype. One call for K and V: the two index_copy_ it replaces cost
// ~1.0 ms of an 18-layer decode step at 16 requests (benchmarks/dev/cpu_profile_step.py 16
// --by-kernel), almost all of it per-op overhead for 16 x 1 KB of data.
void write_kv(const at::Tensor& k, const at::Tensor& v, at::Tensor& k_cache, at::Tensor& v_cache,
              const at::Tensor& slot_mapping) {
  TORCH_CHECK(k.is_cpu() && v.is_cpu() && k_cache.is_cpu() && v_cache.is_cpu() &&
              slot_mapping.is_cpu(), "write_kv: CPU tensors only");
  TORCH_CHECK(k.dim() == 3 && v.sizes() == k.sizes() && k_cache.dim() == 4 &&
              v_cache.sizes() == k_cache.sizes() && k_cache.size(2) == k.size(1) &&
              k_cache.size(3) == k.size(2), "write_kv: k, v [T, Hkv, D], caches [N, bs, Hkv, D]");
  TORCH_CHECK(k.scalar_type() == k_cache.scalar_type() && v.scalar_type() == k_cache.scalar_type() &&
              v_cache.scalar_type() == k_cache.scalar_type(), "write_kv: one dtype");
  TORCH_CHECK(k.stride(2) == 1 && k.stride(1) == k.size(2) && v.stride(2) == 1 &&
              v.stride(1) == v.size(2) && k_cache.is_contiguous() && v_cache.is_contiguous(),
              "write_kv: each row's heads contiguous, caches contiguous");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.dim() == 1 &&
              slot_mapping.is_contiguous() && slot_mapping.size(0) == k.size(0),
              "write_kv: int64 slot_mapping [T]");
  const int64_t T = k.size(0), slots = k_cache.size(0) * k_cache.size(1);
  const int64_t row = k.size(1) * k.size(2) * k.element_size();  // bytes of one token's K
  const int64_t* sm = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) TORCH_CHECK(sm[t] < slots, "write_kv: slot out of range");
  const char* kp = static_cast<const char*>(k.data_ptr());
  const char* vp = static_cast<const char*>(v.data_ptr());
  char* kc = static_cast<char*>(k_cache.data_ptr());
  char* vc = static_cast<char*>(v_cache.data_ptr());
  const int64_t ks = k.stride(0) * k.element_size(), vs = v.stride(0) * v.element_size();
  // Threads only for prompt-sized writes (2,048 rows x 2 x 512 B = 2 MB a layer).
  at::parallel_for(0, T, 256, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      if (sm[t] < 0) continue;
      std::memcpy(kc + sm[t] * row, kp + t * ks, row);
      std::memcpy(vc + sm[t] * row, vp + t * vs, row);
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("write_kv", &write_kv, "K and V rows into the paged caches at slot_mapping");
  mod.def("paged_decode", &paged_decode, "paged decode attention, KV read in place", py::arg("q"),
          py::arg("k_cache"), py::arg("v_cache"), py::arg("block_table"), py::arg("seq_lens"),
          py::arg("cu_seqlens_q"), py::arg("scale"), py::arg("window"), py::arg("softcap"),
          py::arg("sinks"), py::arg("seqs") = py::none(), py::arg("out") = py::none());
}

// For the C++ decoder stack (ops/csrc/decoder_stack_cpu.cpp), through torch's dispatcher;
// the op namespace is the module's name (a copy built under another name is its own).
TORCH_LIBRARY_FRAGMENT(TORCH_EXTENSION_NAME, m) {
  m.def("write_kv(Tensor k, Tensor v, Tensor(a!) k_cache, Tensor(b!) v_cache, Tensor slot_mapping) -> ()",
        &write_kv);
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, Tensor seq_lens, "
        "Tensor cu_seqlens_q, float scale, int window, float softcap, Tensor sinks, Tensor? seqs, "
        "Tensor? out) -> Tensor", &paged_decode);
}
