// A mixture-of-experts MLP (inferd/layers/moe.py), the one implementation both the Python layer
// (on the CPU in fp32) and the fused decode step call: the router's softmax and top-k, the
// (token, choice) pairs grouped by expert with a stable sort, each expert that got rows run once
// over all of them (so a step reads only the experts its tokens chose), the outputs put back in
// (token, choice) order, weighted and added in rank order, plus Qwen2-MoE's gated shared expert.
// ATen ops where the Python layer used them, the same linear kernels: the same bits, and none of
// the ~10 Python-level calls per expert.
#pragma once

#include <torch/extension.h>

#include <tuple>
#include <vector>

#include "decoder_linear.h"
#include "layer_ops.h"

namespace decoder {

struct MoeWeights {
  torch::Tensor router;  // fp32 [E, hidden]
  std::vector<LinearWeights> gate_up, down;  // per expert
  int64_t top_k = 0;
  bool renormalize = false;  // the chosen experts' weights rescaled to sum 1
  int64_t activation = 0;  // LayerSpec::Activation
  // Qwen2-MoE's shared expert and its gate (fp32 [1, hidden]); shared_gate undefined: none.
  LinearWeights shared_gate_up, shared_down;
  torch::Tensor shared_gate;
  torch::Tensor expert_counts;  // int64 [E]: tokens routed to each expert are added here (if defined)
};

// moe.py's _SIMD_SAFE_WIDTH: a [T, 1] column spread this wide is computed in full vectors.
constexpr int64_t kSimdSafeWidth = 64;

inline torch::Tensor expert_mlp(const LinearWeights& gate_up, const LinearWeights& down, const torch::Tensor& x,
                                int64_t activation, const Shape& s) {
  const torch::Tensor gu = linear(gate_up, x, s);
  return linear(down, activation == 1 ? layer_ops::gelu_tanh_mul(gu) : layer_ops::silu_mul(gu), s);
}

// (output [T, hidden], tokens routed to each expert [E]) for x [T, hidden] fp32.
inline std::tuple<torch::Tensor, torch::Tensor> moe_forward(const torch::Tensor& x, const MoeWeights& m,
                                                            const Shape& s) {
  const int64_t t = x.size(0), k = m.top_k, num_experts = m.router.size(0);
  TORCH_CHECK(static_cast<int64_t>(m.gate_up.size()) == num_experts &&
                  static_cast<int64_t>(m.down.size()) == num_experts && k >= 1 && k <= num_experts,
              "moe_forward: one gate_up and one down per expert, 1 <= top_k <= experts");
  const torch::Tensor probs = at::softmax(dense::linear(x, m.router, torch::Tensor()), -1);
  auto [weights, experts] = probs.topk(k, -1);
  if (m.renormalize) weights = weights / weights.sum(-1, true);
  const torch::Tensor flat = experts.flatten();
  const torch::Tensor order = at::argsort(flat, /*stable=*/true, /*dim=*/0, /*descending=*/false);
  const torch::Tensor counts = at::bincount(flat, {}, num_experts);
  if (m.expert_counts.defined()) m.expert_counts.add_(counts);
  const torch::Tensor xs = x.index_select(0, at::floor_divide(order, k));
  std::vector<torch::Tensor> outs;
  const int64_t* n = counts.data_ptr<int64_t>();
  for (int64_t e = 0, start = 0; e < num_experts; ++e) {
    if (!n[e]) continue;
    outs.push_back(expert_mlp(m.gate_up[e], m.down[e], xs.narrow(0, start, n[e]), m.activation, s));
    start += n[e];
  }
  const torch::Tensor ys = outs.size() == 1 ? outs[0] : at::cat(outs);
  torch::Tensor back = torch::empty_like(order);
  back.index_put_({order}, at::arange(order.numel(), order.options()));
  const torch::Tensor pairs = ys.index_select(0, back).view({t, k, -1}) * weights.unsqueeze(-1);
  torch::Tensor out = pairs.select(1, 0);
  for (int64_t j = 1; j < k; ++j) out = out + pairs.select(1, j);
  if (m.shared_gate.defined()) {
    const torch::Tensor g = dense::linear(x, m.shared_gate, torch::Tensor());
    const torch::Tensor gate = at::sigmoid(g.expand({t, kSimdSafeWidth}).contiguous()).narrow(1, 0, 1);
    out = out + gate * expert_mlp(m.shared_gate_up, m.shared_down, x, m.activation, s);
  }
  return {out, counts};
}

}  // namespace decoder
