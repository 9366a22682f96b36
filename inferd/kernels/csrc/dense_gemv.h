// fp32 x [M, K] · W [N, K]^T for a few rows (a decode step's batch, a few verified drafts): the
// weights streamed once from memory for all M rows.
//
// Why not at::linear: at 4-8 rows MKL's sgemm streamed the default model's 538 MB of fp32
// weights at ~10-13 GB/s (30 layers of distinct weights: 49 / 58 ms per pass at 4 / 8 rows, against
// 29 / 31 ms here; a batch-8 fp32 decode step went from 63-68 ms to 38-48). Here each thread walks
// its own contiguous range of output rows, R at a time, prefetching two passes ahead. At one row
// both stream at ~25 GB/s.
//
// Numerics: each (row, output) is one 8-lane accumulator over k in order, a fixed tree, then the
// K % 8 tail in order: the same bits whatever the row count, the thread split or the rows beside
// it. Both the Python `Linear` and the fused decode step (decoder_layers.h) call this, so both
// paths agree; from kMaxRows + 1 to dense_gemm::kMaxRows rows both take dense_gemm.h, above that
// at::linear.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "dense_gemm.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

namespace dense {

constexpr int64_t kMaxRows = 8;
constexpr int64_t kPrefetchPasses = 2;

inline float hsum8(__m256 acc) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// y[m, n] for n in [n0, n1), m < M; R output rows per pass (their loads interleave: more
// memory-level parallelism for one thread).
template <int M, int R>
inline void rows_pass(const float* x, int64_t ldx, const float* w, int64_t K, int64_t n,
                      const float* bias, float* y, int64_t ldy) {
  __m256 acc[R][M];
  for (int r = 0; r < R; ++r)
    for (int m = 0; m < M; ++m) acc[r][m] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= K; k += 8) {
    if ((k & 15) == 0)  // one line per row every 16 floats, kPrefetchPasses passes ahead
      for (int r = 0; r < R; ++r)
        _mm_prefetch(reinterpret_cast<const char*>(w + (n + r + R * kPrefetchPasses) * K + k),
                     _MM_HINT_T0);
    __m256 wv[R];
    for (int r = 0; r < R; ++r) wv[r] = _mm256_loadu_ps(w + (n + r) * K + k);
    for (int m = 0; m < M; ++m) {
      const __m256 xv = _mm256_loadu_ps(x + m * ldx + k);
      for (int r = 0; r < R; ++r) acc[r][m] = _mm256_fmadd_ps(xv, wv[r], acc[r][m]);
    }
  }
  for (int r = 0; r < R; ++r) {
    const float* wr = w + (n + r) * K;
    for (int m = 0; m < M; ++m) {
      float s = hsum8(acc[r][m]);
      for (int64_t kk = k; kk < K; ++kk) s = std::fma(x[m * ldx + kk], wr[kk], s);
      y[m * ldy + n + r] = bias != nullptr ? s + bias[n + r] : s;
    }
  }
}

template <int M>
inline void rows_range(const float* x, int64_t ldx, const float* w, int64_t K, int64_t n0,
                       int64_t n1, const float* bias, float* y, int64_t ldy) {
  constexpr int R = M <= 2 ? 4 : 2;  // accumulators R·M within the register file
  int64_t n = n0;
  for (; n + R <= n1; n += R) rows_pass<M, R>(x, ldx, w, K, n, bias, y, ldy);
  for (; n < n1; ++n) rows_pass<M, 1>(x, ldx, w, K, n, bias, y, ldy);
}

// x [M, K] (rows contiguous), w [N, K] contiguous, bias [N] or undefined; all fp32 on the CPU.
inline torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& bias) {
  const bool has_bias = bias.defined() && bias.numel() > 0;
  const int64_t M = x.dim() == 2 ? x.size(0) : 0;
  const bool ours = M >= 1 && M <= dense_gemm::kMaxRows && x.scalar_type() == torch::kFloat32 &&
                    w.scalar_type() == torch::kFloat32 && x.device().is_cpu() && w.dim() == 2 &&
                    w.is_contiguous() && x.stride(1) == 1 && x.size(1) == w.size(1) &&
                    (!has_bias || (bias.is_contiguous() && bias.scalar_type() == torch::kFloat32));
  if (!ours) return has_bias ? at::linear(x, w, bias) : at::linear(x, w);
  const int64_t N = w.size(0), K = w.size(1), ldx = x.stride(0);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float* bp = has_bias ? bias.data_ptr<float>() : nullptr;
  float* yp = y.data_ptr<float>();
  static_assert(dense_gemm::kMinRows == kMaxRows + 1, "every row count has one kernel");
  if (M > kMaxRows) {
    dense_gemm::gemm(xp, ldx, M, wp, N, K, bp, yp);
    return y;
  }
  // At least ~32k weights per piece of work: a tiny layer (tests' random models) runs on the
  // calling thread instead of paying for a parallel region.
  const int64_t grain = std::max<int64_t>(16, (int64_t{1} << 15) / std::max<int64_t>(K, 1));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    switch (M) {
      case 1: rows_range<1>(xp, ldx, wp, K, n0, n1, bp, yp, N); break;
      case 2: rows_range<2>(xp, ldx, wp, K, n0, n1, bp, yp, N); break;
      case 3: rows_range<3>(xp, ldx, wp, K, n0, n1, bp, yp, N); break;
      case 4: rows_range<4>(xp, ldx, wp, K, n0, n1, bp, yp, N); break;
      case 5: rows_range<5>(xp, ldx, wp, K, n0, n1, bp, yp, N); break;
      case 6: rows_range<6>(xp, ldx, wp, K, n0, n1, bp, yp, N); break;
      case 7: rows_range<7>(xp, ldx, wp, K, n0, n1, bp, yp, N); break;
      default: rows_range<8>(xp, ldx, wp, K, n0, n1, bp, yp, N); break;
    }
  });
  return y;
}

}  // namespace dense
