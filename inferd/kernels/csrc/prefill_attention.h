// Causal attention of a prefill chunk (many query rows of one sequence) on the CPU, head size 64.
//
// Why not ATen's CPU flash attention: its blocks multiply through MKL's sgemm, which on an AVX-512
// EPYC takes a generic path (well under 100 GFLOP/s), which makes attention over a quarter of a
// 512-token prefill of the default model. Here the small products are register-tiled FMA loops on
// cache-resident blocks.
//
// Flash-attention's scheme: one task per (kv head, block of query rows) holds the G query heads
// that share the kv head, pre-scaled, as R <= 64 rows; key blocks of kBK keys are transposed once
// into [D][kBK] and scored against all R rows, an online softmax (running max and sum per row, the
// output rescaled when the max moves) folds each block's weights into the rows' outputs, and the
// rows are divided by their sums at the end. Query i of T sits at key position S - T + i and sees
// keys [0, S - T + i]: a chunk with no earlier context (S == T) or one after a cached prefix.
// Each row's result depends only on its own keys, never on the chunk's length or the thread
// count (blocks are fixed by key position and each row's sums run in key order).
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "layer_ops.h"

namespace prefill_attn {
namespace {

constexpr int kD = 64;      // the head size this kernel takes (the default model's)
constexpr int kMaxRows = 64;  // query rows per task: G heads x (64 / G) positions

#ifdef __AVX512F__
using vec = __m512;
constexpr int kW = 16;
inline vec vload(const float* p) { return _mm512_loadu_ps(p); }
inline void vstore(float* p, vec v) { _mm512_storeu_ps(p, v); }
inline vec vset1(float x) { return _mm512_set1_ps(x); }
inline vec vzero() { return _mm512_setzero_ps(); }
inline vec vfma(vec a, vec b, vec c) { return _mm512_fmadd_ps(a, b, c); }
inline vec vmul(vec a, vec b) { return _mm512_mul_ps(a, b); }
constexpr int kScoreRows = 4;  // rows per score tile: 4 x 4 accumulators
constexpr int kValueRows = 4;  // rows per value tile: 4 x 4 accumulators
#else
using vec = __m256;
constexpr int kW = 8;
inline vec vload(const float* p) { return _mm256_loadu_ps(p); }
inline void vstore(float* p, vec v) { _mm256_storeu_ps(p, v); }
inline vec vset1(float x) { return _mm256_set1_ps(x); }
inline vec vzero() { return _mm256_setzero_ps(); }
inline vec vfma(vec a, vec b, vec c) { return _mm256_fmadd_ps(a, b, c); }
inline vec vmul(vec a, vec b) { return _mm256_mul_ps(a, b); }
constexpr int kScoreRows = 3;  // 3 x 4 accumulators of the 16 ymm registers
constexpr int kValueRows = 1;  // 8 accumulators for one 64-wide row
#endif
constexpr int kBK = 4 * kW;    // keys per block: 4 vectors of scores per row
constexpr int kDV = kD / kW;   // vectors per head row

// s[r][0, kBK) = q[r] . kt[:, j] for RB rows: each transposed key column meets RB broadcasts.
template <int RB>
inline void score_tile(const float* q, const float* kt, float* s) {
  vec acc[RB][4];
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < 4; ++c) acc[r][c] = vzero();
  for (int d = 0; d < kD; ++d) {
    vec kv[4];
    for (int c = 0; c < 4; ++c) kv[c] = vload(kt + d * kBK + c * kW);
    for (int r = 0; r < RB; ++r) {
      const vec qb = vset1(q[r * kD + d]);
      for (int c = 0; c < 4; ++c) acc[r][c] = vfma(qb, kv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < 4; ++c) vstore(s + r * kBK + c * kW, acc[r][c]);
}

// o[r] += sum_j p[r][j] v_j over nk keys, for RB rows (v_j at v + j * v_stride).
template <int RB>
inline void value_tile(const float* p, const float* v, int64_t v_stride, int nk, float* o) {
  vec acc[RB][kDV];
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < kDV; ++c) acc[r][c] = vload(o + r * kD + c * kW);
  for (int j = 0; j < nk; ++j) {
    const float* vj = v + j * v_stride;
    vec vv[kDV];
    for (int c = 0; c < kDV; ++c) vv[c] = vload(vj + c * kW);
    for (int r = 0; r < RB; ++r) {
      const vec pb = vset1(p[r * kBK + j]);
      for (int c = 0; c < kDV; ++c) acc[r][c] = vfma(pb, vv[c], acc[r][c]);
    }
  }
  for (int r = 0; r < RB; ++r)
    for (int c = 0; c < kDV; ++c) vstore(o + r * kD + c * kW, acc[r][c]);
}

template <int RB>
inline void score_rows(const float* q, const float* kt, float* s, int rows) {
  int r = 0;
  for (; r + RB <= rows; r += RB) score_tile<RB>(q + r * kD, kt, s + r * kBK);
  for (; r < rows; ++r) score_tile<1>(q + r * kD, kt, s + r * kBK);
}

template <int RB>
inline void value_rows(const float* p, const float* v, int64_t v_stride, int nk, float* o, int rows) {
  int r = 0;
  for (; r + RB <= rows; r += RB) value_tile<RB>(p + r * kBK, v, v_stride, nk, o + r * kD);
  for (; r < rows; ++r) value_tile<1>(p + r * kBK, v, v_stride, nk, o + r * kD);
}

// Row r's weights for this block: exp(s - new max) over its visible keys, 0 past them; rescales
// the row's output and sum by exp(old max - new max). `nvis` >= 1.
inline void softmax_row(float* s, int nvis, float& m, float& l, float* o) {
  float mx = m;
  for (int j = 0; j < nvis; ++j) mx = std::max(mx, s[j]);
  const float alpha = m == -std::numeric_limits<float>::infinity() ? 0.f : std::exp(m - mx);
  const float sum = layer_ops::exp_shift_sum(s, nvis, mx);
  std::fill(s + nvis, s + kBK, 0.f);
  if (alpha != 1.f) {
    const vec va = vset1(alpha);
    for (int c = 0; c < kDV; ++c) vstore(o + c * kW, vmul(va, vload(o + c * kW)));
  }
  l = l * alpha + sum;
  m = mx;
}

}  // namespace

// q, out: [T, Hq, 64]; k, v: [S, Hkv, 64] with S >= T (fp32; heads of a row contiguous, rows at
// any stride). out may alias nothing else. Query i attends to keys [0, S - T + i].
inline void prefill_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                              torch::Tensor& out, double scale) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3 && out.dim() == 3, "prefill_attention: 3-D tensors");
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && k.scalar_type() == torch::kFloat32 &&
                  v.scalar_type() == torch::kFloat32 && out.scalar_type() == torch::kFloat32,
              "prefill_attention: fp32");
  const int64_t T = q.size(0), hq = q.size(1), S = k.size(0), hkv = k.size(1);
  TORCH_CHECK(q.size(2) == kD && k.size(2) == kD && v.size(2) == kD, "prefill_attention: head size 64");
  TORCH_CHECK(v.size(0) == S && v.size(1) == hkv && out.sizes() == q.sizes(), "prefill_attention: shapes");
  TORCH_CHECK(S >= T && T >= 1 && hkv >= 1 && hq % hkv == 0 && hq / hkv <= kMaxRows,
              "prefill_attention: S >= T >= 1, Hq a multiple of Hkv");
  for (const torch::Tensor* t : {&q, &k, &v, const_cast<const torch::Tensor*>(&out)})
    TORCH_CHECK(t->stride(2) == 1 && t->stride(1) == kD, "prefill_attention: each row's heads contiguous");
  const int64_t G = hq / hkv;
  const int64_t bq = kMaxRows / G;  // query positions per task
  const int64_t nqb = (T + bq - 1) / bq;
  const int64_t offset = S - T;  // query i's key position
  const float* qp = q.data_ptr<float>();
  const float* kp = k.data_ptr<float>();
  const float* vp = v.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t qs = q.stride(0), ks = k.stride(0), vs = v.stride(0), os = out.stride(0);
  const float fscale = static_cast<float>(scale);
  // Tasks in zig-zag order of query blocks (first, last, second, ...): causal blocks grow with
  // position, and parallel_for hands each thread a contiguous range.
  at::parallel_for(0, nqb * hkv, 1, [&](int64_t begin, int64_t end) {
    alignas(64) float qbuf[kMaxRows * kD];
    alignas(64) float obuf[kMaxRows * kD];
    alignas(64) float sbuf[kMaxRows * kBK];
    alignas(64) float kt[kD * kBK];
    float m[kMaxRows], l[kMaxRows];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t z = task / hkv, h = task % hkv;
      const int64_t qb = (z % 2 == 0) ? z / 2 : nqb - 1 - z / 2;
      const int64_t i0 = qb * bq, nq = std::min(bq, T - i0);
      const int rows = static_cast<int>(G * nq);  // row r: head h * G + r / nq, position i0 + r % nq
      for (int r = 0; r < rows; ++r) {
        const float* src = qp + (i0 + r % nq) * qs + (h * G + r / nq) * kD;
        for (int d = 0; d < kD; ++d) qbuf[r * kD + d] = src[d] * fscale;
        std::fill(obuf + r * kD, obuf + (r + 1) * kD, 0.f);
        m[r] = -std::numeric_limits<float>::infinity();
        l[r] = 0.f;
      }
      const int64_t last_key = offset + i0 + nq - 1;  // the block's last row sees up to here
      for (int64_t j0 = 0; j0 <= last_key; j0 += kBK) {
        const int nk = static_cast<int>(std::min<int64_t>(kBK, last_key + 1 - j0));
        for (int j = 0; j < nk; ++j) {
          const float* kr = kp + (j0 + j) * ks + h * kD;
          for (int d = 0; d < kD; ++d) kt[d * kBK + j] = kr[d];
        }
        for (int j = nk; j < kBK; ++j)
          for (int d = 0; d < kD; ++d) kt[d * kBK + j] = 0.f;
        score_rows<kScoreRows>(qbuf, kt, sbuf, rows);
        for (int r = 0; r < rows; ++r) {
          const int64_t pos = offset + i0 + r % nq;
          const int nvis = static_cast<int>(std::min<int64_t>(nk, pos + 1 - j0));
          if (nvis <= 0) {  // keys all after this row: no weight at all
            std::fill(sbuf + r * kBK, sbuf + (r + 1) * kBK, 0.f);
            continue;
          }
          softmax_row(sbuf + r * kBK, nvis, m[r], l[r], obuf + r * kD);
        }
        value_rows<kValueRows>(sbuf, vp + j0 * vs + h * kD, vs, nk, obuf, rows);
      }
      for (int r = 0; r < rows; ++r) {
        float* dst = op + (i0 + r % nq) * os + (h * G + r / nq) * kD;
        const float inv = 1.f / l[r];
        for (int d = 0; d < kD; ++d) dst[d] = obuf[r * kD + d] * inv;
      }
    }
  });
}

}  // namespace prefill_attn
