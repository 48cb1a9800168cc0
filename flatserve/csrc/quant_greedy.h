// The greedy heads' entry points on a Q8_0 LM head (flatserve/model/greedy_q4.py, greedy_q8.py):
// the shared candidate-and-rescore driver (greedy_argmax) and each pass's argmax and set-up calls.
// Not a standalone header: ops/csrc/quant_gemm_cpu.cpp includes it after the pieces it uses
// (Acts, quantize_act, dot_rows, Unpacked, g_rows16_mask), so the module's bindings see it; kept
// apart so that file stays a GEMM (it had passed 700 lines with them).
#pragma once

// The greedy heads on a Q8_0 head: x [M <= 16, K] finite, w8 [N, K / 32 * 34] the head's Q8_0 rows;
// `pass(ac, exact, parts)` fills each thread's Part (candidates and v) -> (tokens [M], candidate
// rows per token [M]) int64. tokens[t] is row_argmax(head(x))[t]: each candidate row is scored
// with the head's own dot and rounded to x's dtype as gemm stores it, the first maximum wins.
template <typename Pass>
std::vector<at::Tensor> greedy_argmax(const at::Tensor& x, const at::Tensor& w8, const char* name, Pass&& pass) {
  const int64_t M = x.size(0), K = x.size(1), N = w8.size(0), nb = K / 32;
  TORCH_CHECK(x.dim() == 2 && M >= 1 && M <= greedy_q4::kMaxTokens && K % 32 == 0 && K <= 16384 &&
              w8.dim() == 2 && w8.scalar_type() == at::kByte && w8.is_contiguous() && w8.size(1) == nb * 34 &&
              N >= 1, name, ": x [M <= 16, K % 32 == 0], w8 [N, K / 32 * 34] uint8");
  const std::vector<at::Tensor> acts = quantize_act(x.contiguous());
  const Acts ac{acts[0].data_ptr<int16_t>(), acts[1].data_ptr<float>(), acts[2].data_ptr<float>(), K};
  const uint8_t* w8p = w8.data_ptr<uint8_t>();
#if defined(__AVX512BW__)  // gemm's Q8_0 path: rows16 (or the tiles, the same bits), or the AVX2 one
  bool q8_rows16 = (g_rows16_mask >> Q8_0) & 1;
#ifdef FLATSERVE_AMX
  q8_rows16 = q8_rows16 || flatserve::amx_available();
#endif
#endif
  auto exact = [&](int64_t n, int64_t t) {  // the head's fp32 logit: its own dot, its bits
    Unpacked u{nullptr, nullptr, nullptr, w8p + n * w8.size(1)};
#if defined(__AVX512BW__)
    if (q8_rows16)
      return flatserve::qblocks::exact(u, false, false, ac.q + t * K, ac.d + t * nb, ac.s + t * nb, nb);
#elif QG_AVX2  // below AVX-512 every gemm call has the tiles' bits
    return flatserve::qymm::exact_q8(u.raw, ac.q + t * K, ac.d + t * nb, nb);
#endif
    float r;
    dot_rows<1>(u, ac, t, false, &r);
    return r;
  };
  const auto dtype = x.scalar_type();
  auto stored = [dtype](float y) {  // the logit as gemm stores it in x's dtype (store())
    if (dtype == at::kBFloat16) return static_cast<float>(static_cast<at::BFloat16>(y));
    if (dtype == at::kHalf) return static_cast<float>(static_cast<at::Half>(y));
    return y;
  };
  std::vector<greedy_q4::Part> parts(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), N / 64)));
  pass(ac, exact, parts);
  at::Tensor tokens = at::empty({M}, at::kLong), counts = at::empty({M}, at::kLong);
  at::parallel_for(0, M, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t) {
      float v = -INFINITY, best = -INFINITY;
      for (const auto& part : parts) v = std::max(v, part.v[t]);
      const float thr = v - greedy_q4::tie_margin(v);
      int64_t n_best = -1, cnt = 0;
      for (const auto& part : parts)  // parts and their lists run in ascending row order
        for (const greedy_q4::Cand& cd : part.cand[t]) {
          if (cd.upper + std::fabs(cd.upper) * 0x1p-20f < thr) continue;
          ++cnt;
          const float y = stored(exact(cd.n, t));
          if (y > best || n_best < 0) best = y, n_best = cd.n;  // ties: the first row
        }
      tokens.data_ptr<int64_t>()[t] = n_best, counts.data_ptr<int64_t>()[t] = cnt;
    }
  });
  return {tokens, counts};
}

// The int8 pass on the head's own codes (flatserve/csrc/greedy_q8.h, model/greedy_q8.py): S [N, K
// / 32] int16 and R [N] fp32 from greedy_q8_prep. The avx512 build (VNNI) and the AVX2 ones
// (avxvnni: 256-bit VNNI; avx2: vpmaddubsw).
std::vector<at::Tensor> greedy_q8_argmax(const at::Tensor& x, const at::Tensor& w8, const at::Tensor& S,
                                         const at::Tensor& R) {
#ifdef FLATSERVE_GREEDY_Q8
  const int64_t M = x.size(0), K = x.size(1), N = w8.size(0);
  TORCH_CHECK(S.scalar_type() == at::kShort && S.is_contiguous() && S.dim() == 2 && S.size(0) == N &&
              S.size(1) == K / 32 && R.scalar_type() == at::kFloat && R.is_contiguous() && R.numel() == N,
              "greedy_q8_argmax: S [N, K / 32] int16, R [N] float32 (greedy_q8_prep)");
  return greedy_argmax(x, w8, "greedy_q8_argmax", [&](const Acts& ac, auto& exact, auto& parts) {
    namespace g8 = flatserve::greedy_q8;
    g8::XPack8 xp;
    g8::pack_x8(ac.q, ac.d, M, K, M <= 8 ? 8 : 16, xp);  // a lane a token: ymm up to 8
    const int64_t P = static_cast<int64_t>(parts.size());
    at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t n0 = N * p / P, n1 = N * (p + 1) / P;
        if (xp.L == 8)
          g8::rows<8>(xp, w8.data_ptr<uint8_t>(), w8.size(1), S.data_ptr<int16_t>(), R.data_ptr<float>(), n0, n1,
                      exact, parts[p]);
        else
          g8::rows<16>(xp, w8.data_ptr<uint8_t>(), w8.size(1), S.data_ptr<int16_t>(), R.data_ptr<float>(), n0, n1,
                       exact, parts[p]);
      }
    });
  });
#else
  TORCH_CHECK(false, "greedy_q8_argmax: this build has no AVX2");
#endif
}

// The 4-bit copy with rows in the lanes (flatserve/csrc/greedy_q4t.h) for up to 8 tokens: codes
// [G, nb * 256] uint8, scales [G, nb * 16] int16 (fp16 bits) from greedy_q4t_copy.
std::vector<at::Tensor> greedy_q4t_argmax(const at::Tensor& x, const at::Tensor& w8, const at::Tensor& codes,
                                          const at::Tensor& scales, double wmax) {
#ifdef FLATSERVE_GREEDY_Q4T
  namespace gt = flatserve::greedy_q4t;
  const int64_t M = x.size(0), K = x.size(1), N = w8.size(0), nb = K / 32, G = (N + 15) / 16;
  TORCH_CHECK(M >= 1 && M <= gt::kMaxRows, "greedy_q4t_argmax: 1 to ", gt::kMaxRows, " rows");
  TORCH_CHECK(codes.scalar_type() == at::kByte && codes.is_contiguous() && codes.numel() == G * nb * 256 &&
              scales.scalar_type() == at::kShort && scales.is_contiguous() && scales.numel() == G * nb * 16,
              "greedy_q4t_argmax: codes and scales as greedy_q4t_copy makes them");
  return greedy_argmax(x, w8, "greedy_q4t_argmax", [&](const Acts& ac, auto& exact, auto& parts) {
    gt::XPackT xp;
    gt::pack_x(ac.q, ac.d, M, K, wmax, xp);
    const int64_t P = static_cast<int64_t>(parts.size());
    const uint8_t* cp = codes.data_ptr<uint8_t>();
    const uint16_t* sp = reinterpret_cast<const uint16_t*>(scales.data_ptr<int16_t>());
    at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t g0 = G * p / P, g1 = G * (p + 1) / P;
        switch (M) {
#define Q4T_CASE(m) case m: gt::rows_t<m>(xp, cp, sp, ac.d, K, N, g0, g1, exact, parts[p]); break;
          Q4T_CASE(1) Q4T_CASE(2) Q4T_CASE(3) Q4T_CASE(4) Q4T_CASE(5) Q4T_CASE(6) Q4T_CASE(7) Q4T_CASE(8)
#undef Q4T_CASE
        }
      }
    });
  });
#else
  TORCH_CHECK(false, "greedy_q4t_argmax: this build has no AVX2");
#endif
}

// Q8_0 rows [N, K / 32 * 34] -> (codes, scales, wmax) for greedy_q4t_argmax: greedy_q4t.h.
std::tuple<at::Tensor, at::Tensor, double> greedy_q4t_copy(const at::Tensor& w8, int64_t K) {
  const int64_t N = w8.size(0), nb = K / 32, G = (N + 15) / 16;
  TORCH_CHECK(w8.dim() == 2 && w8.scalar_type() == at::kByte && w8.is_contiguous() && K % 32 == 0 &&
              w8.size(1) == nb * 34, "greedy_q4t_copy: Q8_0 rows [N, K / 32 * 34]");
  at::Tensor codes = at::empty({G, nb * 256}, w8.options()), scales = at::empty({G, nb * 16}, w8.options().dtype(at::kShort));
  std::vector<double> wmax(G / 256 + 1, 0.0);
#ifdef FLATSERVE_GREEDY_Q4T
  at::parallel_for(0, G, 256, [&](int64_t g0, int64_t g1) {
    double& m = wmax[g0 / 256];  // chunks start >= 256 groups apart: a slot each, no shared write
    for (int64_t g = g0; g < g1; ++g) {
      m = std::max(m, flatserve::greedy_q4t::build_group(w8.data_ptr<uint8_t>(), N, nb, g, codes.data_ptr<uint8_t>(),
                                                          reinterpret_cast<uint16_t*>(scales.data_ptr<int16_t>())));
    }
  });
#else
  TORCH_CHECK(false, "greedy_q4t_copy: this build has no AVX2");
#endif
  return {codes, scales, *std::max_element(wmax.begin(), wmax.end())};
}

// Q8_0 rows [N, K / 32 * 34] -> (S [N, K / 32] int16, R [N] fp32): greedy_q8.h.
std::vector<at::Tensor> greedy_q8_prep(const at::Tensor& w8, int64_t K) {
  const int64_t N = w8.size(0), nb = K / 32;
  TORCH_CHECK(w8.dim() == 2 && w8.scalar_type() == at::kByte && w8.is_contiguous() && K % 32 == 0 &&
              w8.size(1) == nb * 34, "greedy_q8_prep: Q8_0 rows [N, K / 32 * 34]");
  at::Tensor S = at::empty({N, nb}, w8.options().dtype(at::kShort)), R = at::empty({N}, w8.options().dtype(at::kFloat));
#ifdef FLATSERVE_GREEDY_Q8
  at::parallel_for(0, N, 4096, [&](int64_t n0, int64_t n1) {
    flatserve::greedy_q8::prep_rows(w8.data_ptr<uint8_t>(), n0, n1, nb, S.data_ptr<int16_t>(), R.data_ptr<float>());
  });
#else
  TORCH_CHECK(false, "greedy_q8_prep: this build has no AVX2");
#endif
  return {S, R};
}

bool has_greedy_q8() {
#ifdef FLATSERVE_GREEDY_Q8
  return true;
#else
  return false;
#endif
}
