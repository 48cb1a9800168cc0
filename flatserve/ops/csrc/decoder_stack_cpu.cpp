// A decode step's decoder layers in one call from Python (flatserve/model/cpu_stack.py).
//
// Why: at 16 decodes a Gemma 3 270M step is ~200 kernel calls of 5-150 us each, and the Python
// between them (module calls, views, argument conversion, one output tensor per call) took
// ~17% of the main thread in a perf profile of decode steps (benchmarks/dev/cpu_profile_step.py).
// Here the same kernels run in the same order through torch's dispatcher, where each
// registered itself under its module's name (TORCH_LIBRARY_FRAGMENT in amx_gemm_cpu.cpp,
// fused_cpu.cpp and paged_decode_cpu.cpp), so the result is bit-identical to the Python layers with those
// kernels (tests/test_cpu_stack.py).
//
// The layer, with the norms each model has (Llama / Qwen3: no attn_out and mlp_out norms):
//   h, res = in_norm(h + res)                    (first layer: res = h)
//   q, k, v = split(qkv(h)); q, k = rope(qk_norm(q, k)); KV write; o = attend(q)
//   a = attn_out_norm(o_proj(o))                 (Gemma's post_attention_layernorm)
//   h, res = mlp_in_norm(a + res)                (with the line above: one rms_norm_pair call)
//   h = mlp_out_norm(down(act(gate) * up))       (the gate_up GEMM applies act in its epilogue;
//                                                 quantized linears: act_and_mul after it)
#include <torch/extension.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <string>
#include <vector>

namespace {

using at::Tensor;

// ns::name, registered by the kernel module `ns` (its Python module name: the op namespace).
template <typename Sig>
c10::TypedOperatorHandle<Sig> find_op(const std::string& ns, const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow((ns + "::" + name).c_str(), "").typed<Sig>();
}

// The kernels, looked up once (their modules are loaded by then: cpu_stack.py builds them).
// The signatures are the kernels' own: the dispatcher checks them.
struct Ops {
  using Norm = Tensor(const Tensor&, const Tensor&, double, bool, Tensor);
  using NormPair = Tensor(const Tensor&, const Tensor&, const Tensor&, double, bool, Tensor);
  using Linear = Tensor(const Tensor&, const Tensor&, const Tensor&, int64_t);
  using ActMul = Tensor(const Tensor&, bool);
  using Rope = void(Tensor, Tensor, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                    double, bool, bool);
  using WriteKv = void(const Tensor&, const Tensor&, Tensor&, Tensor&, const Tensor&);
  using Decode = Tensor(const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
                        const Tensor&, double, int64_t, double, const Tensor&,
                        const c10::optional<Tensor>&, const c10::optional<Tensor>&);
  // fused: the element-wise ops' module, gemm: the GEMM's ("module::op": the AMX kernel's
  // amx_linear, the AVX2 kernel's avx2_linear or the quantized kernel's quant_linear, the same
  // signature), attn: the decode kernel's.
  Ops(const std::string& fused, const std::string& gemm, const std::string& attn)
      : rms_norm(find_op<Norm>(fused, "rms_norm")),
        rms_norm_pair(find_op<NormPair>(fused, "rms_norm_pair")),
        linear(find_op<Linear>(gemm.substr(0, gemm.find("::")), gemm.substr(gemm.find("::") + 2).c_str())),
        act_and_mul(find_op<ActMul>(fused, "act_and_mul")),
        qk_norm_rope(find_op<Rope>(fused, "qk_norm_rope")),
        write_kv(find_op<WriteKv>(attn, "write_kv")),
        paged_decode(find_op<Decode>(attn, "paged_decode")) {}
  c10::TypedOperatorHandle<Norm> rms_norm;
  c10::TypedOperatorHandle<NormPair> rms_norm_pair;
  c10::TypedOperatorHandle<Linear> linear;
  c10::TypedOperatorHandle<ActMul> act_and_mul;
  c10::TypedOperatorHandle<Rope> qk_norm_rope;
  c10::TypedOperatorHandle<WriteKv> write_kv;
  c10::TypedOperatorHandle<Decode> paged_decode;
};

// One layer's tensors; an absent norm or bias is an empty tensor.
struct Layer {
  Tensor in_norm, attn_out_norm, mlp_in_norm, mlp_out_norm, q_norm, k_norm;
  Tensor qkv, qkv_bias, o, o_bias, gate_up, down;  // packed weights (AMX, AVX2 or quantized layout)
  Tensor k_cache, v_cache;                          // [num_blocks, block_size, Hkv, D]
  double scale = 1.0, softcap = 0.0;
  int64_t window = 0, rope = 0;  // rope: index into the step's cos|sin tables
};

class Stack {
 public:
  // gated_gemm: the gate_up GEMM applies act(gate) * up itself (AMX, AVX2); else act_and_mul.
  Stack(const std::vector<std::string>& modules, int64_t hq, int64_t hkv, int64_t d, double eps,
        bool offset, int64_t act, bool gated_gemm)
      : ops_(modules.at(0), modules.at(1), modules.at(2)), hq_(hq), hkv_(hkv), d_(d), eps_(eps),
        offset_(offset), act_(act), gated_gemm_(gated_gemm) {
    TORCH_CHECK(hq > 0 && hkv > 0 && hq % hkv == 0 && d % 16 == 0 && act >= 1 && act <= 2,
                "decoder stack: head shapes (head size a multiple of 16) and a gated activation");
  }

  // norms: in, attn_out, mlp_in, mlp_out, q, k; linears: qkv, qkv_bias, o, o_bias, gate_up, down;
  // cache: k, v.
  void add(const std::vector<Tensor>& norms, const std::vector<Tensor>& linears,
           const std::vector<Tensor>& cache, double scale, int64_t window, double softcap,
           int64_t rope) {
    TORCH_CHECK(norms.size() == 6 && linears.size() == 6 && cache.size() == 2,
                "decoder stack: 6 norms, 6 linear tensors, 2 caches per layer");
    TORCH_CHECK(norms[0].numel() && norms[2].numel(), "decoder stack: in and mlp_in norms needed");
    TORCH_CHECK(cache[0].dim() == 4 && cache[0].size(2) == hkv_ && cache[0].size(3) == d_,
                "decoder stack: caches [N, bs, Hkv, D]");
    layers_.push_back(Layer{norms[0], norms[1], norms[2], norms[3], norms[4], norms[5],
                            linears[0], linears[1], linears[2], linears[3], linears[4], linears[5],
                            cache[0], cache[1], scale, softcap, window, rope});
  }

  // h [T, H] (the embeddings, or the previous layer's output); residual [T, H] or empty (then
  // the first layer starts it from h, in place afterwards); positions int64 [T]; tables: the
  // step's fp32 [2, P, D] cos|sin per rope; the rest the step's attention metadata.
  // -> (h, residual) after the last layer, as the Python layers return them.
  std::vector<Tensor> forward(Tensor h, Tensor residual, const Tensor& positions,
                              const std::vector<Tensor>& tables, const Tensor& slot_mapping,
                              const Tensor& block_table, const Tensor& seq_lens,
                              const Tensor& cu_seqlens_q) {
    TORCH_CHECK(h.dim() == 2 && positions.size(0) == h.size(0), "decoder stack: h [T, H]");
    // A norm of a layer's output that feeds straight into the next norm of the running sum
    // (Gemma's post-attention and post-MLP norms) runs with it as one pair call: the same bits.
    const Tensor* pending = nullptr;  // the previous layer's mlp_out norm, not yet applied
    for (const Layer& l : layers_) {
      TORCH_CHECK(l.rope < static_cast<int64_t>(tables.size()), "decoder stack: rope table missing");
      if (residual.numel() == 0) {
        residual = h;
        h = norm(h, l.in_norm);
      } else {
        h = pending ? pair(h, *pending, l.in_norm, residual) : norm(h, l.in_norm, residual);
      }
      h = attention(h, l, positions, tables[l.rope], slot_mapping, block_table, seq_lens,
                    cu_seqlens_q);
      h = l.attn_out_norm.numel() ? pair(h, l.attn_out_norm, l.mlp_in_norm, residual)
                                  : norm(h, l.mlp_in_norm, residual);
      h = gated_gemm_ ? ops_.linear.call(h, l.gate_up, empty_, act_)
                      : ops_.act_and_mul.call(ops_.linear.call(h, l.gate_up, empty_, 0), act_ == 2);
      h = ops_.linear.call(h, l.down, empty_, 0);
      pending = l.mlp_out_norm.numel() ? &l.mlp_out_norm : nullptr;
    }
    if (pending) h = norm(h, *pending);
    return {h, residual};
  }

 private:
  Tensor norm(const Tensor& x, const Tensor& w, const Tensor& residual = Tensor()) {
    return ops_.rms_norm.call(x, w, eps_, offset_, residual.defined() ? residual : empty_);
  }

  // norm(residual += norm(x) with w1) with w2; residual in place.
  Tensor pair(const Tensor& x, const Tensor& w1, const Tensor& w2, Tensor& residual) {
    return ops_.rms_norm_pair.call(x, w1, w2, eps_, offset_, residual);
  }

  // x [T, H] -> o_proj(attention) [T, H]; K and V of the step written into the layer's caches.
  Tensor attention(const Tensor& x, const Layer& l, const Tensor& positions, const Tensor& table,
                   const Tensor& slot_mapping, const Tensor& block_table, const Tensor& seq_lens,
                   const Tensor& cu) {
    const int64_t T = x.size(0), nq = hq_ * d_, nkv = hkv_ * d_;
    Tensor qkv = ops_.linear.call(x, l.qkv, l.qkv_bias, 0);  // [T, (Hq + 2 Hkv) D]
    Tensor q = qkv.narrow(1, 0, nq).view({T, hq_, d_});       // views, as the Python layer's
    Tensor k = qkv.narrow(1, nq, nkv).view({T, hkv_, d_});
    Tensor v = qkv.narrow(1, nq + nkv, nkv).view({T, hkv_, d_});
    ops_.qk_norm_rope.call(q, k, positions, table, l.q_norm, l.k_norm, eps_, l.q_norm.numel() > 0,
                           offset_);
    Tensor kc = l.k_cache, vc = l.v_cache;
    ops_.write_kv.call(k, v, kc, vc, slot_mapping);
    Tensor o = ops_.paged_decode.call(q.contiguous(), kc, vc, block_table, seq_lens, cu, l.scale,
                                      l.window, l.softcap, no_sinks_, c10::nullopt, c10::nullopt);
    return ops_.linear.call(o.view({T, nq}), l.o, l.o_bias, 0);  // o [T, Hq, D]
  }

  Ops ops_;
  std::vector<Layer> layers_;
  int64_t hq_, hkv_, d_;
  double eps_;
  bool offset_;
  int64_t act_;
  bool gated_gemm_;
  Tensor empty_ = at::empty({0}, at::kBFloat16);
  Tensor no_sinks_ = at::empty({0}, at::kFloat);
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  py::class_<Stack>(m, "Stack")
      .def(py::init<const std::vector<std::string>&, int64_t, int64_t, int64_t, double, bool,
                    int64_t, bool>(), py::arg("modules"), py::arg("hq"), py::arg("hkv"), py::arg("d"),
           py::arg("eps"), py::arg("offset"), py::arg("act"), py::arg("gated_gemm") = true)
      .def("add", &Stack::add, "one decoder layer's tensors, in order")
      .def("forward", &Stack::forward, "(h, residual) through every layer -> [h, residual]",
           py::call_guard<py::gil_scoped_release>());
}
