// One linear layer as the C++ steps hold it (decoder::LinearWeights) and the call that runs it
// with the kernel the Python layer would pick, so either path gives the same bits.
#pragma once

#include <torch/extension.h>

#include "dense_gemv.h"
#include "gguf_blocks.h"
#include "quant_gemm.h"

namespace decoder {

// One linear layer as the model holds it: `Linear` (fp32 weight, F.linear) or `QuantizedLinear`
// (packed weight; inferd/quantization/formats.py `quantized_matmul` decides the kernel).
struct LinearWeights {
  enum Kind : int64_t { kFloat = 0, kInt8 = 1, kInt4 = 2, kFp8 = 3, kTiles = 4 };  // kTiles: packed int8/int4
  int64_t kind;
  torch::Tensor weight;  // fp32 [N, K] or the packed data
  torch::Tensor scales, mins, bias;  // undefined where absent
  int64_t group;
  bool stream = true;  // packed tiles read once a step (a model's): prefetched past the caches
};

struct Shape {
  int64_t n_heads, n_kv, head_dim, intermediate;
  double eps, scale;  // (decode_layers takes each layer's scale from its LayerSpec)
  bool int8_activations;  // formats.INT8_ACTIVATIONS as resolved for this extension
};

inline torch::Tensor quantized_call(const LinearWeights& l, const torch::Tensor& x, bool int8_x) {
  switch (l.kind) {
    case LinearWeights::kInt8: return quant_gemm::q8_linear(x, l.weight, l.scales, l.group, int8_x);
    case LinearWeights::kInt4: return quant_gemm::q4_linear(x, l.weight, l.scales, l.mins, l.group, int8_x);
    default: return quant_gemm::fp8_linear(x, l.weight, l.scales, l.group);
  }
}

inline torch::Tensor linear(const LinearWeights& l, const torch::Tensor& x, const Shape& s) {
  if (l.kind == LinearWeights::kFloat) return dense::linear(x, l.weight, l.bias);
  torch::Tensor y;
  if (gguf_blocks::owns_kind(l.kind)) {  // kinds 5..14: GGUF's 5- / 6-bit and K-quant blocks
    y = gguf_blocks::linear_kind(l.kind, x, l.weight, l.scales, l.mins, s.int8_activations, l.stream);
  } else if (l.kind == LinearWeights::kTiles) {
    TORCH_CHECK(s.int8_activations, "packed int8 tiles take int8 activations only");
    y = quant_gemm::tiles_linear(x, l.weight, l.scales, l.mins.defined() ? l.mins : torch::empty({0}),
                                 l.stream);
  } else
    y = quantized_call(l, x, s.int8_activations && l.kind != LinearWeights::kFp8);
  return l.bias.defined() ? y + l.bias : y;
}

}  // namespace decoder
