// bf16 y[M, N] = x[M, K] @ W[N, K]^T on Intel AMX tiles, W packed once at load (flatserve/model/amx.py).
//
// Why: a CPU decode step is a weight read. oneDNN's pre-packed path read Gemma 3's 262k x 640 LM
// head at ~60% of this box's copy rate, and its per-call overhead doubled the time of the small
// per-layer linears (1-5 MB). This kernel streams each weight exactly once for M <= 32 rows, with
// a software prefetch two k-steps ahead. Measured A/B against oneDNN: benchmarks/dev/cpu_gemv.py.
//
// Packed layout [N/64][K/32][4][16][16][2]: for a group of 64 output columns, each 32-wide k step
// is four 1 KB B tiles in AMX's pair-interleaved (VNNI) form, so a group's panel is one
// contiguous stream. A tiles are read straight from x (row stride K), zero-padded to whole
// 16-row blocks. Accumulation is fp32 inside the tiles; the result is rounded to bf16 once (RNE),
// as oneDNN and F.linear do.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "amx_tiles.h"
#include "cpu_math.h"
#include "greedy_amx.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

#ifdef FLATSERVE_AMX
constexpr int64_t kGroupBytes = 4 * 1024;  // one k step of a 64-column group: four B tiles
constexpr int kPrefetch = 2 * kGroupBytes; // best of 0 / 4 / 8 KB on the LM head at 16 rows

// Rounds 16 fp32 rows of one C tile's spill buffer (+ its 16 bias values, or none) into y
// (row stride N), rows < `rows` only: the bias joins before the one rounding, as in F.linear.
inline void store_rows(const float (*c)[16], const at::BFloat16* bias, at::BFloat16* y, int64_t N,
                       int64_t rows) {
  const __m512 b = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias))), 16))
                        : _mm512_setzero_ps();
  for (int64_t r = 0; r < rows; ++r)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * N), reinterpret_cast<__m256i>(
                            _mm512_cvtneps_pbh(_mm512_add_ps(_mm512_load_ps(c[r]), b))));
}

// Gated epilogue (a gate_up projection repacked by AMXLinear.make_gated): each 64-column group
// holds gate columns 32g..32g+15, up 32g..32g+15, gate 32g+16..32g+31, up 32g+16..32g+31, and the
// GEMM writes act(gate) * up, [M, N/2], instead of [M, N]. Saves the [M, N] round trip through
// memory and the act_and_mul call: 2,048 prompt rows of Gemma's 4,096-wide gate_up write
// 16 MB, which act_and_mul reads back.
enum Act : int { kNone = 0, kSilu = 1, kGelu = 2 };

// Two spilled C tiles (gate, up: 16 rows x the same 16 columns) -> y rows < `rows` (stride ldy):
// each rounded to bf16 as the plain epilogue would store it, then act_and_mul's maths.
inline void store_gated(const float (*g)[16], const float (*u)[16], at::BFloat16* y, int64_t ldy,
                        int64_t rows, int act) {
  for (int64_t r = 0; r < rows; ++r) {
    const __m512 a = flatserve::round_bf16(_mm512_load_ps(g[r]));
    const __m512 b = flatserve::round_bf16(_mm512_load_ps(u[r]));
    const __m256i out = act == kGelu ? flatserve::act_mul_bf16x16<true>(a, b)
                                     : flatserve::act_mul_bf16x16<false>(a, b);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + r * ldy), out);
  }
}

struct Problem {  // one call: x [M(padded), K], W packed, bias [N] or null, y [M, N] (gated: N/2)
  const char* x;
  const char* w;
  const at::BFloat16* bias;
  at::BFloat16* y;
  int64_t M, N, K;
  int act = kNone;
  const at::BFloat16* bias_at(int64_t col) const { return bias ? bias + col : nullptr; }
  // Tiles (gate, up) at packed columns col.., col + 16.. -> output column col / 2 (col % 32 == 0).
  void store_pair(const float (*g)[16], const float (*u)[16], int64_t row0, int64_t col,
                  int64_t rows) const {
    store_gated(g, u, y + row0 * (N / 2) + col / 2, N / 2, rows, act);
  }
};

// A 1 x 4 unit's C tiles (one row block x 64 columns), spilled, and the epilogue rows of them
// still to store; gemm_1x4 stores them during the next unit's k loop (as gemm_2x2's Spill).
// Not two of those Spills (one row block each, half their buffer unused): that ran 18 layers of
// decode linears 0.98x, three runs of benchmarks/dev/cpu_layer_ab.py --rows 16.
struct Spill4 {
  alignas(64) float c[4][16][16];
  int64_t row0 = 0, col = 0;
  int rows = 0, done = 0;
};

inline void spill4_rows(const Problem& p, Spill4& s, int upto) {
  for (const int end = std::min(upto, s.rows); s.done < end; ++s.done) {
    const int r = s.done;
    const int64_t row = s.row0 + r;
    if (p.act != kNone) {
      p.store_pair(&s.c[0][r], &s.c[1][r], row, s.col, 1);
      p.store_pair(&s.c[2][r], &s.c[3][r], row, s.col + 32, 1);
      continue;
    }
    for (int j = 0; j < 4; ++j)
      store_rows(&s.c[j][r], p.bias_at(s.col + j * 16), p.y + row * p.N + s.col + j * 16, p.N, 1);
  }
}

// Up to 2 row blocks: 1 x 4 tiles (C0..C3 one row block x 64 columns); the weight panel is read
// from memory once and, for a second row block, again from L2 (80 KB at K = 640). Each unit's
// rows are stored during the next unit's k loop, one or more a step, instead of after its own:
// Gemma's 18 layers of decode linears at 16 rows (benchmarks/dev/cpu_layer_ab.py --rows 16, two
// runs) 6.9 -> 6.7 and 6.7 -> 6.6 ms.
void gemm_1x4(const Problem& p, int64_t g0, int64_t g1) {
  const int64_t M = p.M, K = p.K, KB = K / 32;
  const int per_step = static_cast<int>((16 + KB - 1) / KB);
  Spill4 spill[2];
  int cur = 0;  // the spill the next unit writes; the other is pending
  for (int64_t g = g0; g < g1; ++g) {
    const char* wg = p.w + g * KB * kGroupBytes;
    for (int64_t rb = 0; rb * 16 < M; ++rb) {
      const char* xa = p.x + rb * 16 * K * 2;
      Spill4& prev = spill[cur ^ 1];
      _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
      for (int64_t kb = 0; kb < KB; ++kb) {
        const char* wk = wg + kb * kGroupBytes;
        for (int b = 0; b < kGroupBytes; b += 64) _mm_prefetch(wk + kPrefetch + b, _MM_HINT_T0);
        _tile_loadd(4, xa + kb * 64, K * 2);
        _tile_loadd(5, wk, 64);        _tile_dpbf16ps(0, 4, 5);
        _tile_loadd(6, wk + 1024, 64); _tile_dpbf16ps(1, 4, 6);
        _tile_loadd(5, wk + 2048, 64); _tile_dpbf16ps(2, 4, 5);
        _tile_loadd(6, wk + 3072, 64); _tile_dpbf16ps(3, 4, 6);
        spill4_rows(p, prev, prev.done + per_step);
      }
      spill4_rows(p, prev, prev.rows);
      Spill4& s = spill[cur];
      _tile_stored(0, s.c[0], 64); _tile_stored(1, s.c[1], 64);
      _tile_stored(2, s.c[2], 64); _tile_stored(3, s.c[3], 64);
      s.row0 = rb * 16;
      s.col = g * 64;
      s.rows = static_cast<int>(std::min<int64_t>(16, M - rb * 16));
      s.done = 0;
      cur ^= 1;
    }
  }
  spill4_rows(p, spill[cur ^ 1], spill[cur ^ 1].rows);
}

// A 2 x 2 unit's C tiles, spilled, and the epilogue rows of them still to store. gemm_2x2 runs
// them between the next unit's tile products: run after the unit, as before, the epilogue (the
// gated one above all: ~30 vector instructions with a divide per 16 outputs) was ~25% of a
// 2,048-row gate_up GEMM (perf), the tile unit idle meanwhile; interleaved, the core's
// out-of-order window runs both. Same operations on the same values: the same bits.
struct Spill {
  alignas(64) float c[2][2][16][16];  // [row block h][column tile j][row][column]
  int64_t row0 = 0, col = 0;          // first row; first packed column (g * 64 + jp * 16)
  int rows[2] = {0, 0}, done = 0;     // rows of each row block; epilogue rows stored so far
  int total() const { return rows[0] + rows[1]; }
};

// Epilogue row i of the spill (row block i / rows[0], ...): 32 output columns (gated: 16).
inline void spill_row(const Problem& p, const Spill& s, int i) {
  const int h = i < s.rows[0] ? 0 : 1, r = h ? i - s.rows[0] : i;
  const int64_t row = s.row0 + h * 16 + r;
  if (p.act != kNone) {
    p.store_pair(&s.c[h][0][r], &s.c[h][1][r], row, s.col, 1);
    return;
  }
  for (int j = 0; j < 2; ++j)
    store_rows(&s.c[h][j][r], p.bias_at(s.col + j * 16), p.y + row * p.N + s.col + j * 16, p.N, 1);
}

inline void spill_rows(const Problem& p, Spill& s, int upto) {
  for (const int end = std::min(upto, s.total()); s.done < end; ++s.done) spill_row(p, s, s.done);
}

// More rows (verify steps, prefill chunks): 2 x 2 tiles, each loaded A and B tile used twice.
// B tiles load with the streaming hint (TILELOADDT1): a unit's B (40 KB at K = 640) is used
// once per row slab, while the slab's A rows (also 40 KB) serve every unit of the block; with
// plain loads the B lines evicted A from the 48 KB L1 each unit (least recently used), and
// both came from L2, 4 KB per 4 tile products. benchmarks/dev/cpu_gemm_ab.py, 2,048 rows (two
// runs): gate_up 1.17x, qkv 1.20-1.25x, o 1.10-1.12x, down (K = 2,048: A 128 KB, no fit) 1.04x;
// cpu_layer_ab.py (18 layers with the norms) 172.8 -> 161.0 ms.
// The thread's columns go in blocks of about 768 KB of weight, which stay in L2 while slabs of
// `slab` row blocks sweep them; within a slab each half-group (32 columns) meets all its row
// pairs in turn, from L1. A verify step's rows (<= 64) are one slab of 4, so every weight byte
// comes from memory once; longer runs go in slabs of one row pair. x is padded to an even
// number of row blocks. Each unit's epilogue runs during the next unit's k loop (Spill).
void gemm_2x2(const Problem& p, int64_t g0, int64_t g1, int64_t slab) {
  const int64_t M = p.M, K = p.K, KB = K / 32, RB = (M + 31) / 32 * 2;
  const int64_t GB = std::max<int64_t>(1, (768 * 1024) / (KB * kGroupBytes));
  const int per_step = static_cast<int>((32 + KB - 1) / KB);  // epilogue rows per k step
  Spill spill[2];
  int cur = 0;  // the spill the next unit writes; the other is pending
  for (int64_t gb = g0; gb < g1; gb += GB)
    for (int64_t r0 = 0; r0 < RB; r0 += slab)
      for (int64_t g = gb; g < std::min(g1, gb + GB); ++g)
        for (int jp = 0; jp < 4; jp += 2)
          for (int64_t rb = r0; rb < std::min(RB, r0 + slab); rb += 2) {
            const char* wj = p.w + g * KB * kGroupBytes + jp * 1024;
            const char* xa = p.x + rb * 16 * K * 2;
            const char* xb = xa + 16 * K * 2;
            Spill& prev = spill[cur ^ 1];
            _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
            for (int64_t kb = 0; kb < KB; ++kb) {
              const char* wk = wj + kb * kGroupBytes;
              _tile_loadd(4, xa + kb * 64, K * 2);
              _tile_stream_loadd(6, wk, 64);        _tile_dpbf16ps(0, 4, 6);
              _tile_stream_loadd(7, wk + 1024, 64); _tile_dpbf16ps(1, 4, 7);
              _tile_loadd(5, xb + kb * 64, K * 2);
              _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
              spill_rows(p, prev, prev.done + per_step);
            }
            spill_rows(p, prev, prev.total());
            Spill& s = spill[cur];
            _tile_stored(0, s.c[0][0], 64); _tile_stored(1, s.c[0][1], 64);
            _tile_stored(2, s.c[1][0], 64); _tile_stored(3, s.c[1][1], 64);
            s.row0 = rb * 16;
            s.col = g * 64 + jp * 16;
            for (int h = 0; h < 2; ++h)
              s.rows[h] = static_cast<int>(std::clamp<int64_t>(M - (rb + h) * 16, 0, 16));
            s.done = 0;
            cur ^= 1;
          }
  spill_rows(p, spill[cur ^ 1], spill[cur ^ 1].total());
}

// Prompt-sized calls (>= 512 rows a thread) split rows, not columns, between threads: each
// thread computes every column of its own rows (whole row pairs, gemm_2x2's blocking within
// them). Every thread then reads the whole weight (1-5 MB a layer; from L3 after the first), but
// only its own rows of x (2.6-8 MB at 2,048 rows), and the norms that follow, which split rows
// the same way (at::parallel_for's equal ranges), find their rows in their own core's caches
// instead of half of each row in the other core's L2. Gemma's 18 layers of linears and norm
// pairs (benchmarks/dev/cpu_layer_ab.py --rev c3b7fb3, 2 threads): 187.5 -> 174.8 ms at 2,048 rows,
// 96.0 -> 92.5 at 1,024. The GEMMs alone gain ~3% at 2,048 rows and lose below 1,024 (0.89x at
// 256; scratch sweep). The bar is per thread, so that a many-core machine does not hand each
// thread a sliver of rows that streams the whole weight for little work (not measured there).
// Same tile products in the same order per output: the same bits as the column split.
constexpr int64_t kRowSplit = 512;  // rows per thread

void gemm_row_halves(const Problem& p, int64_t padded) {
  const int64_t pairs = padded / 32;
  at::parallel_for(0, pairs, 1, [&](int64_t r0, int64_t r1) {
    Problem q = p;
    q.x = p.x + r0 * 32 * p.K * 2;
    q.y = p.y + r0 * 32 * (p.act == kNone ? p.N : p.N / 2);
    q.M = std::min(p.M, r1 * 32) - r0 * 32;
    flatserve::load_tile_config();
    gemm_2x2(q, 0, p.N / 64, 2);
    _tile_release();
  });
}

// ---- The plain layout: W [N, K] as stored (rows contiguous), for up to 32 rows of x. ----
// C^T = W x^T on tiles: A tiles are 16 W rows x 32 k straight from the weight (row stride 2K),
// B tiles are x^T in pair-interleaved form (packed once per call, a few KB), and each C tile
// (16 W rows x 16 tokens) is transposed in registers on its way out. The weight is read once,
// in 64-row groups whose rows stream side by side; it needs no packed copy, so a tied LM head
// reads the embedding table itself and prefill chunks can take oneDNN's F.linear on the same
// tensor.

// One spilled C tile c[w][t] (W rows n0.., tokens t0..) -> y[t0 + t][n0 + w] for t < rows.
inline void store_transposed(const float (*c)[16], const at::BFloat16* bias, at::BFloat16* y,
                             int64_t N, int64_t rows) {
  __m512 r[16];
  for (int i = 0; i < 16; ++i) r[i] = _mm512_load_ps(c[i]);
  flatserve::transpose16(r);
  const __m512 b = bias ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(
                              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bias))), 16))
                        : _mm512_setzero_ps();
  for (int64_t t = 0; t < rows; ++t)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(y + t * N), reinterpret_cast<__m256i>(
                            _mm512_cvtneps_pbh(_mm512_add_ps(r[t], b))));
}

// The next 64-row group (contiguous: 64 rows x 2K bytes) is prefetched into L2 in sequential 4 KB
// pieces, one per k step, while this group's lines are read down its columns. Prefetching the
// lines two k steps ahead instead (64 lines 2K bytes apart, as gemm_1x4 does for its contiguous
// panel) ran the LM head at 0.90x of the packed kernel: lines 2-4 KB apart share L1 sets.
inline void prefetch_next(const char* next, int64_t piece, int64_t bytes) {
  for (int64_t b = 0; b < bytes; b += 64) _mm_prefetch(next + piece * bytes + b, _MM_HINT_T1);
}

// Up to 16 tokens: per k step one B tile meets the 4 A tiles of a 64-row group.
void plain_1x4(const Problem& p, const char* xt, int64_t g0, int64_t g1) {
  const int64_t N = p.N, K = p.K, KB = K / 32, rs = K * 2;
  alignas(64) float c[4][16][16];
  for (int64_t g = g0; g < g1; ++g) {
    const char* wg = p.w + g * 64 * rs;
    _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
    for (int64_t kb = 0; kb < KB; ++kb) {
      if (g + 1 < g1) prefetch_next(wg + 64 * rs, kb, 64 * 64);
      _tile_loadd(6, xt + kb * 1024, 64);
      const char* wk = wg + kb * 64;
      _tile_loadd(4, wk, rs);           _tile_dpbf16ps(0, 4, 6);
      _tile_loadd(5, wk + 16 * rs, rs); _tile_dpbf16ps(1, 5, 6);
      _tile_loadd(4, wk + 32 * rs, rs); _tile_dpbf16ps(2, 4, 6);
      _tile_loadd(5, wk + 48 * rs, rs); _tile_dpbf16ps(3, 5, 6);
    }
    _tile_stored(0, c[0], 64); _tile_stored(1, c[1], 64);
    _tile_stored(2, c[2], 64); _tile_stored(3, c[3], 64);
    for (int j = 0; j < 4; ++j)
      store_transposed(c[j], p.bias_at(g * 64 + j * 16), p.y + g * 64 + j * 16, N, p.M);
  }
}

// More tokens: 2 x 2 tiles, 32 W rows x 32 tokens. Each half of a 64-row group (40 KB at
// K = 640) meets every 32-token pair in turn: from memory for the first pair, from L1/L2 after.
void plain_2x2(const Problem& p, const char* xt, int64_t g0, int64_t g1) {
  const int64_t N = p.N, K = p.K, KB = K / 32, rs = K * 2, TP = (p.M + 31) / 32;
  alignas(64) float c[2][2][16][16];
  for (int64_t g = g0; g < g1; ++g)
    for (int64_t h = 0; h < 2; ++h) {
      const char* wg = p.w + (g * 64 + h * 32) * rs;
      for (int64_t tp = 0; tp < TP; ++tp) {
        const char* x0 = xt + 2 * tp * KB * 1024;
        _tile_zero(0); _tile_zero(1); _tile_zero(2); _tile_zero(3);
        for (int64_t kb = 0; kb < KB; ++kb) {
          if (tp == 0 && (h == 0 || g + 1 < g1)) prefetch_next(wg + 32 * rs, kb, 32 * 64);
          _tile_loadd(6, x0 + kb * 1024, 64);
          _tile_loadd(7, x0 + (KB + kb) * 1024, 64);
          const char* wk = wg + kb * 64;
          _tile_loadd(4, wk, rs);
          _tile_dpbf16ps(0, 4, 6); _tile_dpbf16ps(1, 4, 7);
          _tile_loadd(5, wk + 16 * rs, rs);
          _tile_dpbf16ps(2, 5, 6); _tile_dpbf16ps(3, 5, 7);
        }
        _tile_stored(0, c[0][0], 64); _tile_stored(1, c[0][1], 64);
        _tile_stored(2, c[1][0], 64); _tile_stored(3, c[1][1], 64);
        for (int w = 0; w < 2; ++w)
          for (int t = 0; t < 2; ++t) {
            const int64_t col = g * 64 + h * 32 + w * 16, t0 = (2 * tp + t) * 16;
            const int64_t rows = std::min<int64_t>(16, p.M - t0);
            if (rows > 0) store_transposed(c[w][t], p.bias_at(col), p.y + t0 * N + col, N, rows);
          }
      }
    }
}

// x [M, K] bf16 -> x^T as B tiles, [token block][K/32][16 k pairs][16 tokens] u32 pairs, zero
// past M, in `buf` (64-byte aligned; TB token blocks of 16).
const char* pack_xt(const torch::Tensor& x, int64_t TB, std::vector<uint32_t>& buf) {
  const int64_t M = x.size(0), K = x.size(1), KB = K / 32;
  buf.assign(TB * KB * 256 + 16, 0u);
  uint32_t* xt = reinterpret_cast<uint32_t*>((reinterpret_cast<uintptr_t>(buf.data()) + 63) & ~uintptr_t{63});
  const torch::Tensor xs = x.contiguous();
  const uint32_t* x32 = reinterpret_cast<const uint32_t*>(xs.data_ptr());
  for (int64_t t = 0; t < M; ++t)
    for (int64_t kb = 0; kb < KB; ++kb)
      for (int64_t q = 0; q < 16; ++q)
        xt[((t / 16) * KB + kb) * 256 + q * 16 + t % 16] = x32[t * (K / 2) + kb * 16 + q];
  return reinterpret_cast<const char*>(xt);
}

using flatserve::greedy::greedy_rows;
using flatserve::greedy::GreedyPart;
using flatserve::greedy::tie_margin;
using flatserve::greedy::Cand;

#endif

bool available() { return flatserve::amx_available(); }

// x [M, K] bf16, w [N, K] bf16 contiguous (N % 64 == 0, K % 32 == 0), bias [N] or empty ->
// y [M, N]: the plain weight, no packed copy (prefill chunks take F.linear: flatserve/model/amx.py).
torch::Tensor linear_plain(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& bias) {
  TORCH_CHECK(available(), "AMX bf16 tiles are not available in this process");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && w.dim() == 2 &&
              w.scalar_type() == at::kBFloat16 && w.is_contiguous(),
              "amx linear_plain: x [M, K] bf16 and a contiguous bf16 weight [N, K]");
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  TORCH_CHECK(w.size(1) == K && K % 32 == 0 && N % 64 == 0,
              "amx linear_plain: K % 32 == 0 and N % 64 == 0; got x ", x.sizes(), ", w ", w.sizes());
  TORCH_CHECK(bias.numel() == 0 || (bias.numel() == N && bias.is_contiguous() &&
                                     bias.scalar_type() == at::kBFloat16), "amx linear_plain: bias [N] bf16");
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
#ifdef FLATSERVE_AMX
  const int64_t TB = M <= 16 ? 1 : (M + 31) / 32 * 2;
  std::vector<uint32_t> xt_buf;
  const char* xtc = pack_xt(x, TB, xt_buf);
  const Problem p{nullptr, static_cast<const char*>(w.data_ptr()),
                  bias.numel() ? bias.data_ptr<at::BFloat16>() : nullptr, y.data_ptr<at::BFloat16>(),
                  M, N, K};
  at::parallel_for(0, N / 64, 1, [&](int64_t g0, int64_t g1) {
    flatserve::load_tile_config();
    if (TB == 1) plain_1x4(p, xtc, g0, g1);
    else plain_2x2(p, xtc, g0, g1);
    _tile_release();
  });
#endif
  return y;
}

// x [M, K] bf16, w_packed [N/64, K/32, 4, 16, 16, 2] bf16, bias [N] bf16 or empty -> y [M, N].
torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& w_packed, const torch::Tensor& bias,
                     int64_t act) {
  TORCH_CHECK(available(), "AMX bf16 tiles are not available in this process");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && w_packed.dim() == 6 &&
              w_packed.scalar_type() == at::kBFloat16 && w_packed.is_contiguous(),
              "amx linear: x [M, K] bf16 and a packed bf16 weight");
  const int64_t M = x.size(0), K = x.size(1), N = w_packed.size(0) * 64;
  TORCH_CHECK(w_packed.size(1) * 32 == K, "amx linear: x has K=", K, ", the weight ",
              w_packed.size(1) * 32);
  TORCH_CHECK(bias.numel() == 0 || (bias.numel() == N && bias.is_contiguous() &&
                                     bias.scalar_type() == at::kBFloat16), "amx linear: bias [N] bf16");
  TORCH_CHECK(act >= kNone && act <= kGelu && (act == kNone || bias.numel() == 0),
              "amx linear: act 0 (none), 1 (silu) or 2 (gelu-tanh), gated without bias");
  auto y = torch::empty({M, act == kNone ? N : N / 2}, x.options());
  if (M == 0) return y;
  const bool wide = M > 32;
  const int64_t padded = wide ? (M + 31) / 32 * 32 : (M + 15) / 16 * 16;
  torch::Tensor xs = x.contiguous();
  if (padded != M) {  // the A tile loads whole 16-row blocks
    xs = torch::zeros({padded, K}, x.options());
    xs.narrow(0, 0, M).copy_(x);
  }
#ifdef FLATSERVE_AMX
  const Problem p{static_cast<const char*>(xs.data_ptr()), static_cast<const char*>(w_packed.data_ptr()),
                  bias.numel() ? bias.data_ptr<at::BFloat16>() : nullptr, y.data_ptr<at::BFloat16>(),
                  M, N, K, static_cast<int>(act)};
  if (M >= kRowSplit * at::get_num_threads()) {
    gemm_row_halves(p, padded);
    return y;
  }
  // Whole 64-column groups per thread: each thread streams one contiguous slice of the weight.
  at::parallel_for(0, N / 64, 1, [&](int64_t g0, int64_t g1) {
    flatserve::load_tile_config();
    // benchmarks/dev/cpu_gemm_ab.py: slabs of 2 blocks up to 1.2x on 2,048 rows; verify rows (<= 64)
    // keep one slab (0.85x with 2).
    if (wide) gemm_2x2(p, g0, g1, M > 64 ? 2 : 4);
    else gemm_1x4(p, g0, g1);
    _tile_release();
  });
#endif
  return y;
}

}  // namespace

// x [M <= 16, K] bf16; wq [N, K64] bytes q + 64 in the greedy layout of greedy_amx.h (N % 32 ==
// 0, K64 = K rounded up to 64, the extra columns 64: q = 0); s, c [N] fp32; xabs [M] fp32 (|x_t|_1
// rounded up) -> (offsets [M + 1], rows [total], union [U]) int64: per token, ascending W rows
// that may hold the bf16 head's argmax (the argmax among equals included), and all tokens' rows
// ascending without repeats. A token with no candidate (NaN in x) gets none: the caller takes
// the full head.
std::vector<torch::Tensor> greedy_candidates(const torch::Tensor& x, const torch::Tensor& wq,
                                             const torch::Tensor& s, const torch::Tensor& c,
                                             const torch::Tensor& xabs) {
  TORCH_CHECK(available(), "AMX bf16 tiles are not available in this process");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.size(0) <= 16 &&
              wq.dim() == 2 && wq.scalar_type() == at::kByte && wq.is_contiguous() &&
              wq.size(1) == (x.size(1) + 63) / 64 * 64 && wq.size(0) % 32 == 0,
              "amx greedy_candidates: x [M <= 16, K] bf16, wq [N % 32, K rounded up to 64] uint8; got x ",
              x.sizes(), ", wq ", wq.sizes());
  const int64_t M = x.size(0), K = x.size(1), N = wq.size(0);
  TORCH_CHECK(s.numel() == N && c.numel() == N && xabs.numel() == M && s.is_contiguous() &&
              c.is_contiguous() && xabs.is_contiguous() && s.scalar_type() == at::kFloat &&
              c.scalar_type() == at::kFloat && xabs.scalar_type() == at::kFloat,
              "amx greedy_candidates: s, c [N] and xabs [M] fp32");
  std::vector<int64_t> offsets(M + 1, 0), rows, all;
#ifdef FLATSERVE_AMX
  flatserve::greedy::X8 x8;
  const torch::Tensor xf = x.to(at::kFloat).contiguous();
  flatserve::greedy::pack_x8(xf.data_ptr<float>(), M, K, x8);
  const int64_t G = N / 32, P = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), G));
  std::vector<GreedyPart> parts(P);
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    flatserve::load_tile_config();
    for (int64_t p = p0; p < p1; ++p)
      greedy_rows(wq.data_ptr<uint8_t>(), s.data_ptr<float>(), c.data_ptr<float>(),
                  xabs.data_ptr<float>(), x8, M, K, G * p / P, G * (p + 1) / P, parts[p]);
    _tile_release();
  });
  for (int64_t t = 0; t < M; ++t) {
    float best = -INFINITY;
    for (const auto& part : parts) best = std::max(best, part.best[t]);
    const float thr = best - tie_margin(best);
    for (const auto& part : parts)  // parts and their lists run in ascending row order
      for (const Cand& cd : part.cand[t])
        if (cd.upper >= thr) rows.push_back(cd.n);
    offsets[t + 1] = static_cast<int64_t>(rows.size());
  }
  all = rows;
  std::sort(all.begin(), all.end());
  all.erase(std::unique(all.begin(), all.end()), all.end());
#endif
  auto opt = torch::TensorOptions().dtype(torch::kInt64);
  return {torch::tensor(offsets, opt), torch::tensor(rows, opt), torch::tensor(all, opt)};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available, "AMX bf16 compiled in and tile state granted to this process");
  m.def("linear", &linear, "x [M, K] bf16 @ packed W (+ bias) -> [M, N] bf16; act 1 / 2: gated, [M, N / 2]",
        py::arg("x"), py::arg("w_packed"), py::arg("bias"), py::arg("act") = 0);
  m.def("linear_plain", &linear_plain, "x [M, K] bf16 @ plain W [N, K]^T (+ bias) -> [M, N] bf16");
  m.def("greedy_candidates", &greedy_candidates,
        "rows of a 7-bit weight copy that may hold each x row's bf16 argmax -> (offsets, rows, union)");
}

// For the C++ decoder stack (decoder_stack_cpu.cpp), which calls it through torch's dispatcher.
// The op namespace is the module's name: a copy built under another name (an A/B) is its own.
TORCH_LIBRARY_FRAGMENT(TORCH_EXTENSION_NAME, m) {
  m.def("amx_linear(Tensor x, Tensor w_packed, Tensor bias, int act) -> Tensor", &linear);
}
