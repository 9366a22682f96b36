// Fused dequantise-dot kernels for block-quantized weights on x86 CPUs with AVX2/FMA/F16C.
//
// y[M, N] = x[M, K] (fp32) · W[N, K]^T where W is stored in 32-weight blocks along K:
//   q8:  int8  [N, K]      w = q * scale[n, g]
//   q4:  uint8 [N, K / 2]  w = q * scale[n, g] + min[n, g]; in each block of 32 the 16 bytes hold
//        weights 0..15 in their low nibbles and 16..31 in their high nibbles (GGUF Q4_0/Q4_1).
//   fp8: uint8 [N, K]      E4M3 (float8_e4m3fn bits), w = e4m3(q) * scale[n, g] (fp32 scales)
// A group (one scale/min) spans `group` weights, a multiple of 32; group == K is per-channel.
// Scales and mins are fp32 or fp16 (GGUF keeps fp16 ones; we keep them as shipped).
//
// Three paths, all threaded over output rows with at::parallel_for:
// - int8 activations (q8 and q4, any M, the default; int8_dot.h): x quantized to int8 per 32-block
//   once per call, integer dot products per block, as llama.cpp does; with AVX512-VNNI on weights
//   packed at load into 16-output tiles (tiles_linear).
// - fp32 activations (fp8; q8 and q4 where int8 activations are off), M <= 4 (decode): each
//   32-weight block is dequantised into registers once and used for all M input rows: the weight
//   bytes are read once per call, which is what decode is bound by.
// - fp32 activations, M > 4 (batched decode, prefill chunks): a strip of output rows is
//   dequantised once into an fp32 buffer (L2-resident), then dense_gemv.h's register-blocked tiles
//   run every input row against it.
// Every path gives a row the same bits whatever the other rows of the call: the fp32 ones sum in
// dense_gemv.h's one order, the integer ones as int8_dot.h says.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <cstdint>
#include <cstring>
#include <vector>

#include "dense_gemv.h"
#include "int8_dot.h"

namespace quant_gemm {
namespace {

inline float load_scale(const float* p) { return *p; }
inline float load_scale(const at::Half* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _cvtsh_ss(bits);
}

inline __m256 i8x8_to_ps(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)); }
inline __m256 u8x8_to_ps(__m128i v) { return _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)); }

// Each format knows how to turn block b of row n into 32 fp32 weights (w[0..3], 8 each).
template <typename S>
struct Q8 {
  const int8_t* q;
  const S* scale;
  int64_t K, groups_per_row, blocks_per_group;
  inline void load(int64_t n, int64_t b, __m256 w[4]) const {
    const int8_t* p = q + n * K + b * 32;
    __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16));
    __m256 s = _mm256_set1_ps(load_scale(scale + n * groups_per_row + b / blocks_per_group));
    w[0] = _mm256_mul_ps(i8x8_to_ps(lo), s);
    w[1] = _mm256_mul_ps(i8x8_to_ps(_mm_srli_si128(lo, 8)), s);
    w[2] = _mm256_mul_ps(i8x8_to_ps(hi), s);
    w[3] = _mm256_mul_ps(i8x8_to_ps(_mm_srli_si128(hi, 8)), s);
  }
};

template <typename S>
struct Q4 {
  const uint8_t* q;
  const S* scale;
  const S* mins;
  int64_t K, groups_per_row, blocks_per_group;
  inline void load(int64_t n, int64_t b, __m256 w[4]) const {
    const uint8_t* p = q + n * (K / 2) + b * 16;
    __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    const __m128i mask = _mm_set1_epi8(0x0F);
    __m128i lo = _mm_and_si128(raw, mask);
    __m128i hi = _mm_and_si128(_mm_srli_epi16(raw, 4), mask);
    int64_t g = n * groups_per_row + b / blocks_per_group;
    __m256 s = _mm256_set1_ps(load_scale(scale + g));
    __m256 m = _mm256_set1_ps(load_scale(mins + g));
    w[0] = _mm256_fmadd_ps(u8x8_to_ps(lo), s, m);
    w[1] = _mm256_fmadd_ps(u8x8_to_ps(_mm_srli_si128(lo, 8)), s, m);
    w[2] = _mm256_fmadd_ps(u8x8_to_ps(hi), s, m);
    w[3] = _mm256_fmadd_ps(u8x8_to_ps(_mm_srli_si128(hi, 8)), s, m);
  }
};

// E4M3 → fp32 without a table: put the 7 magnitude bits where fp32's exponent/mantissa start
// (exponent field = e, so the value is 2^(e-127)·1.m, or the subnormal m/8·2^-126 when e == 0)
// and multiply by 2^120 to rebias 127 → 7. The group's scale folds into that multiply.
struct FP8 {
  const uint8_t* q;
  const float* scale;  // [N, K / group]
  int64_t K, groups_per_row, blocks_per_group;
  static inline __m256 decode8(__m128i bytes, __m256 mul) {
    __m256i v = _mm256_cvtepu8_epi32(bytes);
    __m256i mag = _mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x7F)), 20);
    __m256i sign = _mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi32(0x80)), 24);
    return _mm256_mul_ps(_mm256_castsi256_ps(_mm256_or_si256(mag, sign)), mul);
  }
  inline void load(int64_t n, int64_t b, __m256 w[4]) const {
    const uint8_t* p = q + n * K + b * 32;
    __m128i lo = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    __m128i hi = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 16));
    __m256 mul = _mm256_set1_ps(scale[n * groups_per_row + b / blocks_per_group] * 0x1p120f);
    w[0] = decode8(lo, mul);
    w[1] = decode8(_mm_srli_si128(lo, 8), mul);
    w[2] = decode8(hi, mul);
    w[3] = decode8(_mm_srli_si128(hi, 8), mul);
  }
};

// ---- fp32 activations: every row summed in dense_gemv.h's order ------------------------------
// A row's dot products take the order dense::row_dots takes (two 16-lane accumulators over the
// 32-weight blocks, one fold, one tree), at any row count: the same bits for a row alone, among a
// decode batch or in a prefill chunk, so a prompt's answer does not depend on the prefix cache or
// the batch. Both paths dequantise a block with the format's own `load`, so they multiply the same
// fp32 weights.

// The 32 weights of one block as dense_gemv.h's two 16-lane vectors.
inline void block_vectors(const __m256 w[4], dense::V16& lo, dense::V16& hi) {
#ifdef __AVX512F__
  lo = {_mm512_insertf32x8(_mm512_castps256_ps512(w[0]), w[1], 1)};
  hi = {_mm512_insertf32x8(_mm512_castps256_ps512(w[2]), w[3], 1)};
#else
  lo = {w[0], w[1]};
  hi = {w[2], w[3]};
#endif
}

// M <= kFewRows (decode): each block dequantised once into registers and used for every row, so
// the weight bytes, what decode is bound by, are read once per call.
constexpr int64_t kFewRows = 4;

template <int MR, typename D>
void gemv_rows(const D& d, const float* x, float* y, int64_t K, int64_t N, int64_t n0, int64_t n1) {
  const int64_t nb = K / 32;
  for (int64_t n = n0; n < n1; ++n) {
    dense::V16 a0[MR], a1[MR];
    for (int i = 0; i < MR; ++i) a0[i] = a1[i] = dense::v16_zero();
    for (int64_t b = 0; b < nb; ++b) {
      __m256 w[4];
      d.load(n, b, w);
      dense::V16 lo, hi;
      block_vectors(w, lo, hi);
      for (int i = 0; i < MR; ++i) {
        const float* xp = x + i * K + b * 32;
        a0[i] = dense::v16_fma(dense::v16_load(xp), lo, a0[i]);
        a1[i] = dense::v16_fma(dense::v16_load(xp + 16), hi, a1[i]);
      }
    }
    float sums[4];
    __m256 f[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps()};
    for (int i = 0; i < MR; ++i) f[i] = dense::v16_fold(dense::v16_add(a0[i], a1[i]));
    dense::hsum8x4(f[0], f[1], f[2], f[3], sums);
    for (int i = 0; i < MR; ++i) y[i * N + n] = sums[i];
  }
}

// More rows: a strip of output rows dequantised into an fp32 buffer (L2-resident), then
// dense_gemv.h's register-blocked tiles run rows against it. x is taken kStripRowBlock rows at a
// time, each block against every strip of the thread's range, so a block of x stays in the caches
// while the strips pass it (a 2,048-row prefill chunk of 1,536 floats is 12 MB: streamed from
// memory once per strip otherwise); a strip is dequantised once per row block (~1% of the FMAs),
// never whole (a 262k-row head would be a GB in fp32). Each (row, output) dot is one tile's, so
// the blocking never changes a row's bits.
constexpr int64_t kStrip = 48;  // a multiple of dense::kTileCols
constexpr int64_t kStripRowBlock = 256;

template <typename D>
void dequant_rows(const D& d, int64_t n0, int64_t n1, int64_t K, float* out) {
  for (int64_t n = n0; n < n1; ++n)
    for (int64_t b = 0; b < K / 32; ++b) {
      __m256 w[4];
      d.load(n, b, w);
      for (int j = 0; j < 4; ++j) _mm256_storeu_ps(out + (n - n0) * K + b * 32 + 8 * j, w[j]);
    }
}

template <typename D>
void gemm_strip(const D& d, const float* x, float* y, int64_t m0, int64_t m1, int64_t K, int64_t N,
                int64_t n0, int64_t n1, float* buf) {
  dequant_rows(d, n0, n1, K, buf);
  int64_t n = n0;
  for (; n + dense::kTileCols <= n1; n += dense::kTileCols)
    dense::tile_column<dense::kTileCols>(x, K, m0, m1, buf, K, n - n0, nullptr, y + n0, N);
  for (; n < n1; ++n) dense::tile_column<1>(x, K, m0, m1, buf, K, n - n0, nullptr, y + n0, N);
}

// The whole weight in fp32 [N, K] (an empty x asks for it: formats.dequantize_rows).
template <typename D>
torch::Tensor dequant(const D& d, int64_t N, int64_t K) {
  auto w = torch::empty({N, K}, torch::TensorOptions().dtype(torch::kFloat32));
  float* wp = w.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) { dequant_rows(d, n0, n1, K, wp + n0 * K); });
  return w;
}

template <typename D>
torch::Tensor run(const D& d, const torch::Tensor& x, int64_t N) {
  const int64_t M = x.size(0), K = x.size(1);
  if (M == 0) return dequant(d, N, K);
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  if (M <= kFewRows) {
    // ~16 rows per task keeps the fork/join cost small next to the work.
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
      switch (M) {
        case 1: gemv_rows<1>(d, xp, yp, K, N, n0, n1); break;
        case 2: gemv_rows<2>(d, xp, yp, K, N, n0, n1); break;
        case 3: gemv_rows<3>(d, xp, yp, K, N, n0, n1); break;
        default: gemv_rows<4>(d, xp, yp, K, N, n0, n1); break;
      }
    });
  } else {
    const int64_t strips = (N + kStrip - 1) / kStrip;
    at::parallel_for(0, strips, 1, [&](int64_t s0, int64_t s1) {
      std::vector<float> buf(kStrip * K);
      for (int64_t m0 = 0; m0 < M; m0 += kStripRowBlock)
        for (int64_t s = s0; s < s1; ++s)
          gemm_strip(d, xp, yp, m0, std::min(M, m0 + kStripRowBlock), K, N, s * kStrip,
                     std::min(N, (s + 1) * kStrip), buf.data());
    });
  }
  return y;
}

// x [M, K] rounded to int8 per 32-block, once per call, for the integer kernels.
inline int8dot::QuantizedRows quantize_x(const torch::Tensor& x) {
  return int8dot::quantize_rows(x.data_ptr<float>(), x.size(0), x.size(1),
                                [](int64_t rows, auto fn) { at::parallel_for(0, rows, 16, fn); });
}

// x quantized to int8 once, then integer dot products (int8_dot.h) on a row-layout weight;
// Fmt is int8dot::Q8Fmt/Q4Fmt. (Weights packed at load take tiles_linear below.)
template <typename Fmt>
torch::Tensor run_int8(const Fmt& f, const torch::Tensor& x, int64_t N) {
  auto y = torch::empty({x.size(0), N}, x.options());
  const int8dot::QuantizedRows qx = quantize_x(x);
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) { int8dot::gemv(f, qx, yp, N, n0, n1); });
  return y;
}

void check_x(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous() &&
                  x.device().is_cpu(),
              "x must be a contiguous 2-D fp32 CPU tensor");
  TORCH_CHECK(x.size(1) % 32 == 0, "K must be a multiple of 32, got ", x.size(1));
}

void check_groups(const torch::Tensor& scale, int64_t N, int64_t K, int64_t group) {
  TORCH_CHECK(group % 32 == 0 && K % group == 0, "group must be a multiple of 32 dividing K");
  TORCH_CHECK(scale.is_contiguous() && scale.dim() == 2 && scale.size(0) == N &&
                  scale.size(1) == K / group,
              "scales must be contiguous [N, K / group]");
  TORCH_CHECK(scale.scalar_type() == torch::kFloat32 || scale.scalar_type() == torch::kFloat16,
              "scales must be fp32 or fp16");
}

torch::Tensor q8_linear(torch::Tensor x, torch::Tensor q, torch::Tensor scale, int64_t group,
                        bool int8_x) {
  check_x(x);
  const int64_t N = q.size(0), K = x.size(1);
  TORCH_CHECK(q.scalar_type() == torch::kInt8 && q.is_contiguous() && q.size(1) == K,
              "q8 weight must be contiguous int8 [N, K]");
  check_groups(scale, N, K, group);
  if (int8_x && x.size(0) > 0) {
    if (scale.scalar_type() == torch::kFloat16)
      return run_int8(int8dot::Q8Fmt<at::Half>{q.data_ptr<int8_t>(), scale.data_ptr<at::Half>(),
                                                nullptr, K, K / group, group / 32}, x, N);
    return run_int8(int8dot::Q8Fmt<float>{q.data_ptr<int8_t>(), scale.data_ptr<float>(), nullptr,
                                           K, K / group, group / 32}, x, N);
  }
  if (scale.scalar_type() == torch::kFloat16)
    return run(Q8<at::Half>{q.data_ptr<int8_t>(), scale.data_ptr<at::Half>(), K, K / group,
                            group / 32}, x, N);
  return run(Q8<float>{q.data_ptr<int8_t>(), scale.data_ptr<float>(), K, K / group, group / 32},
             x, N);
}

torch::Tensor q4_linear(torch::Tensor x, torch::Tensor q, torch::Tensor scale, torch::Tensor mins,
                        int64_t group, bool int8_x) {
  check_x(x);
  const int64_t N = q.size(0), K = x.size(1);
  TORCH_CHECK(q.scalar_type() == torch::kUInt8 && q.is_contiguous() && q.size(1) * 2 == K,
              "q4 weight must be contiguous uint8 [N, K / 2]");
  check_groups(scale, N, K, group);
  TORCH_CHECK(mins.sizes() == scale.sizes() && mins.scalar_type() == scale.scalar_type() &&
                  mins.is_contiguous(),
              "mins must match scales");
  if (int8_x && x.size(0) > 0) {
    if (scale.scalar_type() == torch::kFloat16)
      return run_int8(int8dot::Q4Fmt<at::Half>{q.data_ptr<uint8_t>(), scale.data_ptr<at::Half>(),
                                                mins.data_ptr<at::Half>(), K, K / group, group / 32},
                      x, N);
    return run_int8(int8dot::Q4Fmt<float>{q.data_ptr<uint8_t>(), scale.data_ptr<float>(),
                                           mins.data_ptr<float>(), K, K / group, group / 32}, x, N);
  }
  if (scale.scalar_type() == torch::kFloat16)
    return run(Q4<at::Half>{q.data_ptr<uint8_t>(), scale.data_ptr<at::Half>(),
                            mins.data_ptr<at::Half>(), K, K / group, group / 32}, x, N);
  return run(Q4<float>{q.data_ptr<uint8_t>(), scale.data_ptr<float>(), mins.data_ptr<float>(), K,
                       K / group, group / 32}, x, N);
}

torch::Tensor fp8_linear(torch::Tensor x, torch::Tensor q, torch::Tensor scale, int64_t group) {
  check_x(x);
  const int64_t N = q.size(0), K = x.size(1);
  TORCH_CHECK(q.element_size() == 1 && q.is_contiguous() && q.size(1) == K,
              "fp8 weight must be contiguous 1-byte [N, K]");
  check_groups(scale, N, K, group);
  TORCH_CHECK(scale.scalar_type() == torch::kFloat32, "fp8 scales must be fp32");
  return run(FP8{static_cast<const uint8_t*>(q.data_ptr()), scale.data_ptr<float>(), K, K / group,
                 group / 32}, x, N);
}

// ---- packed tiles (int8_dot.h): the layout int8 / int4 weights take at load with AVX512-VNNI ----
constexpr bool kHasTiles =
#ifdef INT8DOT_ZMM
    true;
#else
    false;
#endif

// [w, ws, wm]: the weight q (int8 [N, K] or uint8 [N, K / 2], N a multiple of 16) with its
// scales (and mins) in gemm's layout: w has q's dtype, shape and byte count; ws and wm have the
// scales' dtype (fp16 or fp32), [N / 16, K / 32, 16] (wm empty without mins).
std::vector<torch::Tensor> pack_int8_tiles(torch::Tensor q, torch::Tensor scale, c10::optional<torch::Tensor> mins,
                                           int64_t group) {
  TORCH_CHECK(kHasTiles, "packed int8 tiles need AVX512-VNNI");
  const bool q8 = q.scalar_type() == torch::kInt8;
  TORCH_CHECK(q.dim() == 2 && q.is_contiguous() && q.device().is_cpu() && (q8 || q.scalar_type() == torch::kUInt8),
              "q must be a contiguous CPU int8 [N, K] or uint8 [N, K / 2] tensor");
  const int64_t N = q.size(0), K = q8 ? q.size(1) : 2 * q.size(1), nb = K / 32;
  TORCH_CHECK(N % 16 == 0 && K % 32 == 0, "packed tiles need N % 16 == 0 and K % 32 == 0");
  check_groups(scale, N, K, group);
  const bool has_mins = mins.has_value() && mins->defined();
  TORCH_CHECK(!q8 || !has_mins, "int8 weights have no mins");
  TORCH_CHECK(q8 || has_mins, "int4 weights need their mins");
  if (has_mins)
    TORCH_CHECK(mins->sizes() == scale.sizes() && mins->scalar_type() == scale.scalar_type() && mins->is_contiguous(),
                "mins must match scales");
  auto w = torch::empty_like(q);
  auto st = torch::TensorOptions().dtype(scale.scalar_type());
  auto ws = torch::empty({N / 16, nb, 16}, st);
  auto wm = has_mins ? torch::empty({N / 16, nb, 16}, st) : torch::empty({0}, st);
#ifdef INT8DOT_ZMM
  auto wp = reinterpret_cast<__m512i*>(w.data_ptr());
  auto par = [](int64_t n, auto fn) { at::parallel_for(0, n, 1, fn); };
  const bool half = scale.scalar_type() == torch::kFloat16;
  if (q8 && half)
    int8dot::pack_tiles(int8dot::Q8Fmt<at::Half>{q.data_ptr<int8_t>(), scale.data_ptr<at::Half>(), nullptr, K, K / group, group / 32},
                        N, nb, wp, ws.data_ptr<at::Half>(), static_cast<at::Half*>(nullptr), par);
  else if (q8)
    int8dot::pack_tiles(int8dot::Q8Fmt<float>{q.data_ptr<int8_t>(), scale.data_ptr<float>(), nullptr, K, K / group, group / 32},
                        N, nb, wp, ws.data_ptr<float>(), static_cast<float*>(nullptr), par);
  else if (half)
    int8dot::pack_tiles(int8dot::Q4Fmt<at::Half>{q.data_ptr<uint8_t>(), scale.data_ptr<at::Half>(),
                                                 mins->data_ptr<at::Half>(), K, K / group, group / 32},
                        N, nb, wp, ws.data_ptr<at::Half>(), wm.data_ptr<at::Half>(), par);
  else
    int8dot::pack_tiles(int8dot::Q4Fmt<float>{q.data_ptr<uint8_t>(), scale.data_ptr<float>(),
                                              mins->data_ptr<float>(), K, K / group, group / 32},
                        N, nb, wp, ws.data_ptr<float>(), wm.data_ptr<float>(), par);
#endif
  return {w, ws, wm};
}

// x [M, K] · the packed weight^T → [M, N], with int8 activations (the only path tiles have).
// `stream`: the weight is read once a step (a model's), prefetched past the caches (int8_dot.h).
torch::Tensor tiles_linear(torch::Tensor x, torch::Tensor w, torch::Tensor ws, torch::Tensor wm,
                           bool stream = true) {
  TORCH_CHECK(kHasTiles, "packed int8 tiles need AVX512-VNNI");
  check_x(x);
  const int64_t M = x.size(0), K = x.size(1), nb = K / 32;
  const bool half = ws.scalar_type() == torch::kFloat16;
  TORCH_CHECK((half || ws.scalar_type() == torch::kFloat32) && ws.is_contiguous() && ws.dim() == 3 &&
                  ws.size(1) == nb && ws.size(2) == 16,
              "tile scales must be contiguous fp16 or fp32 [N / 16, K / 32, 16]");
  const int64_t tiles = ws.size(0), N = tiles * 16;
  const bool nibbles = w.scalar_type() == torch::kUInt8;
  TORCH_CHECK(w.is_contiguous() && w.numel() == N * (nibbles ? K / 2 : K) &&
                  (nibbles || w.scalar_type() == torch::kInt8),
              "tile weights must be the packed int8 [N, K] or uint8 [N, K / 2]");
  const bool has_mins = wm.numel() > 0;
  TORCH_CHECK(!has_mins || (wm.sizes() == ws.sizes() && wm.scalar_type() == ws.scalar_type() && wm.is_contiguous()),
              "tile mins must match the tile scales");
  auto y = torch::empty({M, N}, x.options());
  if (M == 0) return y;
#ifdef INT8DOT_ZMM
  const int8dot::QuantizedRows qx = quantize_x(x);
  const int8dot::PackedTiles p{tiles, nb, nibbles, reinterpret_cast<const __m512i*>(w.data_ptr()),
                               ws.data_ptr(), has_mins ? wm.data_ptr() : nullptr, half, stream};
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) { int8dot::gemm(p, qx, yp, N, t0, t1); });
#endif
  return y;
}

// Rows `rows` of a packed weight, dequantised: fp32 [R, K] (a tied embedding's lookup). Output n is
// lane n % 16 of tile n // 16; in a 32-weight block, int8 register r (of 8) holds weights 4r..4r+3
// as bytes ^ 0x80; int4 registers r (of 4) hold weights 4r.. in their low nibbles and 16 + 4r.. in
// their high ones. value = q * scale (+ min): a multiply then an add, as formats._dequantize_tiles
// computes it (a dozen ATen ops and whole 16-row tiles per lookup, ~4 % of a batch-1 decode step).
torch::Tensor tiles_rows(torch::Tensor w, torch::Tensor ws, torch::Tensor wm, torch::Tensor rows) {
  const bool half = ws.scalar_type() == torch::kFloat16;
  TORCH_CHECK((half || ws.scalar_type() == torch::kFloat32) && ws.is_contiguous() && ws.dim() == 3 && ws.size(2) == 16,
              "tile scales must be contiguous fp16 or fp32 [N / 16, K / 32, 16]");
  const int64_t tiles = ws.size(0), nb = ws.size(1), N = tiles * 16, K = nb * 32;
  const bool nibbles = w.scalar_type() == torch::kUInt8;
  TORCH_CHECK(w.is_contiguous() && w.numel() == N * (nibbles ? K / 2 : K) && (nibbles || w.scalar_type() == torch::kInt8),
              "tile weights must be the packed int8 [N, K] or uint8 [N, K / 2]");
  const bool has_mins = wm.numel() > 0;
  TORCH_CHECK(!has_mins || (wm.sizes() == ws.sizes() && wm.scalar_type() == ws.scalar_type() && wm.is_contiguous()),
              "tile mins must match the tile scales");
  TORCH_CHECK(rows.scalar_type() == torch::kLong && rows.dim() == 1 && rows.is_contiguous(), "rows: int64 [R] expected");
  const int64_t R = rows.size(0);
  const int64_t* rp = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < R; ++i) TORCH_CHECK(rp[i] >= 0 && rp[i] < N, "row ", rp[i], " out of range [0, ", N, ")");
  auto out = torch::empty({R, K}, torch::TensorOptions().dtype(torch::kFloat32));
  const uint8_t* base = reinterpret_cast<const uint8_t*>(w.data_ptr());
  const int64_t tile_bytes = nb * (nibbles ? 256 : 512);
  float* op = out.data_ptr<float>();
  const auto scale_at = [&](const torch::Tensor& t, int64_t i) {
    return half ? static_cast<float>(t.data_ptr<at::Half>()[i]) : t.data_ptr<float>()[i];
  };
  at::parallel_for(0, R, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t n = rp[r], tile = n / 16, lane = n % 16;
      const uint8_t* tb = base + tile * tile_bytes;
      float* o = op + r * K;
      for (int64_t b = 0; b < nb; ++b) {
        const int64_t si = (tile * nb + b) * 16 + lane;
        alignas(32) float q[32];
        if (nibbles) {
          for (int reg = 0; reg < 4; ++reg)
            for (int j = 0; j < 4; ++j) {
              const uint8_t byte = tb[((b * 4 + reg) * 16 + lane) * 4 + j];
              q[4 * reg + j] = static_cast<float>(byte & 0x0F);
              q[16 + 4 * reg + j] = static_cast<float>(byte >> 4);
            }
        } else {
          for (int reg = 0; reg < 8; ++reg)
            for (int j = 0; j < 4; ++j)
              q[4 * reg + j] = static_cast<float>(static_cast<int8_t>(tb[((b * 8 + reg) * 16 + lane) * 4 + j] ^ 0x80));
        }
        const __m256 s = _mm256_set1_ps(scale_at(ws, si));
        const __m256 mn = _mm256_set1_ps(has_mins ? scale_at(wm, si) : 0.f);
        for (int c = 0; c < 32; c += 8) {
          __m256 y = _mm256_mul_ps(_mm256_load_ps(q + c), s);  // intrinsics: never contracted to an FMA
          if (has_mins) y = _mm256_add_ps(y, mn);
          _mm256_storeu_ps(o + b * 32 + c, y);
        }
      }
    }
  });
  return out;
}

}  // namespace

}  // namespace quant_gemm
