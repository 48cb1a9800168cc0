// The sequences a paged attention kernel runs (attention/csrc): all S, or the int32 list a
// mixed step passes so that decodes and prefill chunks go to their own kernels, each writing
// its sequences' rows of one output.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <vector>

namespace flatserve {

inline std::vector<int64_t> sequence_list(const c10::optional<at::Tensor>& seqs, int64_t S,
                                          const char* who) {
  std::vector<int64_t> which;
  if (!seqs.has_value()) {
    for (int64_t s = 0; s < S; ++s) which.push_back(s);
    return which;
  }
  TORCH_CHECK(seqs->scalar_type() == at::kInt && seqs->is_contiguous() && seqs->dim() == 1, who,
              ": seqs int32 [S']");
  const int32_t* p = seqs->data_ptr<int32_t>();
  for (int64_t i = 0; i < seqs->numel(); ++i) {
    TORCH_CHECK(p[i] >= 0 && p[i] < S, who, ": seqs entries in [0, S)");
    which.push_back(p[i]);
  }
  return which;
}

// `out` where given (q's shape, contiguous, q's dtype), else a new tensor like q.
inline at::Tensor output_for(const at::Tensor& q, const c10::optional<at::Tensor>& out,
                             const char* who) {
  at::Tensor o = out.has_value() ? *out : at::empty_like(q);
  TORCH_CHECK(o.sizes() == q.sizes() && o.is_contiguous() && o.scalar_type() == q.scalar_type(),
              who, ": out must be contiguous, with q's shape and dtype");
  return o;
}

}  // namespace flatserve
