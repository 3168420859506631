// A decode step through every layer of a Llama-family decoder in one call (float32 activations).
//
// At batch size 1 a step of a small model is ~240 kernel calls of 5-100 us each; made from
// Python, their call overhead (argument parsing, views, attribute lookups) was ~15% of the step.
// DecoderPlan holds the layers' weights once and runs the same kernels, in the same order and on
// the same tensors, as LlamaForCausalLM._forward_fused does for a step without prefill chunks, so
// the two give bit-identical results: a sequence's tokens do not depend on which path its step took.
#include "entry_points.h"

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <tuple>
#include <utility>

namespace {

// One matmul of a projection: GGUF blocks (qtype >= 0, quant_gemm) or a float32 weight (qtype -1,
// at::linear as nn.Linear runs it), plus an optional bias.
struct LinearPart {
  torch::Tensor weight;
  int64_t qtype;
  c10::optional<torch::Tensor> bias;
};

// A projection: its parts' outputs side by side (one part unless a fused projection mixes formats).
using Projection = std::vector<LinearPart>;

torch::Tensor run_part(const LinearPart& p, const torch::Tensor& x) {
  if (p.qtype < 0) return at::linear(x, p.weight, p.bias);
  torch::Tensor y = quant_gemm(x, p.weight, p.qtype);
  if (p.bias.has_value()) y = y + *p.bias;  // as QuantizedLinear.forward: y + bias, after the GEMM
  return y;
}

torch::Tensor run(const Projection& proj, const torch::Tensor& x) {
  if (proj.size() == 1) return run_part(proj[0], x);
  std::vector<torch::Tensor> outs;
  outs.reserve(proj.size());
  for (const LinearPart& p : proj) outs.push_back(run_part(p, x));
  return at::cat(outs, -1);
}

}  // namespace

class DecoderPlan {
 public:
  using PartSpec = std::tuple<torch::Tensor, int64_t, c10::optional<torch::Tensor>>;

  // projections: 4 per layer (qkv, o, gate_up, down); norms / eps: 2 per layer (the post-attention
  // norm, then the next layer's input norm, or the final norm after the last layer). windows: each
  // layer's sliding attention window (<= 0: none), as paged_decode_attention takes it.
  DecoderPlan(const std::vector<std::vector<PartSpec>>& projections, std::vector<torch::Tensor> norms,
              std::vector<double> eps, int64_t num_heads, int64_t num_kv_heads, int64_t head_dim, double scale,
              std::vector<int64_t> windows)
      : norms_(std::move(norms)),
        eps_(std::move(eps)),
        windows_(std::move(windows)),
        num_heads_(num_heads),
        num_kv_heads_(num_kv_heads),
        head_dim_(head_dim),
        scale_(scale) {
    TORCH_CHECK(projections.size() % 4 == 0 && !projections.empty(), "DecoderPlan: 4 projections per layer");
    layers_ = static_cast<int64_t>(projections.size() / 4);
    TORCH_CHECK(static_cast<int64_t>(norms_.size()) == 2 * layers_ && static_cast<int64_t>(eps_.size()) == 2 * layers_,
                "DecoderPlan: 2 norms per layer");
    TORCH_CHECK(static_cast<int64_t>(windows_.size()) == layers_, "DecoderPlan: one window per layer");
    for (const auto& specs : projections) {
      TORCH_CHECK(!specs.empty(), "DecoderPlan: a projection without parts");
      Projection proj;
      for (const auto& [w, qtype, bias] : specs) {
        TORCH_CHECK(qtype >= 0 ? w.scalar_type() == torch::kUInt8 : w.scalar_type() == torch::kFloat,
                    "DecoderPlan: weights are GGUF blocks (uint8) or float32");
        proj.push_back({w, qtype, bias});
      }
      projections_.push_back(std::move(proj));
    }
  }

  // h: layer 0's input norm of the embeddings, residual: the embeddings (updated in place); every
  // row a decode (one token of its own sequence). Returns the final norm of the last layer's output.
  torch::Tensor decode(torch::Tensor h, torch::Tensor residual, torch::Tensor positions, torch::Tensor cos,
                       torch::Tensor sin, const std::vector<std::pair<torch::Tensor, torch::Tensor>>& kv_caches,
                       const std::vector<std::pair<torch::Tensor, torch::Tensor>>& kv_scales,
                       torch::Tensor slot_mapping, torch::Tensor block_tables, torch::Tensor seq_lens) const {
    TORCH_CHECK(static_cast<int64_t>(kv_caches.size()) == layers_, "DecoderPlan.decode: one (K, V) cache per layer");
    // an int8 cache's scales per layer (K, V), or none at all for the other dtypes
    TORCH_CHECK(kv_scales.empty() || static_cast<int64_t>(kv_scales.size()) == layers_,
                "DecoderPlan.decode: one (K, V) pair of scales per layer, or none");
    const int64_t t = h.size(0), qs = num_heads_ * head_dim_;
    for (int64_t l = 0; l < layers_; ++l) {
      const Projection* p = &projections_[4 * l];
      torch::Tensor qkv = run(p[0], h);
      const auto& [k_cache, v_cache] = kv_caches[l];
      c10::optional<torch::Tensor> ks, vs;
      if (!kv_scales.empty()) std::tie(ks, vs) = kv_scales[l];
      rope_and_cache_write(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, num_heads_, num_kv_heads_, ks, vs);
      torch::Tensor q = qkv.narrow(1, 0, qs).view({t, num_heads_, head_dim_});
      torch::Tensor o = scratch_empty({t, num_heads_, head_dim_}, q.options());
      paged_decode_attention(o, q, k_cache, v_cache, block_tables, seq_lens, scale_, windows_[l], ks, vs);
      h = add_rms_norm(run(p[1], o.view({t, qs})), residual, norms_[2 * l], eps_[2 * l]);
      torch::Tensor m = run(p[3], silu_and_mul(run(p[2], h)));
      h = add_rms_norm(m, residual, norms_[2 * l + 1], eps_[2 * l + 1]);
    }
    return h;
  }

 private:
  std::vector<Projection> projections_;
  std::vector<torch::Tensor> norms_;
  std::vector<double> eps_;
  std::vector<int64_t> windows_;
  int64_t layers_ = 0, num_heads_, num_kv_heads_, head_dim_;
  double scale_;
};

void bind_decoder_plan(pybind11::module_& m) {
  // module_local: each instruction-set level's build is a module of its own with its own DecoderPlan,
  // and several levels may be loaded in one process (the tests run every level the CPU has).
  pybind11::class_<DecoderPlan>(m, "DecoderPlan", pybind11::module_local(),
                                "a decode step through every decoder layer in one call (float32 activations)")
      .def(pybind11::init<const std::vector<std::vector<DecoderPlan::PartSpec>>&, std::vector<torch::Tensor>,
                          std::vector<double>, int64_t, int64_t, int64_t, double, std::vector<int64_t>>())
      // No Python object is touched inside: other threads (the server's) run while a step does.
      .def("decode", &DecoderPlan::decode, pybind11::call_guard<pybind11::gil_scoped_release>());
}
