// Paged prompt attention on the CPU, row-invariant: each query row's output depends only on
// that row's query, its position and its sequence's keys, never on which other rows share the
// call. A prompt row gives the same bits in a whole prompt, in a chunk of it, or as the tail
// left after a prefix-cache hit, so greedy answers do not change with what else is running.
//
// Why its own kernel: torch's CPU SDPA splits the query rows by their count and the decode
// kernel computes a row otherwise than SDPA; with prefix caching a repeated prompt's tail (<= 16
// rows) went to the decode kernel while the prompt served alone went to SDPA, and 152 of 899
// kept answers differed from the prompt served alone (benchmarks/load_disconnects.py, AVX2 EPYC,
// 2026-11-26). SDPA itself, tail against whole prompt: 9 of 60 random fp32 cases differ.
//
// How invariance is kept: work items are (sequence, KV head, up to kRows query rows); every row
// walks the same absolute 16-key groups (keys 16 j .. 16 j + 15) in order, skipping exactly the
// groups it cannot see, with one code path for every row: a row's scores are dot products over
// the head in a fixed order, its softmax is online per group, and the rows a tile pads with are
// computed and dropped. Keys a row cannot see inside a group get weight 0 (an exact no-op).
// Each group's K (transposed) and V are widened to fp32 once per work item and shared by its rows;
// at avx512 a bf16 cache's products run on bf16 pairs instead (vdpbf16ps, kDot below).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_math.h"
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#include "seq_list.h"

namespace {

#if defined(__AVX512F__)
constexpr int64_t W = 16;  // fp32 lanes of one vector register
#elif defined(__AVX2__)
constexpr int64_t W = 8;
#else
constexpr int64_t W = 4;   // the portable build: one SSE / NEON register (vectors of 8 were lowered
                           // to scalar code there: 380 ms for 16 prompts of 256 against ~12 at avx2)
#endif
typedef float vw __attribute__((vector_size(W * 4)));
typedef int32_t vi __attribute__((vector_size(W * 4)));
constexpr int64_t kKeys = 16;  // keys per softmax step, aligned to absolute positions
constexpr int64_t NV = kKeys / W;  // vectors of a row's 16 scores
constexpr int64_t kRows = 64;  // query rows per work item: positions x the g heads of a KV head
                               // (16 rows spent ~1/3 of the time widening K/V per item)
// Rows per register tile: 8 independent FMA chains either way (4 rows x 2 vectors of 8 keys, or
// 8 rows x 1 of 16). With 4 rows of 16 lanes the score loop waited on the FMA latency: 47% of
// the kernel's samples at avx512 (perf, 16 prompts of 256, Gemma-3-270M's heads, Zen 5).
constexpr int64_t kR = W == 16 ? 8 : 4;
constexpr float kNegInf = -std::numeric_limits<float>::infinity();

inline vw ldw(const float* p) { vw v; std::memcpy(&v, p, sizeof(v)); return v; }
inline void stw(float* p, vw v) { std::memcpy(p, &v, sizeof(v)); }

// Lane sums in a fixed tree (the same bits for every row) and lane maxima.
inline float hsum(vw v) {
  float s[W];
  std::memcpy(s, &v, sizeof(s));
  for (int64_t n = W / 2; n >= 1; n /= 2)
    for (int64_t i = 0; i < n; ++i) s[i] += s[i + n];
  return s[0];
}
inline float hmax(vw v) {  // once per row and group: in registers (through memory it was ~15%)
#if defined(__AVX512F__)
  return _mm512_reduce_max_ps(reinterpret_cast<__m512>(v));
#elif defined(__AVX2__)
  const __m256 y = reinterpret_cast<__m256>(v);
  __m128 a = _mm_max_ps(_mm256_castps256_ps128(y), _mm256_extractf128_ps(y, 1));
  a = _mm_max_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_max_ss(a, _mm_movehdup_ps(a)));
#else
  float m = v[0];
  for (int64_t i = 1; i < W; ++i) m = std::max(m, v[i]);
  return m;
#endif
}

// flatserve::exp_poly on W lanes (the same polynomial and clamp), x <= 88.
inline vw exp_w(vw x) {
  x = x < -87.f ? vw{} - 87.f : x;
  const vw t = x * 1.4426950408889634f;
  const vi ti = __builtin_convertvector(t, vi);  // toward zero; floor below
  const vw tf = __builtin_convertvector(ti, vw);
  const vi fi = t < tf ? ti - 1 : ti;
  const vw p = flatserve::exp2_frac(t - __builtin_convertvector(fi, vw));
  const vi bits = (fi + 127) << 23;
  vw s;
  std::memcpy(&s, &bits, sizeof(s));
  return p * s;
}

// n cache values -> fp32.
inline void widen(const float* src, float* dst, int64_t n) { std::memcpy(dst, src, n * 4); }
inline void widen(const at::BFloat16* src, float* dst, int64_t n) {
  const uint16_t* s = reinterpret_cast<const uint16_t*>(src);
  uint32_t* d = reinterpret_cast<uint32_t*>(dst);
  for (int64_t i = 0; i < n; ++i) d[i] = static_cast<uint32_t>(s[i]) << 16;
}
inline void widen(const at::Half* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

struct Geo {
  int64_t hq, hkv, g, d, bs, max_blocks;
  float scale, softcap;  // softcap <= 0: off
  int64_t window;        // <= 0: off; keys with pos > q_pos - window are visible
};

struct Item {
  int64_t seq, kvh, t0, nt;  // rows t0..t0 + nt - 1 of the sequence's new rows
};

// Per-thread scratch of one work item. The bf16 products' path (kDot) reads q, K and V as stored:
// qb [rows][d], kb / vb [kKeys][d] bf16; kt2 [d / 2][kKeys] and vp [kKeys / 2][d] pairs, pb
// [rows][kKeys / 2] the weights' pairs.
struct Scratch {
  std::vector<float> q, kf, krow, vf, s, p, acc, m, l;  // krow: K [kKeys][d]; kf: transposed
  std::vector<uint16_t> qb, kb, vb;
  std::vector<uint32_t> kt2, vp, pb;
  Scratch(int64_t rows, int64_t d, bool dot)
      : q(dot ? 0 : rows * d), kf(dot ? 0 : kKeys * d), krow(dot ? 0 : kKeys * d),
        vf(dot ? 0 : kKeys * d), s(rows * kKeys), p(rows * kKeys), acc(rows * d), m(rows),
        l(rows * W), qb(dot ? rows * d : 0), kb(dot ? kKeys * d : 0), vb(dot ? kKeys * d : 0),
        kt2(dot ? kKeys * d / 2 : 0), vp(dot ? kKeys * d / 2 : 0), pb(dot ? rows * kKeys / 2 : 0) {}
};

// s[r * kKeys + j] = q_r . k_j for rows r0..r0 + kR - 1 and the group's 16 keys, from kt [d][16]
// (the keys' values at one head dim side by side): a row's 16 scores build up as kKeys / W
// vectors, one FMA chain each over the head, with no horizontal sums.
inline void scores(const float* q, const float* kt, float* s, int64_t r0, int64_t d) {
  vw a[kR][NV] = {};
  for (int64_t c = 0; c < d; ++c) {
    vw k[NV];
    for (int64_t v = 0; v < NV; ++v) k[v] = ldw(kt + c * kKeys + v * W);
    for (int64_t r = 0; r < kR; ++r) {
      const float qr = q[(r0 + r) * d + c];
      for (int64_t v = 0; v < NV; ++v) a[r][v] += qr * k[v];
    }
  }
  for (int64_t r = 0; r < kR; ++r)
    for (int64_t v = 0; v < NV; ++v) stw(s + (r0 + r) * kKeys + v * W, a[r][v]);
}

// acc_r += sum_j p[r, j] v_j for rows r0..r0 + kR - 1, NC head chunks of W at a time (NC = 2:
// 2 V loads and 4 broadcasts feed 8 FMAs; one chunk at a time the loads set the pace).
template <int64_t NC>
inline void pv_chunks(const float* p, const float* vf, float* acc, int64_t r0, int64_t d, int64_t c) {
  vw a[kR][NC];
  for (int64_t r = 0; r < kR; ++r)
    for (int64_t u = 0; u < NC; ++u) a[r][u] = ldw(acc + (r0 + r) * d + c + u * W);
  for (int64_t j = 0; j < kKeys; ++j) {
    vw v[NC];
    for (int64_t u = 0; u < NC; ++u) v[u] = ldw(vf + j * d + c + u * W);
    for (int64_t r = 0; r < kR; ++r) {
      const float pr = p[(r0 + r) * kKeys + j];
      for (int64_t u = 0; u < NC; ++u) a[r][u] += pr * v[u];
    }
  }
  for (int64_t r = 0; r < kR; ++r)
    for (int64_t u = 0; u < NC; ++u) stw(acc + (r0 + r) * d + c + u * W, a[r][u]);
}

inline void pv(const float* p, const float* vf, float* acc, int64_t r0, int64_t d) {
  int64_t c = 0;
  for (; c + 2 * W <= d; c += 2 * W) pv_chunks<2>(p, vf, acc, r0, d, c);
  if (c < d) pv_chunks<1>(p, vf, acc, r0, d, c);
}

// One row's online-softmax step over a group at key position k0: p[16] and the rescale of its
// accumulator, on NV vectors of W keys; lv: the row's sum of weights in W lanes. Returns false
// (nothing changed) where the row sees no key of the group. (Scalar, this step was ~13% of the
// kernel at avxvnni and ~20% at avx512.)
inline bool softmax_step(const float* sc, float* p, float* acc, float& m, float* lv, int64_t qpos,
                         int64_t k0, const Geo& g) {
  const int64_t vhi = std::min(qpos, k0 + kKeys - 1);  // the visible keys: vlo..vhi
  const int64_t vlo = g.window > 0 ? std::max(k0, qpos - g.window + 1) : k0;
  if (vlo > vhi) {
    std::memset(p, 0, kKeys * sizeof(float));
    return false;
  }
  vw x[NV];
  for (int64_t v = 0; v < NV; ++v) x[v] = ldw(sc + v * W) * g.scale;
  if (g.softcap > 0.f)
    for (int64_t v = 0; v < NV; ++v)
      for (int64_t j = 0; j < W; ++j) x[v][j] = std::tanh(x[v][j] / g.softcap) * g.softcap;
  if (vlo > k0 || vhi < k0 + kKeys - 1) {  // a group on the diagonal or the window's edge
    vi pos;
    for (int64_t j = 0; j < W; ++j) pos[j] = static_cast<int32_t>(j);
    for (int64_t v = 0; v < NV; ++v) {
      const vi kp = pos + static_cast<int32_t>(k0 - vlo + v * W);  // key position - vlo
      x[v] = (kp < 0) | (kp > static_cast<int32_t>(vhi - vlo)) ? vw{} + kNegInf : x[v];
    }
  }
  vw mx = x[0];
  for (int64_t v = 1; v < NV; ++v) mx = mx > x[v] ? mx : x[v];
  const float mn = std::max(m, hmax(mx));
  const float alpha = m == kNegInf ? 0.f : flatserve::exp_poly(m - mn);
  vw sum = ldw(lv) * alpha;  // the row's sum of weights, lane by lane (added up at the end)
  for (int64_t v = 0; v < NV; ++v) {
    const vw e = x[v] == kNegInf ? vw{} : exp_w(x[v] - mn);
    stw(p + v * W, e);
    sum += e;
  }
  stw(lv, sum);
  if (alpha != 1.f)
    for (int64_t c = 0; c < g.d; c += W) stw(acc + c, ldw(acc + c) * alpha);
  m = mn;
  return true;
}

// K of a group, widened row by row into kr [16][d], then transposed into kt [d][16] (8 x 8
// blocks in registers where AVX is there: the scalar scatter was ~7% of the kernel).
inline void transpose_keys(const float* kr, float* kt, int64_t d) {
#if defined(__AVX2__)
  for (int64_t j0 = 0; j0 < kKeys; j0 += 8)
    for (int64_t c0 = 0; c0 < d; c0 += 8) {
      __m256 r[8];
      for (int i = 0; i < 8; ++i) r[i] = _mm256_loadu_ps(kr + (j0 + i) * d + c0);
      flatserve::transpose8x8(r);  // r[i]: dim c0 + i of keys j0..j0 + 7
      for (int i = 0; i < 8; ++i) _mm256_storeu_ps(kt + (c0 + i) * kKeys + j0, r[i]);
    }
#else
  for (int64_t j = 0; j < kKeys; ++j)
    for (int64_t c = 0; c < d; ++c) kt[c * kKeys + j] = kr[j * d + c];
#endif
}

#if defined(__AVX512BF16__)
// bf16 caches at avx512: q.k and p.v on vdpbf16ps, 32 products an instruction (twice the fp32
// FMAs'); each product is exact in fp32, each pair's sum rounded once (round to nearest even,
// denormal inputs read as 0), and p is rounded to bf16 (2^-9 relative) for p.v. A row's bits
// still depend only on its own inputs.
constexpr bool kDot = true;

inline __m512bh bh(__m512i v) { return reinterpret_cast<__m512bh>(v); }

// s for rows r0..r0 + kR - 1: q2 [rows][d2] and kt2 [d2][kKeys] as bf16 pairs along the head.
inline void scores_dot(const uint32_t* q2, const uint32_t* kt2, float* s, int64_t r0, int64_t d2) {
  __m512 a[kR];
  for (int64_t r = 0; r < kR; ++r) a[r] = _mm512_setzero_ps();
  for (int64_t c = 0; c < d2; ++c) {
    const __m512bh k = bh(_mm512_loadu_si512(kt2 + c * kKeys));
    for (int64_t r = 0; r < kR; ++r)
      a[r] = _mm512_dpbf16_ps(a[r], bh(_mm512_set1_epi32(static_cast<int>(q2[(r0 + r) * d2 + c]))), k);
  }
  for (int64_t r = 0; r < kR; ++r) _mm512_storeu_ps(s + (r0 + r) * kKeys, a[r]);
}

// acc_r += sum_j p[r, j] v_j for rows r0..r0 + kR - 1, head dims c..c + 16 NC - 1: pb [rows][8]
// and vp [8][d] as bf16 pairs along the keys.
template <int64_t NC>
inline void pv_dot_chunks(const uint32_t* pb, const uint32_t* vp, float* acc, int64_t r0, int64_t d,
                          int64_t c) {
  __m512 a[kR][NC];
  for (int64_t r = 0; r < kR; ++r)
    for (int64_t u = 0; u < NC; ++u) a[r][u] = _mm512_loadu_ps(acc + (r0 + r) * d + c + u * 16);
  for (int64_t i = 0; i < kKeys / 2; ++i) {
    __m512bh v[NC];
    for (int64_t u = 0; u < NC; ++u) v[u] = bh(_mm512_loadu_si512(vp + i * d + c + u * 16));
    for (int64_t r = 0; r < kR; ++r) {
      const __m512bh pr = bh(_mm512_set1_epi32(static_cast<int>(pb[(r0 + r) * (kKeys / 2) + i])));
      for (int64_t u = 0; u < NC; ++u) a[r][u] = _mm512_dpbf16_ps(a[r][u], pr, v[u]);
    }
  }
  for (int64_t r = 0; r < kR; ++r)
    for (int64_t u = 0; u < NC; ++u) _mm512_storeu_ps(acc + (r0 + r) * d + c + u * 16, a[r][u]);
}

inline void pv_dot(const uint32_t* pb, const uint32_t* vp, float* acc, int64_t r0, int64_t d) {
  int64_t c = 0;
  for (; c + 32 <= d; c += 32) pv_dot_chunks<2>(pb, vp, acc, r0, d, c);
  if (c < d) pv_dot_chunks<1>(pb, vp, acc, r0, d, c);
}

// vp [8][d] = (v[2i][c], v[2i + 1][c]) from vb [16][d] bf16 (d % 16 == 0).
inline void pair_values(const uint16_t* vb, uint32_t* vp, int64_t d) {
  alignas(64) static const uint16_t kIdx[64] = {
      0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39, 8, 40, 9, 41, 10, 42, 11, 43,
      12, 44, 13, 45, 14, 46, 15, 47, 16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54,
      23, 55, 24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i lo = _mm512_load_si512(kIdx), hi = _mm512_load_si512(kIdx + 32);
  for (int64_t i = 0; i < kKeys / 2; ++i)
    for (int64_t c = 0; c < d; c += 32) {
      const __mmask32 m = c + 32 <= d ? ~0u : 0xFFFFu;  // a last 16 dims
      const __m512i a = _mm512_maskz_loadu_epi16(m, vb + 2 * i * d + c);
      const __m512i b = _mm512_maskz_loadu_epi16(m, vb + (2 * i + 1) * d + c);
      _mm512_storeu_si512(vp + i * d + c, _mm512_permutex2var_epi16(a, lo, b));
      if (c + 32 <= d) _mm512_storeu_si512(vp + i * d + c + 16, _mm512_permutex2var_epi16(a, hi, b));
    }
}

// One group's products on the bf16 pairs: kb / vb hold the group's 16 keys as stored.
inline void group_dot(Scratch& sc, const int64_t k0, const int64_t tiles, const int64_t rows,
                      const int64_t q_first, const Geo& g) {
  const int64_t d = g.d;
  transpose_keys(reinterpret_cast<const float*>(sc.kb.data()), reinterpret_cast<float*>(sc.kt2.data()),
                 d / 2);
  pair_values(sc.vb.data(), sc.vp.data(), d);
  const uint32_t* q2 = reinterpret_cast<const uint32_t*>(sc.qb.data());
  for (int64_t t = 0; t < tiles; ++t) scores_dot(q2, sc.kt2.data(), sc.s.data(), t * kR, d / 2);
  for (int64_t r = 0; r < tiles * kR; ++r) {
    const int64_t rr = std::min(r, rows - 1);
    softmax_step(sc.s.data() + r * kKeys, sc.p.data() + r * kKeys, sc.acc.data() + r * d, sc.m[r],
                 sc.l.data() + r * W, q_first + rr / g.g, k0, g);
    const __m256bh pr = _mm512_cvtneps_pbh(_mm512_loadu_ps(sc.p.data() + r * kKeys));
    std::memcpy(sc.pb.data() + r * (kKeys / 2), &pr, sizeof(pr));
  }
  for (int64_t t = 0; t < tiles; ++t) pv_dot(sc.pb.data(), sc.vp.data(), sc.acc.data(), t * kR, d);
}
#else
constexpr bool kDot = false;
#endif

// One group's products in fp32: krow / vf hold the group's 16 keys widened.
inline void group_fp32(Scratch& sc, const int64_t k0, const int64_t tiles, const int64_t rows,
                       const int64_t q_first, const Geo& g) {
  const int64_t d = g.d;
  transpose_keys(sc.krow.data(), sc.kf.data(), d);
  for (int64_t t = 0; t < tiles; ++t) scores(sc.q.data(), sc.kf.data(), sc.s.data(), t * kR, d);
  for (int64_t r = 0; r < tiles * kR; ++r) {
    const int64_t rr = std::min(r, rows - 1);
    softmax_step(sc.s.data() + r * kKeys, sc.p.data() + r * kKeys, sc.acc.data() + r * d, sc.m[r],
                 sc.l.data() + r * W, q_first + rr / g.g, k0, g);
  }
  for (int64_t t = 0; t < tiles; ++t) pv(sc.p.data(), sc.vf.data(), sc.acc.data(), t * kR, d);
}

template <typename T>
constexpr bool dot_path() { return kDot && std::is_same<T, at::BFloat16>::value; }

template <typename T>
void run_item(const Item& it, const T* q, const T* kc, const T* vc, const int32_t* bt,
              const int32_t* lens, const int32_t* cu, const float* sinks, T* out, const Geo& g,
              Scratch& sc) {
  const int64_t L = lens[it.seq], n = cu[it.seq + 1] - cu[it.seq], d = g.d;
  const int64_t rows = it.nt * g.g, tiles = (rows + kR - 1) / kR;
  const int64_t q_first = L - n + it.t0, q_last = q_first + it.nt - 1;  // positions
  // Rows in (position, head) order; padding rows repeat the last one and are dropped.
  for (int64_t r = 0; r < tiles * kR; ++r) {
    const int64_t rr = std::min(r, rows - 1), t = rr / g.g, h = it.kvh * g.g + rr % g.g;
    const T* src = q + ((cu[it.seq] + it.t0 + t) * g.hq + h) * d;
    if constexpr (dot_path<T>()) std::memcpy(sc.qb.data() + r * d, src, d * 2);
    else widen(src, sc.q.data() + r * d, d);
  }
  std::fill(sc.acc.begin(), sc.acc.begin() + tiles * kR * d, 0.f);
  std::fill(sc.m.begin(), sc.m.begin() + tiles * kR, kNegInf);
  std::fill(sc.l.begin(), sc.l.begin() + tiles * kR * W, 0.f);
  const int64_t lo = g.window > 0 ? std::max<int64_t>(0, q_first - g.window + 1) : 0;
  const int64_t rs = g.hkv * d;  // elements between consecutive cache rows
  for (int64_t k0 = lo / kKeys * kKeys; k0 <= q_last; k0 += kKeys) {
    for (int64_t j = 0; j < kKeys; ++j) {
      const int64_t kp = k0 + j;
      // past the sequence: zero, never visible (the slot may hold anything)
      const int64_t off = kp >= L ? -1 : (bt[it.seq * g.max_blocks + kp / g.bs] * g.bs + kp % g.bs) * rs +
                                             it.kvh * d;
      if constexpr (dot_path<T>()) {
        uint16_t* kd = sc.kb.data() + j * d;
        uint16_t* vd = sc.vb.data() + j * d;
        if (off < 0) std::memset(kd, 0, d * 2), std::memset(vd, 0, d * 2);
        else std::memcpy(kd, kc + off, d * 2), std::memcpy(vd, vc + off, d * 2);
      } else {
        float* kd = sc.krow.data() + j * d;
        float* vd = sc.vf.data() + j * d;
        if (off < 0) std::memset(kd, 0, d * 4), std::memset(vd, 0, d * 4);
        else widen(kc + off, kd, d), widen(vc + off, vd, d);
      }
    }
#if defined(__AVX512BF16__)
    if constexpr (dot_path<T>()) {
      group_dot(sc, k0, tiles, rows, q_first, g);
      continue;
    }
#endif
    group_fp32(sc, k0, tiles, rows, q_first, g);
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t t = r / g.g, h = it.kvh * g.g + r % g.g;
    float l = hsum(ldw(sc.l.data() + r * W));
    if (sinks) l += flatserve::exp_poly(sinks[h] - sc.m[r]);
    const float inv = 1.f / l;
    T* o = out + ((cu[it.seq] + it.t0 + t) * g.hq + h) * d;
    const float* a = sc.acc.data() + r * d;
    for (int64_t c = 0; c < d; ++c) o[c] = static_cast<T>(a[c] * inv);
  }
}

// The work items in one list per thread, by their cost (rows x key groups walked), the costliest
// first into the least loaded list. A prompt's items cost more the later their rows, and the
// contiguous halves parallel_for gives 2 threads had one of them doing 3/4 of a long prompt.
std::vector<std::vector<int64_t>> balance(const std::vector<Item>& items, const int32_t* lens,
                                          const int32_t* cu, const Geo& g) {
  const int64_t n = static_cast<int64_t>(items.size());
  const int64_t nb = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), n));
  std::vector<int64_t> cost(n), order(n), load(nb, 0);
  for (int64_t i = 0; i < n; ++i) {
    const Item& it = items[i];
    const int64_t last = lens[it.seq] - (cu[it.seq + 1] - cu[it.seq]) + it.t0 + it.nt - 1;
    const int64_t first = g.window > 0 ? std::max<int64_t>(0, last - it.nt + 1 - g.window + 1) : 0;
    cost[i] = it.nt * (last / kKeys - first / kKeys + 1);
    order[i] = i;
  }
  std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return cost[a] > cost[b]; });
  std::vector<std::vector<int64_t>> bins(nb);
  for (int64_t i : order) {
    const int64_t t = std::min_element(load.begin(), load.end()) - load.begin();
    bins[t].push_back(i);
    load[t] += cost[i];
  }
  return bins;
}

template <typename T>
void run(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc, const at::Tensor& bt,
         const at::Tensor& lens, const int32_t* cu, const float* sinks, at::Tensor& out,
         const Geo& g, const std::vector<int64_t>& which) {
  const int64_t tq = std::max<int64_t>(1, kRows / g.g);  // positions per work item
  std::vector<Item> items;
  for (int64_t s : which) {
    const int64_t n = cu[s + 1] - cu[s];
    for (int64_t h = 0; h < g.hkv; ++h)
      for (int64_t t0 = 0; t0 < n; t0 += tq) items.push_back({s, h, t0, std::min(tq, n - t0)});
  }
  const T* qp = q.data_ptr<T>();
  const T* kp = kc.data_ptr<T>();
  const T* vp = vc.data_ptr<T>();
  const int32_t* btp = bt.data_ptr<int32_t>();
  const int32_t* lp = lens.data_ptr<int32_t>();
  T* op = out.data_ptr<T>();
  const int64_t rows = (tq * g.g + kR - 1) / kR * kR;
  const std::vector<std::vector<int64_t>> bins = balance(items, lp, cu, g);
  at::parallel_for(0, static_cast<int64_t>(bins.size()), 1, [&](int64_t a, int64_t b) {
    Scratch sc(rows, g.d, dot_path<T>());
    for (int64_t t = a; t < b; ++t)
      for (int64_t i : bins[t]) run_item<T>(items[i], qp, kp, vp, btp, lp, cu, sinks, op, g, sc);
  });
}

}  // namespace

// q [R, Hq, D]; sequence s's rows cu[s]..cu[s + 1] end at position seq_lens[s] - 1, each row
// causal over its sequence's paged keys (and inside the window) -> [R, Hq, D]. With `seqs`:
// only those sequences' rows, written into `out`.
at::Tensor paged_prompt(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_table, const at::Tensor& seq_lens,
                        const at::Tensor& cu_seqlens_q, double scale, int64_t window,
                        double softcap, const at::Tensor& sinks,
                        const c10::optional<at::Tensor>& seqs, const c10::optional<at::Tensor>& out_) {
  TORCH_CHECK(q.is_cpu() && k_cache.is_cpu() && v_cache.is_cpu() && block_table.is_cpu() &&
              seq_lens.is_cpu() && cu_seqlens_q.is_cpu(), "paged_prompt: CPU tensors only");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && q.is_contiguous() && k_cache.is_contiguous() &&
              v_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes(),
              "paged_prompt: contiguous q [R,Hq,D] and caches [N,bs,Hkv,D]");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && k_cache.scalar_type() == v_cache.scalar_type(),
              "paged_prompt: q and caches must share a dtype");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
              cu_seqlens_q.scalar_type() == at::kInt && block_table.is_contiguous() &&
              seq_lens.is_contiguous() && cu_seqlens_q.is_contiguous(), "paged_prompt: int32 metadata");
  Geo g{q.size(1), k_cache.size(2), q.size(1) / k_cache.size(2), q.size(2), k_cache.size(1),
        block_table.size(1), static_cast<float>(scale), static_cast<float>(softcap), window};
  TORCH_CHECK(g.hq % g.hkv == 0 && k_cache.size(3) == g.d && g.d % W == 0,
              "paged_prompt: head shapes (head size a multiple of ", W, ")");
  const int64_t S = seq_lens.size(0);
  TORCH_CHECK(block_table.size(0) == S && cu_seqlens_q.numel() == S + 1,
              "paged_prompt: one block-table row and cu_seqlens_q entry per sequence");
  const int32_t* cu = cu_seqlens_q.data_ptr<int32_t>();
  const int32_t* lp = seq_lens.data_ptr<int32_t>();
  TORCH_CHECK(cu[0] == 0 && cu[S] == q.size(0), "paged_prompt: cu_seqlens_q must span q's rows");
  const std::vector<int64_t> which = flatserve::sequence_list(seqs, S, "paged_prompt");
  for (int64_t s : which)
    TORCH_CHECK(cu[s + 1] >= cu[s] && cu[s + 1] - cu[s] <= lp[s] &&
                (lp[s] + g.bs - 1) / g.bs <= g.max_blocks,
                "paged_prompt: each sequence needs 0..seq_len rows and its blocks in the table");
  at::Tensor sk = sinks.numel() ? sinks.to(at::kFloat).contiguous() : sinks;
  TORCH_CHECK(!sinks.numel() || sinks.numel() == g.hq, "paged_prompt: one sink per query head");
  const float* sp = sinks.numel() ? sk.data_ptr<float>() : nullptr;
  at::Tensor out = flatserve::output_for(q, out_, "paged_prompt");
  switch (q.scalar_type()) {
    case at::kFloat: run<float>(q, k_cache, v_cache, block_table, seq_lens, cu, sp, out, g, which); break;
    case at::kBFloat16: run<at::BFloat16>(q, k_cache, v_cache, block_table, seq_lens, cu, sp, out, g, which); break;
    case at::kHalf: run<at::Half>(q, k_cache, v_cache, block_table, seq_lens, cu, sp, out, g, which); break;
    default: TORCH_CHECK(false, "paged_prompt: dtype must be float32, bfloat16 or float16");
  }
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("paged_prompt", &paged_prompt, "row-invariant paged prompt attention", py::arg("q"),
          py::arg("k_cache"), py::arg("v_cache"), py::arg("block_table"), py::arg("seq_lens"),
          py::arg("cu_seqlens_q"), py::arg("scale"), py::arg("window"), py::arg("softcap"),
          py::arg("sinks"), py::arg("seqs") = py::none(), py::arg("out") = py::none());
}
