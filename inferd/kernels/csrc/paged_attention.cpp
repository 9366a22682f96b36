// Paged attention for short queries (decodes, short prefill chunks) on the CPU, reading K/V in
// place from the block pool: no gathered copy of each sequence's context per layer.
//
// One task per (sequence, kv head): the G = Hq / Hkv query heads that share the kv head and all
// of the sequence's q_len queries are scored against each key as it is read, so K and V are read
// once per task. Two passes (scores, then weighted V) with an exact softmax in fp32.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

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

}  // namespace

// q, out: [T, Hq, D] (rows of the flat batch); k_cache, v_cache: [num_blocks, block_size, Hkv, D]
// row_start, q_lens, ctx_lens: [B]; block_tables: [B, max_blocks]. Query i of sequence b is flat
// row row_start[b] + i at position ctx_lens[b] - q_lens[b] + i and sees keys [0, that position].
void paged_attention_short(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor row_start, torch::Tensor q_lens, torch::Tensor ctx_lens,
                           torch::Tensor block_tables, torch::Tensor out, double scale) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k_cache.scalar_type() == torch::kFloat32,
              "paged_attention_short: fp32 only");
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && k_cache.is_contiguous() &&
                  v_cache.is_contiguous() && block_tables.is_contiguous(),
              "paged_attention_short: contiguous tensors expected");
  const int64_t hq = q.size(1), d = q.size(2);
  const int64_t block_size = k_cache.size(1), hkv = k_cache.size(2);
  const int64_t group = hq / hkv;
  const int64_t num_seqs = row_start.size(0), max_blocks = block_tables.size(1);
  const float* qp = q.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t* rs = row_start.data_ptr<int64_t>();
  const int64_t* ql = q_lens.data_ptr<int64_t>();
  const int64_t* cl = ctx_lens.data_ptr<int64_t>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const int64_t token_stride = hkv * d;  // between consecutive slots of a block
  const float fscale = static_cast<float>(scale);

  at::parallel_for(0, num_seqs * hkv, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / hkv, h = task % hkv;
      const int64_t n_q = ql[b], ctx = cl[b], first_pos = ctx - n_q;
      const int64_t rows = n_q * group;  // (query i, head g) pairs, row r = i * group + g
      scores.assign(rows * ctx, -std::numeric_limits<float>::infinity());
      const int64_t* table = bt + b * max_blocks;
      // Pass 1: scores for every (query, head) against every visible key.
      for (int64_t j = 0; j < ctx; ++j) {
        const float* key = kp + (table[j / block_size] * block_size + j % block_size) * token_stride + h * d;
        const int64_t i0 = std::max<int64_t>(0, j - first_pos);  // first query that sees key j
        for (int64_t i = i0; i < n_q; ++i) {
          const float* qrow = qp + ((rs[b] + i) * hq + h * group) * d;
          for (int64_t g = 0; g < group; ++g)
            scores[(i * group + g) * ctx + j] = dot(qrow + g * d, key, d) * fscale;
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
        for (int64_t g = 0; g < group; ++g)
          std::fill_n(op + ((rs[b] + i) * hq + h * group + g) * d, d, 0.f);
      for (int64_t j = 0; j < ctx; ++j) {
        const float* val = vp + (table[j / block_size] * block_size + j % block_size) * token_stride + h * d;
        const int64_t i0 = std::max<int64_t>(0, j - first_pos);
        for (int64_t i = i0; i < n_q; ++i) {
          float* orow = op + ((rs[b] + i) * hq + h * group) * d;
          for (int64_t g = 0; g < group; ++g)
            axpy(orow + g * d, val, scores[(i * group + g) * ctx + j], d);
        }
      }
    }
  });
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention_short", &paged_attention_short, "paged attention for short queries (CPU, fp32)");
}
