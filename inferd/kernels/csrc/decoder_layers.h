// Every decoder layer of a decode step in one call: the layer of inferd/models/decoder.py, op for
// op, as each layer's spec (inferd/models/spec.py) shapes it: pre or sandwich norms, qk-norm,
// SiLU or GELU-tanh, its RoPE table, window, scale and soft-capping. For steps whose every query
// row goes to the paged attention kernel (decodes and speculative verification) over any KV
// cache: fp32, fp16 or bf16, or int8 / fp8 codes with scales (quantized to the same codes and
// scales as inferd/kv/kv_cache.py's quantize_kv).
//
// Why: at batch 1 the Python layer loop issues ~25 ATen calls per layer (30 layers in the
// default model), and their bindings and argument parsing are a large share of a quantized decode
// step; from C++ each call skips the Python binding and argument parsing, and the GIL is released
// for the whole step (the server's event loop runs meanwhile).
// Why op for op: the same kernels in the same order (the quantized matmuls, paged attention, the
// elementwise loops of layer_ops.h, ATen's for the rest) give the same bits as the Python path, so
// a sequence's logits never depend on which path its step took (a step mixing prefills with
// decodes runs the Python layers). tests/test_decoder_layers.py checks it.
#pragma once

#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <optional>
#include <type_traits>
#include <vector>

#include "decoder_linear.h"
#include <functional>

#include "layer_ops.h"
#include "moe_layer.h"
#include "paged_attention.h"

namespace decoder {
// One adapted linear's LoRA slot stacks (inferd/lora/slots.py LoRASite): A [in, S·P·R] and
// B [S·P·R, out] for S slots of P parts of rank R; `a` undefined where the linear has none.
struct LoRAWeights {
  torch::Tensor a, b;
  int64_t parts = 0;
};

// A step's LoRA masks by part count (LoRASlots.masks): [T, C], 1 where column c's slot is row t's,
// C <= S·P·R (the columns up to the last slot the step uses). Empty: no adapted row this step.
using LoRAMasks = std::map<int64_t, torch::Tensor>;

// `linear`, plus the step's LoRA delta where the linear has adapters and the step adapted rows:
// y + ((x @ A) * mask_P) @ B over the mask's columns, the ATen ops of LoRASite.add in its order
// (so the same bits as the Python layer).
inline torch::Tensor adapted_linear(const LinearWeights& l, const LoRAWeights& lora, const torch::Tensor& x,
                                    const Shape& s, const LoRAMasks& masks) {
  torch::Tensor y = linear(l, x, s);
  if (!lora.a.defined() || masks.empty()) return y;
  const auto mask = masks.find(lora.parts);
  TORCH_CHECK(mask != masks.end(), "decode_layers: no LoRA mask for ", lora.parts, " parts");
  const int64_t cols = mask->second.size(1);
  const torch::Tensor u = x.matmul(lora.a.narrow(1, 0, cols)).mul_(mask->second);  // [T, C]
  return torch::addmm(y, u, lora.b.narrow(0, 0, cols));
}

struct LayerWeights {
  torch::Tensor input_norm, post_norm;  // RMSNorm weights [hidden]: before attention, before the MLP
  LinearWeights qkv, o, gate_up, down;
  // Undefined where the layer has none: qk-norm weights [head_dim]; sandwich norms' post norms of
  // the attention and MLP outputs [hidden].
  torch::Tensor q_norm, k_norm, post_attn_norm, post_mlp_norm;
  // A mixture layer's MLP (router undefined: the dense gate_up / down above).
  MoeWeights moe;
  // With --enable-lora: the adapters' slots at qkv, o, gate_up and down.
  LoRAWeights qkv_lora, o_lora, gate_up_lora, down_lora;
};

// What the layer's spec varies beyond its weights (inferd/models/spec.py LayerSpec).
struct LayerSpec {
  enum Activation : int64_t { kSilu = 0, kGeluTanh = 1 };  // spec.ACTIVATIONS' order
  int64_t rope;  // index into the step's cos / sin tables
  int64_t window;  // 0: none
  double scale;
  double softcap;  // 0: none
  int64_t activation;
  bool qk_norm_all = false;  // qk-norm over the whole q and k projections (OLMoE), not each head
};

// A quantized cache's codes and scales (QuantizedKV.data / .scale), per layer; none for a plain
// cache. `code`: the kernel's format number (0 int8, 1 fp8 e4m3, 2 fp8 e5m2); qmax its largest.
struct QuantizedCaches {
  std::vector<torch::Tensor> k_scales, v_scales;
  int64_t code = 0;
  double qmax = 0.0;
};

// QuantizedKV.write (kv_cache.quantize_kv, then the index copies) for fp32 rows x [T, H, D] (D
// contiguous), a head vector at a time: scale = max|x| / qmax, code = round(x / scale) (int8,
// half to even) or x / scale in fp8 (c10's conversion, which ATen's .to() uses): the same codes
// and scales, without ATen's ~16 calls per layer.
template <class Code>
inline void quantize_head(const float* x, int64_t d, float qmax, uint8_t* codes, float* scale) {
  float amax = 0.f;
  for (int64_t e = 0; e < d; ++e) amax = std::max(amax, std::abs(x[e]));
  const float s = amax / qmax;
  *scale = s;
  const float div = std::max(s, 1e-30f);
  for (int64_t e = 0; e < d; ++e) {
    const float y = std::min(std::max(x[e] / div, -qmax), qmax);
    Code c;
    if constexpr (std::is_same_v<Code, int8_t>) c = static_cast<int8_t>(std::nearbyint(y));
    else c = Code(y);
    std::memcpy(codes + e, &c, 1);
  }
}

inline void write_quantized(const torch::Tensor& data, const torch::Tensor& scales, const torch::Tensor& slots,
                            const torch::Tensor& x, int64_t code, double qmax) {
  const int64_t t = x.size(0), h = data.size(2), d = data.size(3);
  TORCH_CHECK(x.scalar_type() == torch::kFloat32 && x.stride(2) == 1 && x.size(1) == h && x.size(2) == d &&
                  slots.scalar_type() == torch::kInt64 && slots.numel() == t && data.is_contiguous() &&
                  scales.is_contiguous(),
              "write_quantized: fp32 rows [T, H, D] and int64 slots expected");
  const int64_t num_slots = data.numel() / (h * d);
  const int64_t* sp = slots.data_ptr<int64_t>();
  uint8_t* dp = data.data_ptr<uint8_t>();
  float* scp = scales.data_ptr<float>();
  const float* xp = x.data_ptr<float>();
  const float q = static_cast<float>(qmax);
  for (int64_t r = 0; r < t; ++r) {
    TORCH_CHECK(sp[r] >= 0 && sp[r] < num_slots, "write_quantized: slot out of range");
    for (int64_t j = 0; j < h; ++j) {
      const float* row = xp + r * x.stride(0) + j * x.stride(1);
      uint8_t* out = dp + (sp[r] * h + j) * d;
      float* s = scp + sp[r] * h + j;
      if (code == 0) quantize_head<int8_t>(row, d, q, out, s);
      else if (code == 1) quantize_head<c10::Float8_e4m3fn>(row, d, q, out, s);
      else quantize_head<c10::Float8_e5m2>(row, d, q, out, s);
    }
  }
}

// x [T, hidden] through every layer; the attention metadata is the step's kernel group, cos / sin
// the step's rows of each RoPE table. With `capture` (ascending layer indices), each of those
// layers' output rows is copied into captured[j] ([len(capture), T, hidden]): a draft head's
// extra features (EAGLE-3). With `reduce` (tensor-parallel ranks, inferd/distributed), each
// layer's attention output (after o) and MLP output (after down, or the mixture's sum) are this
// rank's partial sums: reduce adds them across the ranks, in place, before anything reads them,
// where the Python layer does (DecoderLayer.reduce). `lora_masks`: the step's LoRA masks (empty:
// no adapted row), each layer's linears adding their delta from them.
torch::Tensor decode_layers(torch::Tensor x, const std::vector<LayerWeights>& layers,
                            const std::vector<LayerSpec>& specs,
                            const std::vector<torch::Tensor>& k_caches,
                            const std::vector<torch::Tensor>& v_caches, const std::vector<torch::Tensor>& cos,
                            const std::vector<torch::Tensor>& sin,
                            const std::vector<torch::Tensor>& slot_mappings,
                            const torch::Tensor& row_start, const torch::Tensor& q_lens,
                            const torch::Tensor& ctx_lens, const std::vector<torch::Tensor>& block_tables,
                            const std::vector<int64_t>& layer_groups,
                            const Shape& s, const QuantizedCaches& quant,
                            const std::optional<torch::Tensor>& mirror_rows,
                            const std::vector<torch::Tensor>& mirror_slots,
                            const std::vector<int64_t>& capture,
                            const std::optional<torch::Tensor>& captured,
                            const std::optional<std::function<torch::Tensor(torch::Tensor)>>& reduce,
                            const LoRAMasks& lora_masks) {
  TORCH_CHECK(layers.size() == k_caches.size() && layers.size() == v_caches.size() && layers.size() == specs.size(),
              "decode_layers: one spec, one K and one V cache per layer");
  TORCH_CHECK(!cos.empty() && cos.size() == sin.size(), "decode_layers: one sin table per cos table");
  for (const LayerSpec& spec : specs)
    TORCH_CHECK(spec.rope >= 0 && spec.rope < static_cast<int64_t>(cos.size()), "decode_layers: rope table out of range");
  // KV cache groups (inferd/kv/kv_groups.py): layer i writes and reads through group
  // layer_groups[i]'s slots and block tables; every group shares the rows and lengths.
  TORCH_CHECK(layer_groups.size() == layers.size(), "decode_layers: one KV group per layer");
  TORCH_CHECK(!slot_mappings.empty() && slot_mappings.size() == block_tables.size(),
              "decode_layers: one slot mapping and one block table per KV group");
  TORCH_CHECK(!mirror_rows.has_value() || mirror_slots.size() == slot_mappings.size(),
              "decode_layers: one mirror slot list per KV group");
  for (int64_t g : layer_groups)
    TORCH_CHECK(g >= 0 && g < static_cast<int64_t>(slot_mappings.size()), "decode_layers: KV group out of range");
  const bool quantized = !quant.k_scales.empty();
  TORCH_CHECK(!quantized || (quant.k_scales.size() == layers.size() && quant.v_scales.size() == layers.size()),
              "decode_layers: one K and one V scale tensor per layer");
  const int64_t t = x.size(0), q_size = s.n_heads * s.head_dim, kv_size = s.n_kv * s.head_dim;
  // The residual add of each block is fused with the norm after it (exact adds: the same bits as
  // DecoderLayer's `x + ...` followed by the norm).
  TORCH_CHECK(capture.empty() || (captured.has_value() && captured->size(0) == static_cast<int64_t>(capture.size())),
              "decode_layers: one captured row block per captured layer");
  if (layers.empty()) return x;
  size_t next_capture = 0;  // capture[next_capture]: the next layer whose output is kept
  auto keep_output_of = [&](size_t layer) {
    if (next_capture < capture.size() && capture[next_capture] == static_cast<int64_t>(layer))
      (*captured)[static_cast<int64_t>(next_capture++)].copy_(x);
  };
  torch::Tensor h = layer_ops::rms_norm(x, layers[0].input_norm, s.eps);
  torch::Tensor pending;  // the last MLP output, not yet added to x
  for (size_t i = 0; i < layers.size(); ++i) {
    const LayerWeights& l = layers[i];
    const LayerSpec& spec = specs[i];
    const torch::Tensor& slot_mapping = slot_mappings[layer_groups[i]];
    const torch::Tensor& tables = block_tables[layer_groups[i]];
    if (pending.defined()) {
      std::tie(x, h) = layer_ops::add_rms_norm(x, pending, l.input_norm, s.eps);
      keep_output_of(i - 1);
    }
    // Attention.forward
    torch::Tensor qkv = adapted_linear(l.qkv, l.qkv_lora, h, s, lora_masks);
    std::vector<torch::Tensor> parts = qkv.split_with_sizes({q_size + kv_size, kv_size}, -1);
    const torch::Tensor& c = cos[spec.rope];
    const torch::Tensor& sn = sin[spec.rope];
    const torch::Tensor qk_rows = parts[0].view({t, s.n_heads + s.n_kv, s.head_dim});
    torch::Tensor q, k;
    if (l.q_norm.defined() && spec.qk_norm_all) {  // RMSNorm of all of q and all of k, then RoPE
      q = layer_ops::rotary(layer_ops::rms_norm(parts[0].narrow(1, 0, q_size), l.q_norm, s.eps)
                                .view({t, s.n_heads, s.head_dim}), c, sn);
      k = layer_ops::rotary(layer_ops::rms_norm(parts[0].narrow(1, q_size, kv_size), l.k_norm, s.eps)
                                .view({t, s.n_kv, s.head_dim}), c, sn);
    } else if (l.q_norm.defined()) {  // RMSNorm of each q and k head, then RoPE
      q = layer_ops::rotary(layer_ops::rms_norm_heads(qk_rows.narrow(1, 0, s.n_heads), l.q_norm, s.eps), c, sn);
      k = layer_ops::rotary(layer_ops::rms_norm_heads(qk_rows.narrow(1, s.n_heads, s.n_kv), l.k_norm, s.eps), c, sn);
    } else {  // q and k heads rotate together
      std::vector<torch::Tensor> q_k = layer_ops::rotary(qk_rows, c, sn).split_with_sizes({s.n_heads, s.n_kv}, 1);
      q = q_k[0].contiguous();
      k = q_k[1];
    }
    // paged_attention (inferd/layers/attention.py), kernel group only: K/V into their slots.
    const torch::Tensor v_rows = parts[1].view({t, s.n_kv, s.head_dim});
    torch::Tensor o = torch::empty_like(q);
    if (mirror_rows.has_value()) {  // a draft-tree leaf's scratch block repeats these keys
      if (quantized) {
        const torch::Tensor mk = k.index_select(0, *mirror_rows);
        const torch::Tensor mv = v_rows.index_select(0, *mirror_rows);
        write_quantized(k_caches[i], quant.k_scales[i], mirror_slots[layer_groups[i]], mk, quant.code, quant.qmax);
        write_quantized(v_caches[i], quant.v_scales[i], mirror_slots[layer_groups[i]], mv, quant.code, quant.qmax);
      } else {
        layer_ops::write_rows(k_caches[i], mirror_slots[layer_groups[i]], k, &*mirror_rows);
        layer_ops::write_rows(v_caches[i], mirror_slots[layer_groups[i]], v_rows, &*mirror_rows);
      }
    }
    if (quantized) {
      write_quantized(k_caches[i], quant.k_scales[i], slot_mapping, k, quant.code, quant.qmax);
      write_quantized(v_caches[i], quant.v_scales[i], slot_mapping, v_rows, quant.code, quant.qmax);
      paged_attn::paged_attention_short_quant(q, k_caches[i], v_caches[i], quant.k_scales[i], quant.v_scales[i],
                                              quant.code, row_start, q_lens, ctx_lens, tables, o, spec.scale,
                                              spec.window, spec.softcap);
    } else {
      layer_ops::write_rows(k_caches[i], slot_mapping, k);
      layer_ops::write_rows(v_caches[i], slot_mapping, v_rows);
      paged_attn::paged_attention_short(q, k_caches[i], v_caches[i], row_start, q_lens, ctx_lens,
                                        tables, o, spec.scale, spec.window, spec.softcap);
    }
    torch::Tensor attn = adapted_linear(l.o, l.o_lora, o.reshape({t, q_size}), s, lora_masks);
    if (reduce) attn = (*reduce)(attn);
    if (l.post_attn_norm.defined()) attn = layer_ops::rms_norm(attn, l.post_attn_norm, s.eps);
    std::tie(x, h) = layer_ops::add_rms_norm(x, attn, l.post_norm, s.eps);
    // MLP.forward, or SparseMoE.forward
    if (l.moe.router.defined()) {
      pending = std::get<0>(moe_forward(h, l.moe, s));
    } else {
      const torch::Tensor gu = adapted_linear(l.gate_up, l.gate_up_lora, h, s, lora_masks);
      const torch::Tensor act = spec.activation == LayerSpec::kGeluTanh ? layer_ops::gelu_tanh_mul(gu)
                                                                        : layer_ops::silu_mul(gu);
      pending = adapted_linear(l.down, l.down_lora, act, s, lora_masks);
    }
    if (reduce) pending = (*reduce)(pending);
    if (l.post_mlp_norm.defined()) pending = layer_ops::rms_norm(pending, l.post_mlp_norm, s.eps);
  }
  if (pending.defined()) x = x + pending;
  keep_output_of(layers.size() - 1);
  TORCH_CHECK(next_capture == capture.size(), "decode_layers: captured layers must be ascending and exist");
  return x;
}

}  // namespace decoder
