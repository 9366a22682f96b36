// fp32 x [M, K] · W [N, K]^T for a batch of rows too many for dense_gemv.h and too few for
// MKL to be efficient: a decode step of 9-64 sequences (the server's concurrent requests).
//
// Why not at::linear: with 32 rows, MKL's sgemm runs at under half its own large-matrix rate on
// the default model's layers (each weight matrix read once per step, 538 MB in all). Why not
// dense_gemv.h's dot products (lanes along k): with many rows, every x row comes back from L2 for
// every few weight rows, and L2 bandwidth bounds it (~70 GFLOP/s a core).
//
// Here the lanes run along the rows instead: x is transposed once per call into xt [K][Mp] (Mp:
// M padded to whole vectors, ~70-200 KB, L2-resident), and each weight w[n, k] is broadcast against
// the V vectors of xt[k] — NR weight rows at a time, read once from memory, each cache line of them
// serving 16 consecutive k, the next NR rows prefetched into L2 meanwhile. A tile's NR x V
// accumulators hold y transposed: they go through a buffer in L1 into y's rows.
//
// Numerics: each (row, output) is one lane accumulating w[n, k] * x[m, k] over k in order, from
// zero, then + bias: the same bits whatever the row count, the rows beside it, the thread split
// or the build (AVX-512: 16 lanes, AVX2: 8).
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <memory>

namespace dense_gemm {

constexpr int64_t kMinRows = 9;   // fewer: dense_gemv.h streams the weights for them
constexpr int64_t kMaxRows = 64;  // more (prefill): at::linear's blocked sgemm is the faster

#ifdef __AVX512F__
constexpr int kLanes = 16;
using Vec = __m512;
inline Vec vzero() { return _mm512_setzero_ps(); }
inline Vec vload(const float* p) { return _mm512_load_ps(p); }
inline void vstore(float* p, Vec v) { _mm512_store_ps(p, v); }
inline Vec vbroadcast(const float* p) { return _mm512_set1_ps(*p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm512_fmadd_ps(a, b, c); }
constexpr int kAccumulators = 24;  // of 32 registers: + the V x vectors + one broadcast weight
#else
constexpr int kLanes = 8;
using Vec = __m256;
inline Vec vzero() { return _mm256_setzero_ps(); }
inline Vec vload(const float* p) { return _mm256_load_ps(p); }
inline void vstore(float* p, Vec v) { _mm256_store_ps(p, v); }
inline Vec vbroadcast(const float* p) { return _mm256_broadcast_ss(p); }
inline Vec vfma(Vec a, Vec b, Vec c) { return _mm256_fmadd_ps(a, b, c); }
constexpr int kAccumulators = 12;  // of 16
#endif
static_assert(kMaxRows <= 8 * kLanes, "gemm's switch goes up to 8 vectors");

// y[0 .. M)[n .. n + NR) = x · W[n .. n + NR]^T (+ bias) from xt [K][V * kLanes], 64-byte aligned.
template <int V, int NR>
inline void tile(const float* xt, int64_t M, const float* w, int64_t K, int64_t n, int64_t n_end,
                 const float* bias, float* y, int64_t ldy) {
  constexpr int64_t ld = V * kLanes;
  Vec acc[NR][V];
  for (int r = 0; r < NR; ++r)
    for (int v = 0; v < V; ++v) acc[r][v] = vzero();
  const float* wr[NR];
  for (int r = 0; r < NR; ++r) wr[r] = w + (n + r) * K;
  // The next tile's rows (the NR after these, contiguous) come into L2 while this one computes,
  // a line per k-step; this tile's own, from L2 into L1, two lines ahead.
  const char* next = reinterpret_cast<const char*>(w + (n + NR) * K);
  const int64_t next_lines = std::min<int64_t>(NR * K / 16, std::max<int64_t>(0, (n_end - n - NR) * K / 16));
  for (int64_t k = 0; k < K; ++k) {
    if (k < next_lines) _mm_prefetch(next + k * 64, _MM_HINT_T1);
    if ((k & 15) == 0)
      for (int r = 0; r < NR; ++r) _mm_prefetch(reinterpret_cast<const char*>(wr[r] + k + 32), _MM_HINT_T0);
    Vec xv[V];
#pragma GCC unroll 8
    for (int v = 0; v < V; ++v) xv[v] = vload(xt + k * ld + v * kLanes);
#pragma GCC unroll 32
    for (int r = 0; r < NR; ++r) {
      const Vec wv = vbroadcast(wr[r] + k);
#pragma GCC unroll 8
      for (int v = 0; v < V; ++v) acc[r][v] = vfma(wv, xv[v], acc[r][v]);
    }
  }
  // The accumulators hold y transposed: through a buffer in L1 into y's rows.
  alignas(64) float yt[NR][ld];
  for (int r = 0; r < NR; ++r)
    for (int v = 0; v < V; ++v) vstore(&yt[r][v * kLanes], acc[r][v]);
  for (int64_t m = 0; m < M; ++m)
    for (int r = 0; r < NR; ++r) y[m * ldy + n + r] = bias != nullptr ? yt[r][m] + bias[n + r] : yt[r][m];
}

// Output rows [n0, n1) for V vectors of rows: NR at a time, then one at a time.
template <int V>
inline void rows(const float* xt, int64_t M, const float* w, int64_t K, int64_t n0, int64_t n1,
                 const float* bias, float* y, int64_t ldy) {
  constexpr int NR = std::max(1, kAccumulators / V);
  int64_t n = n0;
  for (; n + NR <= n1; n += NR) tile<V, NR>(xt, M, w, K, n, n1, bias, y, ldy);
  for (; n < n1; ++n) tile<V, 1>(xt, M, w, K, n, n1, bias, y, ldy);
}

// x [M, K] with unit column stride (row stride ldx), w [N, K] contiguous, bias [N] or null;
// y [M, N] contiguous. kMinRows <= M <= kMaxRows.
inline void gemm(const float* x, int64_t ldx, int64_t M, const float* w, int64_t N, int64_t K,
                 const float* bias, float* y) {
  const int64_t V = (M + kLanes - 1) / kLanes, ld = V * kLanes;
  // xt [K][ld], 64-byte aligned, the padding rows zero.
  std::unique_ptr<float[]> buf(new float[static_cast<size_t>(K * ld + 16)]);  // uninitialised
  float* xt = buf.get() + ((16 - (reinterpret_cast<uintptr_t>(buf.get()) / 4) % 16) % 16);
  for (int64_t k = 0; k < K; ++k) {
    float* row = xt + k * ld;
    for (int64_t m = 0; m < M; ++m) row[m] = x[m * ldx + k];
    for (int64_t m = M; m < ld; ++m) row[m] = 0.f;
  }
  // At least ~32k weights per piece of work.
  const int64_t grain = std::max<int64_t>(24, (int64_t{1} << 15) / std::max<int64_t>(K, 1));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    switch (V) {  // AVX-512: up to 4 vectors of 16 rows; AVX2: up to 8 of 8
#define INFERD_VECS(v) \
  case v: rows<v>(xt, M, w, K, n0, n1, bias, y, N); break;
      INFERD_VECS(1)
      INFERD_VECS(2)
      INFERD_VECS(3)
      INFERD_VECS(4)
      INFERD_VECS(5)
      INFERD_VECS(6)
      INFERD_VECS(7)
      default: rows<8>(xt, M, w, K, n0, n1, bias, y, N); break;
#undef INFERD_VECS
    }
  });
}

}  // namespace dense_gemm
