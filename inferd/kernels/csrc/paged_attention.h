// Paged attention for short queries (decodes, short prefill chunks) on the CPU, reading K/V in
// place from the block pool: no gathered copy of each sequence's context per layer.
//
// One task per (sequence, kv head): the G = Hq / Hkv query heads that share the kv head and all
// of the sequence's q_len queries are scored against each key as it is read, so K and V are read
// once per task. Two passes (scores, then weighted V) with an exact softmax in fp32. A quantized
// cache (int8 / fp8 codes with a scale per slot and head) is decoded a row at a time as it is read.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace paged_attn {
namespace {

inline float dot(const float* a, const float* b, int64_t n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int64_t i = 0; i < n; ++i) s += a[i] * b[i];
  return s;
}

inline void axpy(float* y, const float* x, float a, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

// Where a slot-head's K or V row comes from. FloatRows: fp32 in place. CodeRows: one byte per
// element (int8, fp8 e4m3 or e5m2 bits) decoded into a buffer, and the row's scale, which the
// caller folds into the score (K) or the softmax weight (V) rather than into every element.
struct FloatRows {
  const float* base;
  int64_t hkv, d;
  const float* row(int64_t slot, int64_t h, float*) const { return base + (slot * hkv + h) * d; }
  float scale(int64_t, int64_t) const { return 1.f; }
};

enum Code : int64_t { kInt8 = 0, kE4M3 = 1, kE5M2 = 2 };

template <int64_t C>
struct CodeRows {
  const uint8_t* base;
  const float* scales;  // [slots, hkv]
  int64_t hkv, d;
  const float* row(int64_t slot, int64_t h, float* buf) const {
    const uint8_t* src = base + (slot * hkv + h) * d;
#pragma omp simd
    for (int64_t i = 0; i < d; ++i) {
      const uint32_t b = src[i];
      if constexpr (C == kInt8) {
        buf[i] = static_cast<float>(static_cast<int8_t>(src[i]));
      } else {
        // Place sign, exponent and mantissa in an fp32's bit fields, then rebias the exponent by
        // a multiply (2^(127-7) for e4m3, 2^(127-15) for e5m2): exact, subnormal codes included.
        const uint32_t bits = C == kE4M3 ? ((b & 0x80u) << 24) | ((b & 0x7Fu) << 20)
                                         : ((b & 0x80u) << 24) | ((b & 0x7Fu) << 21);
        float f;
        std::memcpy(&f, &bits, sizeof f);
        buf[i] = f * (C == kE4M3 ? 0x1p120f : 0x1p112f);
      }
    }
    return buf;
  }
  float scale(int64_t slot, int64_t h) const { return scales[slot * hkv + h]; }
};

// q, out: [T, Hq, D] (rows of the flat batch); K/V rows per slot and kv head (see above).
// row_start, q_lens, ctx_lens: [B]; block_tables: [B, max_blocks]. Query i of sequence b is flat
// row row_start[b] + i at position ctx_lens[b] - q_lens[b] + i and sees keys [0, that position].
template <class Rows>
void attend(const torch::Tensor& q, const Rows& keys, const Rows& vals, int64_t hkv,
            int64_t block_size, const torch::Tensor& row_start, const torch::Tensor& q_lens,
            const torch::Tensor& ctx_lens, const torch::Tensor& block_tables, torch::Tensor& out,
            double scale) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && out.scalar_type() == torch::kFloat32,
              "paged_attention: fp32 queries only");
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && block_tables.is_contiguous(),
              "paged_attention: contiguous tensors expected");
  const int64_t hq = q.size(1), d = q.size(2);
  const int64_t group = hq / hkv;
  const int64_t num_seqs = row_start.size(0), max_blocks = block_tables.size(1);
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t* rs = row_start.data_ptr<int64_t>();
  const int64_t* ql = q_lens.data_ptr<int64_t>();
  const int64_t* cl = ctx_lens.data_ptr<int64_t>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, num_seqs * hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> buf(d);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / hkv, h = task % hkv;
      const int64_t n_q = ql[b], ctx = cl[b], first_pos = ctx - n_q;
      const int64_t rows = n_q * group;  // (query i, head g) pairs, row r = i * group + g
      scores.assign(rows * ctx, -std::numeric_limits<float>::infinity());
      const int64_t* table = bt + b * max_blocks;
      // Pass 1: scores for every (query, head) against every visible key.
      for (int64_t j = 0; j < ctx; ++j) {
        const int64_t slot = table[j / block_size] * block_size + j % block_size;
        const float* key = keys.row(slot, h, buf.data());
        const float s = fscale * keys.scale(slot, h);
        const int64_t i0 = std::max<int64_t>(0, j - first_pos);  // first query that sees key j
        for (int64_t i = i0; i < n_q; ++i) {
          const float* qrow = qp + ((rs[b] + i) * hq + h * group) * d;
          for (int64_t g = 0; g < group; ++g) scores[(i * group + g) * ctx + j] = dot(qrow + g * d, key, d) * s;
        }
      }
      // Softmax per row over its visible keys [0, first_pos + i].
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t visible = first_pos + r / group + 1;
        float* s = scores.data() + r * ctx;
        float m = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < visible; ++j) m = std::max(m, s[j]);
        float sum = 0.f;
        for (int64_t j = 0; j < visible; ++j) {
          s[j] = std::exp(s[j] - m);
          sum += s[j];
        }
        const float inv = 1.f / sum;
        for (int64_t j = 0; j < visible; ++j) s[j] *= inv;
      }
      // Pass 2: weighted sum of values.
      for (int64_t i = 0; i < n_q; ++i)
        for (int64_t g = 0; g < group; ++g) std::fill_n(op + ((rs[b] + i) * hq + h * group + g) * d, d, 0.f);
      for (int64_t j = 0; j < ctx; ++j) {
        const int64_t slot = table[j / block_size] * block_size + j % block_size;
        const float* val = vals.row(slot, h, buf.data());
        const float vs = vals.scale(slot, h);
        const int64_t i0 = std::max<int64_t>(0, j - first_pos);
        for (int64_t i = i0; i < n_q; ++i) {
          float* orow = op + ((rs[b] + i) * hq + h * group) * d;
          for (int64_t g = 0; g < group; ++g) axpy(orow + g * d, val, scores[(i * group + g) * ctx + j] * vs, d);
        }
      }
    }
  });
}

}  // namespace

// k_cache, v_cache: [num_blocks, block_size, Hkv, D] fp32.
void paged_attention_short(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor row_start, torch::Tensor q_lens, torch::Tensor ctx_lens,
                           torch::Tensor block_tables, torch::Tensor out, double scale) {
  TORCH_CHECK(k_cache.scalar_type() == torch::kFloat32 && v_cache.scalar_type() == torch::kFloat32,
              "paged_attention_short: fp32 cache only");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_attention_short: contiguous cache expected");
  const int64_t hkv = k_cache.size(2), d = k_cache.size(3);
  const FloatRows keys{k_cache.data_ptr<float>(), hkv, d}, vals{v_cache.data_ptr<float>(), hkv, d};
  attend(q, keys, vals, hkv, k_cache.size(1), row_start, q_lens, ctx_lens, block_tables, out, scale);
}

// k_data, v_data: [num_blocks, block_size, Hkv, D] uint8 codes; k_scale, v_scale: [num_blocks,
// block_size, Hkv] fp32; code: 0 int8, 1 fp8 e4m3, 2 fp8 e5m2. Element = decode(code) * scale.
void paged_attention_short_quant(torch::Tensor q, torch::Tensor k_data, torch::Tensor v_data,
                                 torch::Tensor k_scale, torch::Tensor v_scale, int64_t code,
                                 torch::Tensor row_start, torch::Tensor q_lens, torch::Tensor ctx_lens,
                                 torch::Tensor block_tables, torch::Tensor out, double scale) {
  TORCH_CHECK(k_data.scalar_type() == torch::kUInt8 && v_data.scalar_type() == torch::kUInt8 &&
                  k_scale.scalar_type() == torch::kFloat32 && v_scale.scalar_type() == torch::kFloat32,
              "paged_attention_short_quant: uint8 codes and fp32 scales expected");
  TORCH_CHECK(k_data.is_contiguous() && v_data.is_contiguous() && k_scale.is_contiguous() && v_scale.is_contiguous(),
              "paged_attention_short_quant: contiguous cache expected");
  const int64_t hkv = k_data.size(2), d = k_data.size(3), bs = k_data.size(1);
  const auto run = [&](auto rows_tag) {
    using Rows = decltype(rows_tag);
    const Rows keys{k_data.data_ptr<uint8_t>(), k_scale.data_ptr<float>(), hkv, d};
    const Rows vals{v_data.data_ptr<uint8_t>(), v_scale.data_ptr<float>(), hkv, d};
    attend(q, keys, vals, hkv, bs, row_start, q_lens, ctx_lens, block_tables, out, scale);
  };
  switch (code) {
    case kInt8: run(CodeRows<kInt8>{}); break;
    case kE4M3: run(CodeRows<kE4M3>{}); break;
    case kE5M2: run(CodeRows<kE5M2>{}); break;
    default: TORCH_CHECK(false, "paged_attention_short_quant: unknown code ", code);
  }
}

}  // namespace paged_attn
