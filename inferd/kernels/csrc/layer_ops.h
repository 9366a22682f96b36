// The decoder layer's elementwise work on fp32 CPU rows, one loop per op: RMSNorm (of rows, or of
// each head: qk-norm), rotary embedding, SiLU(gate) · up or GELU-tanh(gate) · up. ATen runs them as ~20 small kernels per layer (RMSNorm alone is a
// 7-op composite on the CPU), ~2-3 µs of dispatch each, about a fifth of a batch-1 decode step.
// Both the Python layers (inferd/layers, inferd/models/decoder.py) and the fused decode step
// (decoder_layers.h) call these, so both paths give the same bits; each row is computed by the
// same code whatever the row count or thread split (rows are the unit of parallel work), so a
// sequence's numbers never depend on what shares its step.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <vector>

namespace layer_ops {

inline void check_rows(const torch::Tensor& x, int64_t cols, const char* what) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.device().is_cpu() &&
                  x.stride(1) == 1 && x.size(1) == cols,
              what, ": 2-D fp32 CPU rows of ", cols, " contiguous values expected");
}

// Σ x² over n values in 8 lanes (fixed order: lane l takes indices l, l + 8, ...; then a fixed
// tree), the remainder added last in index order.
inline float sum_squares(const float* x, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const __m256 v = _mm256_loadu_ps(x + i);
    acc = _mm256_fmadd_ps(v, v, acc);
  }
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  float total = _mm_cvtss_f32(s);
  for (; i < n; ++i) total = std::fma(x[i], x[i], total);
  return total;
}

// y = x / sqrt(mean(x²) + eps) · w, per row of x [T, H] (row stride free, columns contiguous).
// With `delta`, x + delta first (the residual add: exact, so the same bits as adding apart), and
// that sum is returned too, in `sum_out`.
inline torch::Tensor rms_norm_impl(const torch::Tensor& x, const torch::Tensor* delta,
                                   torch::Tensor* sum_out, const torch::Tensor& w, double eps) {
  const int64_t t = x.size(0), h = w.numel();
  check_rows(x, h, "rms_norm");
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == torch::kFloat32, "rms_norm: fp32 weight");
  auto y = torch::empty({t, h}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  int64_t stride = x.stride(0);
  if (delta != nullptr) {
    check_rows(*delta, h, "add_rms_norm");
    TORCH_CHECK(delta->size(0) == t, "add_rms_norm: as many rows as x");
    *sum_out = torch::empty({t, h}, x.options());
  }
  const float feps = static_cast<float>(eps), inv_h = 1.0f / static_cast<float>(h);
  at::parallel_for(0, t, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = xp + r * stride;
      if (delta != nullptr) {
        const float* dr = delta->data_ptr<float>() + r * delta->stride(0);
        float* sr = sum_out->data_ptr<float>() + r * h;
        for (int64_t i = 0; i < h; ++i) sr[i] = xr[i] + dr[i];
        xr = sr;
      }
      const float scale = 1.0f / std::sqrt(sum_squares(xr, h) * inv_h + feps);
      float* yr = yp + r * h;
      for (int64_t i = 0; i < h; ++i) yr[i] = xr[i] * scale * wp[i];
    }
  });
  return y;
}

inline torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  return rms_norm_impl(x, nullptr, nullptr, w, eps);
}

// rms_norm over each head of x [T, H, D] (any row and head strides, D contiguous) with one weight
// [D]: qk-norm on the q or k heads of a fused projection's output, without a copy first. Each
// head is normalised by rms_norm's row code, so the bits are those of rms_norm on the heads as
// rows. Returns [T, H, D] contiguous.
inline torch::Tensor rms_norm_heads(const torch::Tensor& x, const torch::Tensor& w, double eps) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == torch::kFloat32 && x.device().is_cpu() && x.stride(2) == 1 &&
                  x.size(2) == w.numel(),
              "rms_norm_heads: fp32 CPU [T, H, D] with contiguous D and a [D] weight expected");
  TORCH_CHECK(w.is_contiguous() && w.scalar_type() == torch::kFloat32, "rms_norm_heads: fp32 weight");
  const int64_t t = x.size(0), h = x.size(1), d = x.size(2);
  auto y = torch::empty({t, h, d}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  const float feps = static_cast<float>(eps), inv_d = 1.0f / static_cast<float>(d);
  at::parallel_for(0, t * h, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* xr = xp + (r / h) * s0 + (r % h) * s1;
      const float scale = 1.0f / std::sqrt(sum_squares(xr, d) * inv_d + feps);
      float* yr = yp + r * d;
      for (int64_t i = 0; i < d; ++i) yr[i] = xr[i] * scale * wp[i];
    }
  });
  return y;
}

// (x + delta, rms_norm(x + delta)): a layer's residual add fused with the next norm.
inline std::tuple<torch::Tensor, torch::Tensor> add_rms_norm(const torch::Tensor& x, const torch::Tensor& delta,
                                                             const torch::Tensor& w, double eps) {
  torch::Tensor sum;
  torch::Tensor y = rms_norm_impl(x, &delta, &sum, w, eps);
  return {sum, y};
}

// n fp32 values rounded to the nearest even fp16 / bf16, as ATen's `.to()` rounds them (so the
// fused decode step stores the bits the Python layers' index_copy_ would).
inline void narrow_row(const float* src, c10::Half* dst, int64_t n) {
  int64_t i = 0;
#ifdef __AVX512F__
  for (; i + 16 <= n; i += 16)
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + i),
                        _mm512_cvtps_ph(_mm512_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC));
#endif
  for (; i < n; ++i) dst[i] = c10::Half(src[i]);
}
inline void narrow_row(const float* src, c10::BFloat16* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = c10::BFloat16(src[i]);
}

// cache [N, block_size, H, D] fp32, fp16 or bf16: the fp32 rows of `rows` [T, H, D] (each row's
// H·D values contiguous) written to flat slots `slots` [T] (index_copy_ without the dispatch);
// with `which` [S] (int64), rows[which[i]] to slots[i] (a draft-tree leaf's mirrored keys,
// without an index_select's copy: two of those per layer cost ~0.15 ms of a decode step).
inline void write_rows(const torch::Tensor& cache, const torch::Tensor& slots, const torch::Tensor& rows,
                       const torch::Tensor* which = nullptr) {
  const int64_t n = rows.size(1) * rows.size(2);
  const int64_t t = which != nullptr ? which->numel() : rows.size(0);
  const auto dtype = cache.scalar_type();
  TORCH_CHECK(cache.is_contiguous() &&
                  (dtype == torch::kFloat32 || dtype == torch::kFloat16 || dtype == torch::kBFloat16) &&
                  rows.scalar_type() == torch::kFloat32 && rows.stride(2) == 1 && rows.stride(1) == rows.size(2) &&
                  slots.scalar_type() == torch::kInt64 && slots.numel() == t &&
                  (which == nullptr || (which->scalar_type() == torch::kInt64 && which->is_contiguous())),
              "write_rows: fp32 / fp16 / bf16 cache, fp32 rows, int64 slots (and rows) expected");
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* wp = which != nullptr ? which->data_ptr<int64_t>() : nullptr;
  const float* rp = rows.data_ptr<float>();
  const int64_t num_slots = cache.numel() / n;
  for (int64_t r = 0; r < t; ++r) {
    TORCH_CHECK(sp[r] >= 0 && sp[r] < num_slots, "write_rows: slot out of range");
    const int64_t row = wp != nullptr ? wp[r] : r;
    TORCH_CHECK(row >= 0 && row < rows.size(0), "write_rows: row out of range");
    const float* src = rp + row * rows.stride(0);
    if (dtype == torch::kFloat32)
      std::memcpy(cache.data_ptr<float>() + sp[r] * n, src, n * sizeof(float));
    else if (dtype == torch::kFloat16)
      narrow_row(src, cache.data_ptr<c10::Half>() + sp[r] * n, n);
    else
      narrow_row(src, cache.data_ptr<c10::BFloat16>() + sp[r] * n, n);
  }
}

// data [L, 2, N, block_size, ...] contiguous, any dtype (a KV pool or its scales): in every
// (layer, K/V), the row at flat slot src[i] (N · block_size slots) copied to slot dst[i], all read
// before any is written (as `data[:, :, dst] = data[:, :, src]`). Why: right after a decode step
// ATen's gather-then-scatter costs ~90 µs a call on cold rows (a draft-tree leaf's scratch block
// repeating the keys before it in its block, up to 15 slots of 60 rows of 768 bytes each for the
// default model; an accepted leaf's row into the sequence's block), in nearly every k = 3 step.
inline void copy_slots(const torch::Tensor& data, const torch::Tensor& src, const torch::Tensor& dst) {
  TORCH_CHECK(data.dim() >= 4 && data.is_contiguous() && src.scalar_type() == torch::kInt64 &&
                  dst.scalar_type() == torch::kInt64 && src.is_contiguous() && dst.is_contiguous() &&
                  src.numel() == dst.numel(),
              "copy_slots: contiguous [L, 2, N, block_size, ...] data and int64 src, dst of one length");
  const int64_t outer = data.size(0) * data.size(1), slots = data.size(2) * data.size(3);
  const int64_t row = slots == 0 ? 0 : data.numel() / (outer * slots) * data.element_size();
  const int64_t t = src.numel();
  const int64_t* sp = src.data_ptr<int64_t>();
  const int64_t* dp = dst.data_ptr<int64_t>();
  for (int64_t i = 0; i < t; ++i)
    TORCH_CHECK(sp[i] >= 0 && sp[i] < slots && dp[i] >= 0 && dp[i] < slots, "copy_slots: slot out of range");
  auto* base = static_cast<uint8_t*>(data.data_ptr());
  // Each (layer, K/V) on its own (its sources all read before its destinations are written:
  // slots never move across layers), the layers split between the threads, and every line
  // prefetched first: the rows are scattered over the pool and cold, and their misses overlap
  // instead of following one another.
  at::parallel_for(0, outer, 8, [&](int64_t o0, int64_t o1) {
    std::vector<uint8_t> rows(static_cast<size_t>(t * row));
    for (int64_t o = o0; o < o1; ++o) {
      uint8_t* part = base + o * slots * row;
      for (int64_t i = 0; i < t; ++i)
        for (int64_t b = 0; b < row; b += 64) {
          _mm_prefetch(reinterpret_cast<const char*>(part + sp[i] * row + b), _MM_HINT_T0);
          _mm_prefetch(reinterpret_cast<const char*>(part + dp[i] * row + b), _MM_HINT_T0);
        }
    }
    for (int64_t o = o0; o < o1; ++o) {
      uint8_t* part = base + o * slots * row;
      for (int64_t i = 0; i < t; ++i) std::memcpy(rows.data() + i * row, part + sp[i] * row, row);
      for (int64_t i = 0; i < t; ++i) std::memcpy(part + dp[i] * row, rows.data() + i * row, row);
    }
  });
}

// out [T, H, D] = x · cos + swap_halves(x) · sin for x [T, H, D] (any row and head strides, D
// contiguous) and the step's full-width tables cos, sin [T, 1, D] (inferd/layers/rotary.py).
inline torch::Tensor rotary(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  TORCH_CHECK(x.dim() == 3 && x.scalar_type() == torch::kFloat32 && x.stride(2) == 1,
              "rotary: fp32 [T, H, D] with contiguous D expected");
  const int64_t t = x.size(0), h = x.size(1), d = x.size(2), half = d / 2;
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == t * d && sin.numel() == t * d,
              "rotary: contiguous [T, 1, D] tables expected");
  auto out = torch::empty({t, h, d}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* cp = cos.data_ptr<float>();
  const float* sp = sin.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t s0 = x.stride(0), s1 = x.stride(1);
  at::parallel_for(0, t, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r)
      for (int64_t j = 0; j < h; ++j) {
        const float* xr = xp + r * s0 + j * s1;
        const float* c = cp + r * d;
        const float* s = sp + r * d;
        float* o = op + (r * h + j) * d;
        for (int64_t i = 0; i < half; ++i) o[i] = xr[i] * c[i] + xr[i + half] * s[i];
        for (int64_t i = half; i < d; ++i) o[i] = xr[i] * c[i] + xr[i - half] * s[i];
      }
  });
  return out;
}

// exp(x) for x <= 0, 8 at a time (Cephes' expf: round to n = x·log2(e), a degree-6 polynomial of
// the remainder, times 2^n; within ~2 ulp).
inline __m256 exp_nonpositive(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.33654f));  // below: 2^n would be subnormal; e^x ≈ 0 anyway
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);  // x - n·ln2 in two parts
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 y = _mm256_set1_ps(1.9875691500e-4f);
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.3981999507e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(8.3334519073e-3f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(4.1665795894e-2f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(1.6666665459e-1f));
  y = _mm256_fmadd_ps(y, r, _mm256_set1_ps(5.0000001201e-1f));
  y = _mm256_fmadd_ps(y, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(y, _mm256_castsi256_ps(e));
}

// s[0, n) := exp(s - m) for m >= max s; returns their sum (8 lanes, then the lanes folded,
// then the tail in order). Softmax's pass in the attention kernels.
inline float exp_shift_sum(float* s, int64_t n, float m) {
  const __m256 vmax = _mm256_set1_ps(m);
  __m256 vsum = _mm256_setzero_ps();
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(s + j), vmax));
    _mm256_storeu_ps(s + j, e);
    vsum = _mm256_add_ps(vsum, e);
  }
  __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(vsum), _mm256_extractf128_ps(vsum, 1));
  s4 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
  s4 = _mm_add_ss(s4, _mm_movehdup_ps(s4));
  float sum = _mm_cvtss_f32(s4);
  for (; j < n; ++j) {
    s[j] = std::exp(s[j] - m);
    sum += s[j];
  }
  return sum;
}

// silu(g) = g · sigmoid(g), with e = exp(-|g|) <= 1: sigmoid = 1 / (1 + e) for g >= 0, e / (1 + e)
// below, so the exponential never overflows.
inline __m256 silu8(__m256 g) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  const __m256 e = exp_nonpositive(_mm256_or_ps(g, sign));  // exp(-|g|)
  const __m256 den = _mm256_add_ps(_mm256_set1_ps(1.0f), e);
  const __m256 neg = _mm256_cmp_ps(g, _mm256_setzero_ps(), _CMP_LT_OQ);
  const __m256 num = _mm256_blendv_ps(_mm256_set1_ps(1.0f), e, neg);
  return _mm256_mul_ps(g, _mm256_div_ps(num, den));
}

// x · sigmoid(z) for z = 2·sqrt(2/pi)·(x + 0.044715·x³): GELU's tanh form, 0.5·x·(1 + tanh(z/2)),
// through the identity 0.5·(1 + tanh(u)) = sigmoid(2u), with silu8's overflow-free sigmoid.
inline __m256 gelu_tanh8(__m256 x) {
  const __m256 x3 = _mm256_mul_ps(_mm256_mul_ps(x, x), x);
  const __m256 z = _mm256_mul_ps(_mm256_set1_ps(1.5957691216057308f),  // 2 · sqrt(2 / pi)
                                 _mm256_fmadd_ps(_mm256_set1_ps(0.044715f), x3, x));
  const __m256 e = exp_nonpositive(_mm256_or_ps(z, _mm256_set1_ps(-0.0f)));  // exp(-|z|)
  const __m256 den = _mm256_add_ps(_mm256_set1_ps(1.0f), e);
  const __m256 neg = _mm256_cmp_ps(z, _mm256_setzero_ps(), _CMP_LT_OQ);
  const __m256 num = _mm256_blendv_ps(_mm256_set1_ps(1.0f), e, neg);
  return _mm256_mul_ps(x, _mm256_div_ps(num, den));
}

inline float gelu_tanh1(float x) {
  const float z = 1.5957691216057308f * std::fma(0.044715f, x * x * x, x);
  const float e = std::exp(-std::fabs(z));
  return x * ((z < 0.0f ? e : 1.0f) / (1.0f + e));
}

// out [T, I] = act(gu[:, :I]) · gu[:, I:] for the fused gate/up projection's output gu [T, 2I].
template <bool Gelu>
inline torch::Tensor act_mul(const torch::Tensor& gu) {
  TORCH_CHECK(gu.dim() == 2 && gu.size(1) % 2 == 0, "act_mul: [T, 2I] expected");
  const int64_t t = gu.size(0), inter = gu.size(1) / 2;
  check_rows(gu, 2 * inter, "act_mul");
  auto out = torch::empty({t, inter}, gu.options());
  const float* gp = gu.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t stride = gu.stride(0);
  at::parallel_for(0, t, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* g = gp + r * stride;
      const float* u = g + inter;
      float* o = op + r * inter;
      int64_t i = 0;
      for (; i + 8 <= inter; i += 8) {
        const __m256 a = Gelu ? gelu_tanh8(_mm256_loadu_ps(g + i)) : silu8(_mm256_loadu_ps(g + i));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(a, _mm256_loadu_ps(u + i)));
      }
      for (; i < inter; ++i) {
        if constexpr (Gelu) {
          o[i] = gelu_tanh1(g[i]) * u[i];
        } else {
          const float e = std::exp(-std::fabs(g[i]));
          o[i] = g[i] * ((g[i] < 0.0f ? e : 1.0f) / (1.0f + e)) * u[i];
        }
      }
    }
  });
  return out;
}

inline torch::Tensor gelu_tanh_mul(const torch::Tensor& gu) { return act_mul<true>(gu); }

// out [T, I] = silu(gu[:, :I]) · gu[:, I:] for the fused gate/up projection's output gu [T, 2I].
inline torch::Tensor silu_mul(const torch::Tensor& gu) { return act_mul<false>(gu); }

}  // namespace layer_ops
