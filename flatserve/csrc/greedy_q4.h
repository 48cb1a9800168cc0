// What the quantized LM head's greedy candidate passes share (flatserve/model/greedy_q4.py and
// greedy_q8.py say what and why): the candidates and the per-thread parts, the tie margin, the
// fp32 slack, and the 4-bit copy's per-block quantization (greedy_q4t.h lays the copy out with
// head rows in the vector lanes).
//
// A row n can hold the argmax only if U_n = A_n + B_n (a pass's estimate and its rigorous bound)
// reaches the largest exactly computed logit v (less a bf16 tie margin). v comes from the pass
// itself: whenever a row's A_n is the best so far (a few dozen times per thread), that row is
// scored on the Q8_0 head with the head's own dot (`exact`). Against v, not against the best
// lower bound max(A - B), because the candidate count is steep in the margin: on the default
// model's real hidden states the copy's d / 2 bound keeps ~119k of 262k rows against max(A - B)
// (an offline float64 check of 24 decode rows), ~3k against v (benchmarks/dev/cpu_greedy_head.py
// --gguf, 2026-11-26).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include <c10/util/Half.h>

#include "quant_blocks.h"

namespace flatserve::greedy_q4 {

using flatserve::qblocks::h2f;

constexpr int kMaxTokens = 16;

struct Cand {
  int32_t n;
  float upper;
};

struct Part {  // one thread's rows
  float v[kMaxTokens];      // the largest exact logit it computed, per token
  std::vector<Cand> cand[kMaxTokens];
};

// 2^-6 of |v|: a logit this far below v has a bf16 rounding below v's (as greedy_avx2.h).
inline float tie_margin(float v) { return std::fabs(v) * 0x1p-6f + 1e-30f; }

// The fp32 rounding of a pass's A and of the head's logit for one token: nb blocks, every |W| and
// |W4| at most wmax, l1 = sum_k |xr_k|. Each term of either dot is at most 3.3 wmax |x| (a bound
// sized for an earlier row-major pass that subtracted the nibbles' offset in float; greedy_q4t's
// A, offset exact in int32, and the head's have terms of at most wmax |xr|) and rounds at most
// nb + 5 times, so (nb + 16) 2^-23 x 4.5 wmax l1 covers both.
inline float slack(int64_t nb, double wmax, double l1) {
  return static_cast<float>((nb + 16) * 0x1p-23 * 4.5 * wmax * l1 * (1 + 0x1p-20)) + 1e-30f;
}

// One Q8_0 block (34 bytes at blk) -> its 4-bit codes c[32] (value order) and fp16 scale bits;
// returns max |W| of the block. Exact in double: W = D q and d c are exact there, so the check
// |W - d c| <= d / 2 is too. The copy's scale d = max |W| / 7 rounded up to fp16 (7 d >= max |W|).
inline double quantize_block(const uint8_t* blk, uint16_t& bits, int c[32]) {
  const double D = h2f(blk);
  int qmax = 0;
  for (int j = 0; j < 32; ++j) qmax = std::max(qmax, std::abs(static_cast<int>(static_cast<int8_t>(blk[2 + j]))));
  const double amax = std::fabs(D) * qmax;
  at::Half h(static_cast<float>(amax / 7));
  std::memcpy(&bits, &h, 2);
  if (static_cast<double>(static_cast<float>(h)) * 7 < amax) ++bits;  // round up: 7 d >= max |W|
  const double d = h2f(reinterpret_cast<const uint8_t*>(&bits));
  TORCH_CHECK(std::isfinite(d), "greedy_q4: a block scale overflows fp16");
  for (int j = 0; j < 32; ++j) {
    const double w = D * static_cast<int8_t>(blk[2 + j]);
    c[j] = d > 0 ? std::clamp(static_cast<int>(std::nearbyint(w / d)), -7, 7) : 0;
    TORCH_CHECK(std::fabs(w - d * c[j]) <= d / 2, "greedy_q4: a code errs over d / 2");
  }
  return amax;
}

}  // namespace flatserve::greedy_q4
