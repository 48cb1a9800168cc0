// Paged prefill attention on Intel AMX tiles: sequences with long runs of new rows (prefill
// chunks), K/V read from the paged cache, bf16 only, causal with an optional sliding window.
//
// Why: the torch backend's per-sequence SDPA gathers each sequence's blocks into a new tensor,
// builds a [rows, keys] mask for chunks that continue a context (so a windowed chunk computes
// about twice the scores it keeps), and torch's CPU flash kernel's speed is uneven across
// lengths. At 16 concurrent requests that was ~40% of the prompt steps
// (benchmarks/dev/cpu_profile_step.py --prefill); this kernel against it per shape:
// benchmarks/dev/cpu_prefill_attention.py.
//
// Two passes in one parallel region:
// 1. Pack each (sequence, KV head)'s visible keys once: K as AMX B tiles of 16 keys x 32 head
//    dims (pair-interleaved, VNNI) for S = Q K^T, V as B tiles of 32 keys x 16 head dims for
//    O = P V. Padding keys past the end are zero and always masked.
// 2. Work items of 32 query rows (tokens x the g query heads of one KV head, which share the
//    keys) walk their visible key range in steps of up to 256 keys with an online softmax in
//    fp32: S by 2 x 2 tiles, scale and mask per row (causal, window), P rounded to bf16 (as flash
//    kernels do), O accumulated in fp32 tiles spilled per step (a 256-wide head is 16 tiles).
// Key steps start at the first 32-key group a work item can see, so windowed rows skip the
// keys behind their window instead of masking them.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "amx_tiles.h"
#include "cpu_math.h"
#include "seq_list.h"

namespace {

constexpr int64_t kRows = 32;    // query rows per work item: two 16-row A tiles
constexpr int64_t kKeys = 256;   // keys per softmax step (S: 32 x 256 fp32, 32 KB; 128 was 1.04-1.10x slower, 512 mixed)
constexpr int64_t kMaxHead = 256;  // O (32 x 256 fp32) and the Q block stay in L1/L2

struct Run {  // one sequence's rows, with the key range its rows can see, packed from k_lo
  int64_t seq, row0, n, q_start, k_lo, packed, off;  // off: first packed element in its batch
};

// Packed K+V bytes per batch of runs. Packing every sequence of a step at once would hold all
// their contexts twice (K and V; e.g. 120 chunks of 17 rows after 4,096-token contexts: ~1 GB
// for Gemma); batches keep it at this, or one sequence's context where that is larger, which is
// what the SDPA path's per-sequence gather held.
constexpr int64_t kPackBudget = int64_t{32} << 20;

struct Geo {
  int64_t hq, hkv, g, d, bs, max_blocks;
  float scale;
  int64_t window;  // <= 0: off; keys with pos > q_pos - window are visible
};

#ifdef FLATSERVE_AMX
// Cache row of key `pos` of a sequence (its block-table row `bt`), KV head h.
inline const uint16_t* key_row(const uint16_t* cache, const int32_t* bt, int64_t pos, int64_t h,
                               const Geo& g) {
  const int64_t slot = static_cast<int64_t>(bt[pos / g.bs]) * g.bs + pos % g.bs;
  return cache + (slot * g.hkv + h) * g.d;
}

// Pass 1, one 32-key group of one (run, KV head). K tile (group of 16 keys kg, dims step ks) at
// kp + (kg * D/32 + ks) * 512: u32 word [r][n] = K[n][32 ks + 2r .. +1]. V tile (keys step kv,
// dims tile dt) at vp + (kv * D/16 + dt) * 512: u32 word [r][n] = (V[2r][16 dt + n], V[2r + 1][..]).
// In vector code: K as 16 x 16 transposes of u32 words, V as pairs of rows interleaved by one
// two-source permute per 16 words. Scalar loops here took ~22% of the kernel (perf, Gemma's
// shape: one 16-bit store per V element).
void pack_group(const uint16_t* kc, const uint16_t* vc, const int32_t* bt, int64_t L,
                const Run& r, int64_t h, int64_t grp, uint16_t* kp, uint16_t* vp, const Geo& g) {
  const int64_t KS = g.d / 32, DT = g.d / 16;
  const uint16_t* kr[32];
  const uint16_t* vr[32];
  for (int64_t i = 0; i < 32; ++i) {  // rows past the sequence's end pack as zeros
    const int64_t pos = r.k_lo + grp * 32 + i;
    kr[i] = pos < L ? key_row(kc, bt, pos, h, g) : nullptr;
    vr[i] = pos < L ? key_row(vc, bt, pos, h, g) : nullptr;
  }
  auto load = [](const uint16_t* row, int64_t at) {
    return row ? _mm512_loadu_si512(row + at) : _mm512_setzero_si512();
  };
  for (int64_t half = 0; half < 2; ++half)
    for (int64_t ks = 0; ks < KS; ++ks) {
      __m512 t[16];
      for (int n = 0; n < 16; ++n) t[n] = _mm512_castsi512_ps(load(kr[half * 16 + n], ks * 32));
      flatserve::transpose16(t);
      float* dst = reinterpret_cast<float*>(kp) + ((grp * 2 + half) * KS + ks) * 256;
      for (int w = 0; w < 16; ++w) _mm512_storeu_ps(dst + w * 16, t[w]);
    }
  // Word n of a V tile row: (a[16 dt' + n], b[16 dt' + n]) for rows a, b and dt' the 32-dim
  // chunk's first (lo) or second (hi) 16 dims; indices >= 32 pick from b.
  alignas(64) static const uint16_t lo_idx[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
      8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static const uint16_t hi_idx[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54,
      23, 55, 24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i il = _mm512_load_si512(lo_idx), ih = _mm512_load_si512(hi_idx);
  for (int64_t kv = 0; kv < 16; ++kv)
    for (int64_t m = 0; m < g.d / 32; ++m) {
      const __m512i a = load(vr[2 * kv], m * 32), b = load(vr[2 * kv + 1], m * 32);
      uint16_t* dst = vp + (grp * DT + 2 * m) * 512 + kv * 32;
      _mm512_storeu_si512(dst, _mm512_permutex2var_epi16(a, il, b));
      _mm512_storeu_si512(dst + 512, _mm512_permutex2var_epi16(a, ih, b));
    }
}

struct Scratch {  // one thread's buffers for one work item
  alignas(64) uint16_t q[kRows * kMaxHead];
  alignas(64) float s[kRows * kKeys];
  alignas(64) uint16_t p[kRows * kKeys];
  alignas(64) float o[kRows * kMaxHead];
  float m[kRows], l[kRows];
};

// S[32, bk] = Q[32, D] K^T over packed keys pj.. (pj a multiple of 32).
void scores(Scratch& w, const uint16_t* kp, int64_t pj, int64_t bk, const Geo& g) {
  const int64_t KS = g.d / 32;
  for (int64_t nt = 0; nt < bk / 32; ++nt) {
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    const uint16_t* b = kp + ((pj / 16 + 2 * nt) * KS) * 512;
    for (int64_t ks = 0; ks < KS; ++ks) {
      _tile_loadd(4, w.q + ks * 32, g.d * 2);
      _tile_loadd(5, w.q + 16 * g.d + ks * 32, g.d * 2);
      _tile_loadd(6, b + ks * 512, 64);
      _tile_loadd(7, b + (KS + ks) * 512, 64);
      _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
    }
    float* s = w.s + nt * 32;
    _tile_stored(0, s, bk * 4); _tile_stored(1, s + 16, bk * 4);
    _tile_stored(2, s + 16 * bk, bk * 4); _tile_stored(3, s + 16 * bk + 16, bk * 4);
  }
}

// Lanes c..c + 15 of a step that fall inside [a, b).
inline __mmask16 lanes(int64_t c, int64_t a, int64_t b) {
  const int64_t lo = std::clamp<int64_t>(a - c, 0, 16), hi = std::clamp<int64_t>(b - c, 0, 16);
  return static_cast<__mmask16>(((1u << hi) - 1) & ~((1u << lo) - 1));
}

// Online softmax of rows m0..m0 + R - 1 (one token's query heads: the same keys visible) over
// keys [a, b) of the step (the rest masked): P rows in bf16, running max and sum updated, O rows
// rescaled where the max moved. Written in intrinsics: as plain loops GCC kept the max and the
// sum as serial scalar chains (no -ffast-math), ~4 cycles a score. The R rows go side by side,
// so that each chain (max, sum) has R independent neighbours and the masks are made once. The
// max is taken over the raw scores (scale > 0 and rounding is monotonic: the same bits as the
// max of the scaled ones), and exp(s scale - max) as 2^(s (scale log2 e) - max log2 e), one FMA;
// vectors wholly inside [a, b) skip the mask. Row by row, without these, the softmax was ~1/3 of
// the kernel (scratch runs with each phase left out); benchmarks/dev/cpu_prefill_ab.py for the A/B.
template <int R>
void softmax_rows(Scratch& w, int64_t m0, int64_t a, int64_t b, int64_t bk, const Geo& g) {
  if (a >= b) {
    std::memset(w.p + m0 * bk, 0, R * bk * 2);
    return;
  }
  const float* s = w.s + m0 * bk;
  uint16_t* p = w.p + m0 * bk;
  __m512 vmx[R], vsum[R], k2 = _mm512_set1_ps(g.scale * 1.4426950408889634f), shift[R];
  for (int r = 0; r < R; ++r) vmx[r] = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (int64_t c = a / 16 * 16; c < b; c += 16) {
    const __mmask16 k = lanes(c, a, b);
    for (int r = 0; r < R; ++r) vmx[r] = _mm512_mask_max_ps(vmx[r], k, vmx[r], _mm512_loadu_ps(s + r * bk + c));
  }
  float m_new[R];
  for (int r = 0; r < R; ++r) {
    m_new[r] = std::max(w.m[m0 + r], _mm512_reduce_max_ps(vmx[r]) * g.scale);
    shift[r] = _mm512_set1_ps(m_new[r] * 1.4426950408889634f);
    vsum[r] = _mm512_setzero_ps();
  }
  for (int64_t c = 0; c < bk; c += 16) {
    const bool whole = c >= a && c + 16 <= b;
    const __mmask16 k = whole ? static_cast<__mmask16>(0xFFFF) : lanes(c, a, b);
    for (int r = 0; r < R; ++r) {
      __m512 e = _mm512_setzero_ps();
      if (k) e = flatserve::exp2_16(_mm512_fmsub_ps(_mm512_loadu_ps(s + r * bk + c), k2, shift[r]));
      if (!whole) e = _mm512_maskz_mov_ps(k, e);
      vsum[r] = _mm512_add_ps(vsum[r], e);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + r * bk + c),
                          reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(e)));
    }
  }
  for (int r = 0; r < R; ++r) {
    const int64_t m = m0 + r;
    // O and l are still zero before the row's first visible key: nothing to rescale (and no
    // vector stores for the next tile loads of O to wait on).
    if (m_new[r] != w.m[m] && w.m[m] != -std::numeric_limits<float>::infinity()) {
      const __m512 va = _mm512_set1_ps(flatserve::exp_poly(w.m[m] - m_new[r]));
      float* o = w.o + m * g.d;
      for (int64_t c = 0; c < g.d; c += 16) _mm512_storeu_ps(o + c, _mm512_mul_ps(_mm512_loadu_ps(o + c), va));
      w.l[m] *= va[0];
    }
    w.m[m] = m_new[r];
    w.l[m] += _mm512_reduce_add_ps(vsum[r]);
  }
}

// O[32, D] += P[32, bk] V over packed keys pj..; O spilled per 2 x 2 tile group.
void accumulate(Scratch& w, const uint16_t* vp, int64_t pj, int64_t bk, const Geo& g) {
  const int64_t DT = g.d / 16;
  for (int64_t dp = 0; dp < g.d / 32; ++dp) {
    float* o = w.o + dp * 32;
    _tile_loadd(0, o, g.d * 4); _tile_loadd(1, o + 16, g.d * 4);
    _tile_loadd(2, o + 16 * g.d, g.d * 4); _tile_loadd(3, o + 16 * g.d + 16, g.d * 4);
    for (int64_t ks = 0; ks < bk / 32; ++ks) {
      const uint16_t* b = vp + ((pj / 32 + ks) * DT + 2 * dp) * 512;
      _tile_loadd(4, w.p + ks * 32, bk * 2);
      _tile_loadd(5, w.p + 16 * bk + ks * 32, bk * 2);
      _tile_loadd(6, b, 64);
      _tile_loadd(7, b + 512, 64);
      _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
    }
    _tile_stored(0, o, g.d * 4); _tile_stored(1, o + 16, g.d * 4);
    _tile_stored(2, o + 16 * g.d, g.d * 4); _tile_stored(3, o + 16 * g.d + 16, g.d * 4);
  }
}

// Pass 2, one work item: tokens t0..t1 of run r, KV head h; rows are (token, head in group).
void attend_block(Scratch& w, const uint16_t* q, uint16_t* out, const uint16_t* kp,
                  const uint16_t* vp, const Run& r, int64_t h, int64_t t0, int64_t t1, const Geo& g) {
  const int64_t M = (t1 - t0) * g.g;
  for (int64_t m = 0; m < kRows; ++m) {
    uint16_t* dst = w.q + m * g.d;
    if (m < M) std::memcpy(dst, q + ((r.row0 + t0 + m / g.g) * g.hq + h * g.g + m % g.g) * g.d, g.d * 2);
    else std::memset(dst, 0, g.d * 2);
    w.m[m] = -std::numeric_limits<float>::infinity();
    w.l[m] = 0.f;
  }
  std::memset(w.o, 0, sizeof(float) * kRows * g.d);
  const int64_t first = r.q_start + t0, last = r.q_start + t1 - 1;
  const int64_t lo = g.window > 0 ? std::max(r.k_lo, first - g.window + 1) : r.k_lo;
  // Steps keyed to absolute positions (k_lo is a multiple of kKeys); steps wholly behind a
  // row's window are no-ops for it (softmax_rows: empty range, P zero, m and l untouched).
  for (int64_t pj = (lo - r.k_lo) / kKeys * kKeys; pj < last + 1 - r.k_lo; pj += kKeys) {
    const int64_t bk = std::min(kKeys, (last + 1 - r.k_lo - pj + 31) / 32 * 32);
    scores(w, kp, pj, bk, g);
    const int64_t base = r.k_lo + pj;  // position of the step's first key
    // Rows in runs of R of one token (R: 4, 2 or 1, dividing g and so each token's rows).
    const int64_t R = g.g % 4 == 0 ? 4 : g.g % 2 == 0 ? 2 : 1;
    for (int64_t m = 0; m < kRows; m += R) {
      if (m >= M) { std::memset(w.p + m * bk, 0, R * bk * 2); continue; }
      const int64_t pos = first + m / g.g;
      const int64_t a = g.window > 0 ? std::max<int64_t>(0, pos - g.window + 1 - base) : 0;
      const int64_t b = std::min(bk, pos + 1 - base);
      if (R == 4) softmax_rows<4>(w, m, a, b, bk, g);
      else if (R == 2) softmax_rows<2>(w, m, a, b, bk, g);
      else softmax_rows<1>(w, m, a, b, bk, g);
    }
    accumulate(w, vp, pj, bk, g);
  }
  for (int64_t m = 0; m < M; ++m) {
    uint16_t* dst = out + ((r.row0 + t0 + m / g.g) * g.hq + h * g.g + m % g.g) * g.d;
    const float inv = 1.f / w.l[m];  // every row sees at least its own key
    for (int64_t c = 0; c < g.d; c += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c), reinterpret_cast<__m256i>(
                              _mm512_cvtneps_pbh(_mm512_mul_ps(_mm512_loadu_ps(w.o + m * g.d + c),
                                                               _mm512_set1_ps(inv)))));
  }
}

struct Item { int64_t run, h, t0, t1, cost; };

void run_all(const uint16_t* q, const uint16_t* kc, const uint16_t* vc, const int32_t* table,
             const int32_t* lens, const std::vector<Run>& runs, uint16_t* kp, uint16_t* vp,
             uint16_t* out, const Geo& g) {
  std::vector<int64_t> packs;  // (run, head, 32-key group) flattened
  std::vector<Item> items;
  const int64_t bq = kRows / g.g;  // tokens per work item
  for (int64_t i = 0; i < static_cast<int64_t>(runs.size()); ++i) {
    const Run& r = runs[i];
    for (int64_t h = 0; h < g.hkv; ++h) {
      for (int64_t grp = 0; grp < r.packed / 32; ++grp) packs.push_back((i * g.hkv + h) << 24 | grp);
      for (int64_t t0 = 0; t0 < r.n; t0 += bq) {
        const int64_t t1 = std::min(r.n, t0 + bq), last = r.q_start + t1;
        const int64_t keys = g.window > 0 ? std::min(last, g.window + t1 - t0) : last;
        items.push_back({i, h, t0, t1, keys});
      }
    }
  }
  // Most keys first, handed out one at a time: rows near a long context's end see many more
  // keys than its first rows, and a static split left one core idle.
  std::stable_sort(items.begin(), items.end(), [](const Item& a, const Item& b) { return a.cost > b.cost; });
  const int64_t np = static_cast<int64_t>(packs.size()), ni = static_cast<int64_t>(items.size());
#pragma omp parallel num_threads(at::get_num_threads())
  {
    flatserve::load_tile_config();
    std::vector<Scratch> scratch(1);
#pragma omp for schedule(dynamic, 4)
    for (int64_t i = 0; i < np; ++i) {
      const int64_t rh = packs[i] >> 24, grp = packs[i] & ((1 << 24) - 1);
      const Run& r = runs[rh / g.hkv];
      const int64_t h = rh % g.hkv, off = r.off + h * r.packed * g.d;
      pack_group(kc, vc, table + r.seq * g.max_blocks, lens[r.seq], r, h, grp, kp + off, vp + off, g);
    }
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < ni; ++i) {
      const Item& it = items[i];
      const Run& r = runs[it.run];
      const int64_t off = r.off + it.h * r.packed * g.d;
      attend_block(scratch[0], q, out, kp + off, vp + off, r, it.h, it.t0, it.t1, g);
    }
    _tile_release();
  }
}
#endif

bool available() { return flatserve::amx_available(); }

// q [R, Hq, D] bf16; caches [num_blocks, block_size, Hkv, D] bf16; block_table [S, max_blocks],
// seq_lens [S], cu_seqlens_q [S + 1] int32: sequence s's rows are q[cu[s]:cu[s + 1]], the last at
// position seq_lens[s] - 1, each seeing the keys up to its own position (and inside the window).
// seqs (int32, optional): only these sequences, their rows written into `out` (optional, q's
// shape; its other rows untouched). A step that mixes decodes with prefill chunks sends each
// kind to its kernel this way instead of gathering q's rows and scattering the outputs (index +
// index_put: ~0.1 s of 1.8 s of prompt steps at 16 requests, benchmarks/dev/cpu_profile_step.py).
at::Tensor paged_prefill(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& block_table, const at::Tensor& seq_lens,
                         const at::Tensor& cu_seqlens_q, double scale, int64_t window,
                         const c10::optional<at::Tensor>& seqs, const c10::optional<at::Tensor>& out_) {
  TORCH_CHECK(available(), "paged_prefill: AMX bf16 tiles are not available in this process");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && q.is_contiguous() && k_cache.is_contiguous() &&
              v_cache.is_contiguous() && q.scalar_type() == at::kBFloat16 &&
              k_cache.scalar_type() == at::kBFloat16 && v_cache.scalar_type() == at::kBFloat16,
              "paged_prefill: contiguous bf16 q [R, Hq, D] and caches [N, bs, Hkv, D]");
  TORCH_CHECK(block_table.scalar_type() == at::kInt && seq_lens.scalar_type() == at::kInt &&
              cu_seqlens_q.scalar_type() == at::kInt && block_table.is_contiguous() &&
              seq_lens.is_contiguous() && cu_seqlens_q.is_contiguous(), "paged_prefill: int32 metadata");
  const Geo g{q.size(1), k_cache.size(2), q.size(1) / k_cache.size(2), q.size(2), k_cache.size(1),
              block_table.size(1), static_cast<float>(scale), window};
  TORCH_CHECK(g.hq % g.hkv == 0 && g.g <= kRows && k_cache.size(3) == g.d && g.d % 32 == 0 &&
              g.d <= kMaxHead, "paged_prefill: head size a multiple of 32 up to 256, at most 32 query "
              "heads per KV head");
  const int64_t S = seq_lens.size(0);
  TORCH_CHECK(block_table.size(0) == S && cu_seqlens_q.numel() == S + 1,
              "paged_prefill: one block-table row and cu_seqlens_q entry per sequence");
  const int32_t* cu = cu_seqlens_q.data_ptr<int32_t>();
  const int32_t* lp = seq_lens.data_ptr<int32_t>();
  TORCH_CHECK(cu[0] == 0 && cu[S] == q.size(0), "paged_prefill: cu_seqlens_q must span q's rows");
  const std::vector<int64_t> which = flatserve::sequence_list(seqs, S, "paged_prefill");
  std::vector<std::vector<Run>> batches(1);
  int64_t total = 0, most = 0;  // packed elements of the current batch, of the largest one
  for (const int64_t s : which) {
    const int64_t n = cu[s + 1] - cu[s], L = lp[s];
    TORCH_CHECK(n >= 1 && n <= L && (L + g.bs - 1) / g.bs <= g.max_blocks,
                "paged_prefill: each sequence needs 1..seq_len rows and its blocks in the table");
    const int64_t q_start = L - n;
    // Softmax steps start at absolute multiples of kKeys (k_lo is one): a row's steps, and so
    // its bits, do not depend on which rows share its chunk or tile. From the window's start
    // they had depended on the chunk's first row, so a windowed prompt's rows differed whole
    // and chunked (tests/attention/test_cpu_prefill.py, window 40, on an AMX host).
    const int64_t k_lo = window > 0 ? std::max<int64_t>(0, q_start - window + 1) / kKeys * kKeys : 0;
    const int64_t packed = (L - k_lo + 31) / 32 * 32;
    const int64_t size = g.hkv * packed * g.d;
    if (!batches.back().empty() && (total + size) * 4 > kPackBudget) {
      batches.emplace_back();
      total = 0;
    }
    batches.back().push_back({s, cu[s], n, q_start, k_lo, packed, total});
    total += size;
    most = std::max(most, total);
  }
  at::Tensor out = flatserve::output_for(q, out_, "paged_prefill");
#ifdef FLATSERVE_AMX
  at::Tensor kp = at::empty({most}, q.options()), vp = at::empty({most}, q.options());
  auto u16 = [](const at::Tensor& t) { return reinterpret_cast<uint16_t*>(t.data_ptr()); };
  for (const std::vector<Run>& runs : batches)
    run_all(u16(q), u16(k_cache), u16(v_cache), block_table.data_ptr<int32_t>(), lp, runs, u16(kp),
            u16(vp), u16(out), g);
#endif
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, mod) {
  mod.def("available", &available, "AMX bf16 compiled in and tile state granted to this process");
  mod.def("paged_prefill", &paged_prefill, "paged prefill attention on AMX tiles, KV read in place",
          py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_table"),
          py::arg("seq_lens"), py::arg("cu_seqlens_q"), py::arg("scale"), py::arg("window"),
          py::arg("seqs") = py::none(), py::arg("out") = py::none());
}
