// fp32 x [M, K] · W [N, K]^T on the CPU, for any number of rows: a decode step's batch, verified
// drafts, a prefill chunk. Both the Python `Linear` and the fused decode step (decoder_layers.h)
// call this, and quant_gemm.h's fp32-activation paths sum their dequantised weights the same way.
//
// Numerics: each (row, output) is a dot product in one fixed order: two 16-lane accumulators over
// the 32-float pieces of k (lanes 0-15 and 16-31), then the 16-float piece left if any, added
// together, the 16 lanes summed by a fixed tree, then the K % 16 tail in order, then the bias. The
// same bits whatever the row count, the thread split, the rows beside it or the build (AVX-512:
// one register per 16 lanes; AVX2: two), so a prompt's tokens do not depend on whether its rows
// ran in a full prefill, after a prefix-cache hit, in a short chunk or beside other requests.
//
// Up to kMaxRows rows (decode) the weights stream once from memory for all of them (row_dots).
// Why not at::linear: at 4-8 rows MKL's sgemm streams the weights well below the memory's read
// rate (a GEMM blocked for reuse, where a decode step's few rows have almost none), and a decode
// step is that stream: the default model's 538 MB of fp32 weights, each read once.
// Each thread walks its own contiguous range of output rows one weight row at a time, so its reads
// are a single sequential stream, which the hardware prefetcher follows at the full read rate.
// The default model's rows are short (576 floats): reading several weight rows side by side would
// make several streams 2.3 KB apart, which the prefetcher follows less well even with software
// prefetches. The rows of x (at most 8 x 6 KB) stay in L1; a weight row is read from memory for the
// first block of x rows and from L1 for the others. At 8 rows the pass is bound by the FMAs rather
// than the stream.
//
// More rows (many_rows) take register-blocked tiles with the same sums: ~90% of oneDNN's packed
// sgemm on a Zen 4 EPYC at 64-512 rows of the default model's shapes.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include "stream_prefetch.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>

namespace dense {

constexpr int64_t kMaxRows = 8;
// How far ahead of the row being read the weights are prefetched (4 KB, into the next rows of the
// thread's range): with 8 rows of x the loop's FMAs leave the stream too few loads in flight, and
// the hardware prefetcher alone does not keep up; at one row the prefetch matters little.
// The hint is the CPU's (stream_prefetch.h). Each weight is read once a step, and a decode step
// streams the whole model (538 MB in fp32) through the caches: fetched as T0 on a CPU with a
// shared victim L3 (AMD EPYC), the stream evicts everything else the step reuses (its own Python,
// the KV cache, a draft head's weights and caches, 7 MB); non-temporal lines bypass that L3, so
// those stay. A pass of several x rows goes into L2 instead (stream_prefetch.h's kL2Rows), so
// its x rows keep L1.
constexpr int64_t kPrefetchFloats = 1024;
// Four rows (a verification of 3 drafts) prefetch twice as far ahead (2,048 floats, 8 KB): with
// the L2 hint each line must arrive from memory while 4 rows of FMAs run over the lines before it;
// 1,024 floats ahead is too late for that. On a Zen 4 EPYC the 4-row pass stops stalling from
// about 1,536 floats ahead and gains nothing further out; 2,048 sits inside that range.
constexpr int64_t kPrefetchFloats4 = 2048;
template <int MB>
constexpr int64_t prefetch_floats() { return MB == 4 ? kPrefetchFloats4 : kPrefetchFloats; }
// The gap `linear` leaves between long rows of x it copies (see there).
constexpr int64_t kRowGapFloats = 128;

// 16 fp32 lanes: one AVX-512 register, or two AVX2 registers computing the same lanes.
#ifdef __AVX512F__
struct V16 {
  __m512 v;
};
inline V16 v16_zero() { return {_mm512_setzero_ps()}; }
inline V16 v16_load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline V16 v16_fma(V16 a, V16 b, V16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline V16 v16_add(V16 a, V16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline __m256 v16_fold(V16 a) {  // lanes i + (i + 8)
  return _mm256_add_ps(_mm512_castps512_ps256(a.v), _mm512_extractf32x8_ps(a.v, 1));
}
// Keeps a loaded value in its register: GCC otherwise folds the load into every FMA that uses it,
// loading the same vector once per use.
inline void v16_pin(V16& a) { asm("" : "+v"(a.v)); }
constexpr int kRowBlock = 8;  // x rows per pass over a weight row: 2 x 8 accumulators of 32
#else
struct V16 {
  __m256 lo, hi;
};
inline V16 v16_zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline V16 v16_load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline V16 v16_fma(V16 a, V16 b, V16 c) {
  return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)};
}
inline V16 v16_add(V16 a, V16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline __m256 v16_fold(V16 a) { return _mm256_add_ps(a.lo, a.hi); }
inline void v16_pin(V16& a) { asm("" : "+v"(a.lo), "+v"(a.hi)); }
constexpr int kRowBlock = 2;  // 2 x 2 accumulators of two registers each: 8 of the 16
#endif

// The 8 lanes of acc summed by a fixed tree: ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)).
inline float hsum8(__m256 acc) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// The 8 lanes of each of a, b, c, d summed by hsum8's tree into out[0..3]: four rows' sums in
// about the shuffles and adds one row's take.
// Why: with 4 rows of x a weight row's 18 chunks cost ~90 cycles of loads and FMAs, and reducing
// its 4 dot products one at a time (each a chain of dependent shuffles and adds) ~40 more; that
// time adds to the step rather than hiding under the weights' stream.
inline void hsum8x4(__m256 a, __m256 b, __m256 c, __m256 d, float* out) {
  // [a0+a4 .. a3+a7, b0+b4 .. b3+b7], the same for c, d
  const __m256 ab =
      _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
  const __m256 cd =
      _mm256_add_ps(_mm256_permute2f128_ps(c, d, 0x20), _mm256_permute2f128_ps(c, d, 0x31));
  // [a(0+2), a(1+3), c(0+2), c(1+3) | b.., d..]
  const __m256 t = _mm256_add_ps(_mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm256_shuffle_ps(ab, cd, _MM_SHUFFLE(3, 2, 3, 2)));
  // [a, c, a, c | b, d, b, d]
  const __m256 r = _mm256_add_ps(_mm256_shuffle_ps(t, t, _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm256_shuffle_ps(t, t, _MM_SHUFFLE(3, 1, 3, 1)));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, r);
  out[0] = lanes[0];
  out[1] = lanes[4];
  out[2] = lanes[1];
  out[3] = lanes[5];
}

// y[m, n] for MB rows of x (m0 .. m0 + MB) and one weight row n.
template <int MB>
inline void row_dots(const float* x, int64_t ldx, const float* wr, int64_t K, float* y,
                     int64_t ldy, float bias, bool has_bias) {
  V16 a0[MB], a1[MB];
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m) a0[m] = a1[m] = v16_zero();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    stream_prefetch::line_rows(wr + k + prefetch_floats<MB>(), MB);
    stream_prefetch::line_rows(wr + k + prefetch_floats<MB>() + 16, MB);
    const V16 w0 = v16_load(wr + k), w1 = v16_load(wr + k + 16);
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) {
      a0[m] = v16_fma(v16_load(x + m * ldx + k), w0, a0[m]);
      a1[m] = v16_fma(v16_load(x + m * ldx + k + 16), w1, a1[m]);
    }
  }
  const bool piece = k + 16 <= K;  // one 16-float piece left: into the first accumulator
  if (piece) {
    const V16 w0 = v16_load(wr + k);
#pragma GCC unroll 8
    for (int m = 0; m < MB; ++m) a0[m] = v16_fma(v16_load(x + m * ldx + k), w0, a0[m]);
    k += 16;
  }
  // Four rows at a time through one reduction tree (fewer: the rest of it on zeros), one row
  // alone through the same tree's first column.
  float sums[MB < 4 ? 4 : MB];
  const auto fold = [&](int m) { return v16_fold(v16_add(a0[m], a1[m])); };
  if constexpr (MB == 1) {
    sums[0] = hsum8(fold(0));
  } else if constexpr (MB == 2) {
    hsum8x4(fold(0), fold(1), _mm256_setzero_ps(), _mm256_setzero_ps(), sums);
  } else {
    static_assert(MB % 4 == 0, "row blocks of 1, 2 or a multiple of 4");
#pragma GCC unroll 2
    for (int g = 0; g < MB / 4; ++g)
      hsum8x4(fold(4 * g), fold(4 * g + 1), fold(4 * g + 2), fold(4 * g + 3), sums + 4 * g);
  }
#pragma GCC unroll 8
  for (int m = 0; m < MB; ++m) {
    float s = sums[m];
    for (int64_t kk = k; kk < K; ++kk) s = std::fma(x[m * ldx + kk], wr[kk], s);
    y[m * ldy] = has_bias ? s + bias : s;
  }
}

// y[:, n0 .. n1) for all M rows of x.
inline void rows_range(const float* x, int64_t ldx, int64_t M, const float* w, int64_t K,
                       int64_t n0, int64_t n1, const float* bias, float* y, int64_t ldy) {
  for (int64_t n = n0; n < n1; ++n) {
    const float* wr = w + n * K;
    const float b = bias != nullptr ? bias[n] : 0.f;
    int64_t m = 0;
    const bool hb = bias != nullptr;
    if constexpr (kRowBlock >= 8)
      for (; m + 8 <= M; m += 8) row_dots<8>(x + m * ldx, ldx, wr, K, y + m * ldy + n, ldy, b, hb);
    if constexpr (kRowBlock >= 4)
      for (; m + 4 <= M; m += 4) row_dots<4>(x + m * ldx, ldx, wr, K, y + m * ldy + n, ldy, b, hb);
    for (; m + 2 <= M; m += 2) row_dots<2>(x + m * ldx, ldx, wr, K, y + m * ldy + n, ldy, b, hb);
    for (; m < M; ++m) row_dots<1>(x + m * ldx, ldx, wr, K, y + m * ldy + n, ldy, b, hb);
  }
}

// ---- Many rows (9 and up: decode batches, verification, prefill) ----
//
// The same sums as row_dots, register-blocked: a tile of MR rows of x by NR weight rows keeps the
// MR x NR (row, output) pairs' two accumulators each in registers, so a 32-float piece of x serves
// NR outputs and one of w serves MR rows (row_dots reloads every x row for every weight row, and
// with many rows those come from L2 or beyond). Each pair is summed exactly as row_dots sums it
// (the same accumulators over the same pieces, the same fold and tree, the same tail), so a row's
// bits do not depend on how many rows the call has: decode, verification and prefill agree.
#ifdef __AVX512F__
constexpr int kTileRows = 4, kTileCols = 3;  // 24 accumulators + 6 weight pieces of 32 registers
#else
constexpr int kTileRows = 2, kTileCols = 1;  // 4 pairs of 2 registers + the weight: of 16
#endif
// Rows of x a pass over the weights serves: 128 rows of the default model's widest input (1,536
// floats) are 768 KB, inside L2; the weights are read once from memory per block of rows.
constexpr int64_t kRowBlockRows = 128;

template <int MR, int NR>
inline void tile_dots(const float* x, int64_t ldx, const float* w, int64_t K, float* y,
                      int64_t ldy, const float* bias) {
  V16 a0[MR][NR], a1[MR][NR];
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) a0[m][r] = a1[m][r] = v16_zero();
  int64_t k = 0;
  // Each half of a 32-float piece in turn: NR weight vectors held while MR x vectors stream past
  // them (24 accumulators + 3 + 1 of AVX-512's 32 registers, so no operand is reloaded).
  const auto half = [&](V16 (&acc)[MR][NR], int64_t kk) {
    V16 wv[NR];
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      wv[r] = v16_load(w + r * K + kk);
      v16_pin(wv[r]);
    }
#pragma GCC unroll 4
    for (int m = 0; m < MR; ++m) {
      V16 xv = v16_load(x + m * ldx + kk);
      v16_pin(xv);
#pragma GCC unroll 4
      for (int r = 0; r < NR; ++r) acc[m][r] = v16_fma(xv, wv[r], acc[m][r]);
    }
  };
  for (; k + 32 <= K; k += 32) {
    half(a0, k);
    half(a1, k + 16);
  }
  if (k + 16 <= K) {  // one 16-float piece left: into the first accumulator, as row_dots
    half(a0, k);
    k += 16;
  }
  // hsum8x4 sums each of its four inputs by hsum8's tree: pairs four at a time, zeros after.
  constexpr int P = MR * NR, P4 = (P + 3) / 4 * 4;
  __m256 folded[P4];
  float sums[P4];
#pragma GCC unroll 12
  for (int p = 0; p < P; ++p) folded[p] = v16_fold(v16_add(a0[p / NR][p % NR], a1[p / NR][p % NR]));
  for (int p = P; p < P4; ++p) folded[p] = _mm256_setzero_ps();
#pragma GCC unroll 3
  for (int g = 0; g < P4 / 4; ++g)
    hsum8x4(folded[4 * g], folded[4 * g + 1], folded[4 * g + 2], folded[4 * g + 3], sums + 4 * g);
#pragma GCC unroll 4
  for (int m = 0; m < MR; ++m)
#pragma GCC unroll 4
    for (int r = 0; r < NR; ++r) {
      float s = sums[m * NR + r];
      for (int64_t kk = k; kk < K; ++kk) s = std::fma(x[m * ldx + kk], w[r * K + kk], s);
      y[m * ldy + r] = bias != nullptr ? s + bias[r] : s;
    }
}

// y[m0 .. m1)[n .. n + NR) through tiles of kTileRows rows, the last fewer.
template <int NR>
inline void tile_column(const float* x, int64_t ldx, int64_t m0, int64_t m1, const float* w,
                        int64_t K, int64_t n, const float* bias, float* y, int64_t ldy) {
  const float* wn = w + n * K;
  const float* bn = bias != nullptr ? bias + n : nullptr;
  int64_t m = m0;
  for (; m + kTileRows <= m1; m += kTileRows)
    tile_dots<kTileRows, NR>(x + m * ldx, ldx, wn, K, y + m * ldy + n, ldy, bn);
  for (; m < m1; ++m) tile_dots<1, NR>(x + m * ldx, ldx, wn, K, y + m * ldy + n, ldy, bn);
}

// x [M, K] (unit column stride, row stride ldx), w [N, K] contiguous, bias [N] or null, y [M, N].
inline void many_rows(const float* x, int64_t ldx, int64_t M, const float* w, int64_t N, int64_t K,
                      const float* bias, float* y) {
  const int64_t grain = std::max<int64_t>(4 * kTileCols, (int64_t{1} << 15) / std::max<int64_t>(K, 1));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    for (int64_t m0 = 0; m0 < M; m0 += kRowBlockRows) {
      const int64_t m1 = std::min(M, m0 + kRowBlockRows);
      int64_t n = n0;
      for (; n + kTileCols <= n1; n += kTileCols)
        tile_column<kTileCols>(x, ldx, m0, m1, w, K, n, bias, y, N);
      for (; n < n1; ++n) tile_column<1>(x, ldx, m0, m1, w, K, n, bias, y, N);
    }
  });
}

// x [M, K] (rows contiguous), w [N, K] contiguous, bias [N] or undefined; all fp32 on the CPU.
inline torch::Tensor linear(const torch::Tensor& x, const torch::Tensor& w, const torch::Tensor& bias) {
  const bool has_bias = bias.defined() && bias.numel() > 0;
  const int64_t M = x.dim() == 2 ? x.size(0) : 0;
  const bool ours = M >= 1 && x.scalar_type() == torch::kFloat32 &&
                    w.scalar_type() == torch::kFloat32 && x.device().is_cpu() && w.dim() == 2 &&
                    w.is_contiguous() && x.stride(1) == 1 && x.size(1) == w.size(1) &&
                    (!has_bias || (bias.is_contiguous() && bias.scalar_type() == torch::kFloat32));
  if (!ours) return has_bias ? at::linear(x, w, bias) : at::linear(x, w);
  const int64_t N = w.size(0), K = w.size(1);
  int64_t ldx = x.stride(0);
  const float* xp = x.data_ptr<float>();
  const float* wp = w.data_ptr<float>();
  const float* bp = has_bias ? bias.data_ptr<float>() : nullptr;
  if (M > kMaxRows) {
    auto y = torch::empty({M, N}, x.options());
    many_rows(xp, ldx, M, wp, N, K, bp, y.data_ptr<float>());
    return y;
  }
  // 3 (or 7) rows run as 4 (8), the last a row of zeros: one pass over each weight row instead
  // of 2 + 1 (4 + 2 + 1), so verifying 2 drafts costs no more than verifying 3. A row's bits do
  // not depend on the rows beside it, so padding changes none.
  const bool pad = kRowBlock >= 4 && M % 4 == 3;
  const int64_t rows = pad ? M + 1 : M;
  // Long rows of x (K >= 1,024, e.g. the default model's 1,536-float down projection input) are
  // copied kRowGapFloats apart: rows exactly K floats apart, all in L1 beside the weight stream,
  // make a few-row pass markedly slower than the same rows set further apart (a cache-set
  // conflict, by its symptoms; short rows such as 576 floats are unaffected).
  const int64_t stride = M >= 2 && K >= 1024 ? K + kRowGapFloats : K;
  std::unique_ptr<float[]> buf;  // the copied rows, 64-byte aligned like a tensor's (vector
  if (pad || stride != K) {      // loads that straddle two cache lines are slower)
    buf.reset(new float[static_cast<size_t>(rows * stride + 16)]);
    float* copy = buf.get() + ((16 - (reinterpret_cast<uintptr_t>(buf.get()) / 4) % 16) % 16);
    for (int64_t m = 0; m < M; ++m) std::copy(xp + m * ldx, xp + m * ldx + K, copy + m * stride);
    for (int64_t m = M; m < rows; ++m) std::fill(copy + m * stride, copy + m * stride + K, 0.f);
    xp = copy;
    ldx = stride;
  }
  auto y = torch::empty({rows, N}, x.options());
  float* yp = y.data_ptr<float>();
  // At least ~32k weights per piece of work: a tiny layer (tests' random models) runs on the
  // calling thread instead of paying for a parallel region.
  const int64_t grain = std::max<int64_t>(16, (int64_t{1} << 15) / std::max<int64_t>(K, 1));
  at::parallel_for(0, N, grain, [&](int64_t n0, int64_t n1) {
    rows_range(xp, ldx, rows, wp, K, n0, n1, bp, yp, N);
  });
  return pad ? y.narrow(0, 0, M) : y;
}

}  // namespace dense
