// Fused kernels for GGUF's 5-bit, 6-bit and K-quant weights (Q5_0, Q5_1, Q4_K, Q5_K, Q6_K), kept
// at their own bits per weight (inferd/quantization/gguf_blocks.py converts the file's blocks).
//
// Every type is an unsigned integer code q per weight (4, 5 or 6 bits) and per 32-weight block b:
//   Q5_0: w = (q - 16) · d_b                 d fp16 per 32
//   Q5_1: w = q · d_b + m_b                  d, m fp16 per 32
//   Q4_K, Q5_K: w = (d · sc_b) · q - dmin · m_b   d, dmin fp16 per 256; sc, m 6-bit per 32
//   Q6_K: w = (d · sc_h) · (q - 32)          d fp16 per 256; sc int8 per 16 (h: the block's halves)
// Each product is exact in fp32 (at most 11 + 7 + 5 = 23 significant bits), so dequantising here
// and in gguf's numpy gives the same bits (one rounding at most, of the min's subtraction or addition).
//
// The row layout (data uint8 [N, row_bytes]; per row, with P = 0, 1 or 2 high-bit planes):
//   [0, K/2)                  nibbles: in block b, byte b·16 + i holds q_i & 15 low and q_{16+i} & 15
//                             high (GGUF Q4_0's order)
//   [K/2, K/2 + K/8·P)        block b's high bits h_i = q_i >> 4 in the 4·P bytes at K/2 + 4·P·b: byte e
//                             holds h_{4P·j + e} in its bits [P·j, P·j + P), j = 0 .. 8/P - 1 (so that
//                             one variable shift per 4P-byte lane puts every h in place)
//   then the sub-block scales, K/16 bytes: Q4_K/Q5_K sc [K/32] then m [K/32] (uint8); Q6_K sc [K/16]
//                             (int8, one per 16 weights)
// scales fp16 [N, K/32] (Q5_x: d) or [N, K/256] (K types: d); mins fp16 the same shape (Q5_1: m;
// Q4_K/Q5_K: dmin), empty for Q5_0 and Q6_K.
//
// Two paths, as quant_gemm.h has for int8 / int4:
// - fp32 activations: each block dequantised to 32 fp32 registers (decode_block), for up to 4 rows
//   in fp32_gemv (each output row's block scales worked out first, 8 blocks per instruction), for
//   more in quant_gemm's strip gemm (BlockDecoder); both sum a row in dense::row_dots' order, so
//   a row's bits do not depend on how many rows share the call.
// - int8 activations (x rounded to int8 per 32-block once per call, int8_dot.h): integer block dots,
//   on the row layout (rows_gemv, AVX2 or AVX512-VNNI in 256-bit registers) and, with AVX512-VNNI,
//   on 16-output tiles packed at load (tiles_gemm). Both compute, for activation row i and output n,
//   the same numbers, whatever else shares the call:
//     acc = 0; for each block b in order: acc = fma(float(I_b), s_b · dx_b, acc)
//                                         [acc = fma(mn_b, sx_b, acc)  for types with mins]
//   where I_b is the block's exact integer dot Σ (q_k - offset) · xq_k (Q6_K: Σ_h sc_h · Σ_{k in h}
//   (q_k - 32) · xq_k over the block's two halves), s_b the block's weight scale as fp32 (Q5_x: d_b;
//   Q4_K/Q5_K: d · sc_b; Q6_K: d), mn_b its min (Q5_1: m_b; Q4_K/Q5_K: -(dmin · m_b)), dx_b the
//   activation's scale and sx_b = dx_b · Σ xq_k (int8_dot.h's QuantizedRows). Integer sums are exact
//   in any order, so a row gets the same bits alone or among any number of rows, in either layout.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "int8_dot.h"
#include "quant_gemm.h"
#include "stream_prefetch.h"

namespace gguf_blocks {

enum Type : int64_t { kQ5_0 = 0, kQ5_1 = 1, kQ4_K = 2, kQ5_K = 3, kQ6_K = 4 };
constexpr int64_t kTypes = 5;

// What each type holds: high-bit planes, blocks of 32 per scale, the code's offset, whether it has
// mins, and its sub-block scales (0: none; 1: uint8 sc and m per 32; 2: int8 sc per 16).
template <int T>
struct Traits;
template <>
struct Traits<kQ5_0> { static constexpr int kPlanes = 1, kGroupBlocks = 1, kOffset = 16, kSub = 0; static constexpr bool kMins = false; };
template <>
struct Traits<kQ5_1> { static constexpr int kPlanes = 1, kGroupBlocks = 1, kOffset = 0, kSub = 0; static constexpr bool kMins = true; };
template <>
struct Traits<kQ4_K> { static constexpr int kPlanes = 0, kGroupBlocks = 8, kOffset = 0, kSub = 1; static constexpr bool kMins = true; };
template <>
struct Traits<kQ5_K> { static constexpr int kPlanes = 1, kGroupBlocks = 8, kOffset = 0, kSub = 1; static constexpr bool kMins = true; };
template <>
struct Traits<kQ6_K> { static constexpr int kPlanes = 2, kGroupBlocks = 8, kOffset = 32, kSub = 2; static constexpr bool kMins = false; };

inline int planes_of(int64_t type) { return type == kQ6_K ? 2 : type == kQ4_K ? 0 : 1; }
inline int64_t group_of(int64_t type) { return type >= kQ4_K ? 256 : 32; }
inline bool has_mins(int64_t type) { return type == kQ5_1 || type == kQ4_K || type == kQ5_K; }
inline int64_t row_bytes(int64_t type, int64_t K) { return K / 2 + K / 8 * planes_of(type) + (type >= kQ4_K ? K / 16 : 0); }

inline float half_to_float(const at::Half* p) {
  uint16_t bits;
  std::memcpy(&bits, p, 2);
  return _cvtsh_ss(bits);
}

// A weight in the row layout, as views of its tensors.
struct RowWeight {
  const uint8_t* data;
  const at::Half* scales;
  const at::Half* mins;  // nullptr without
  int64_t K, nb, row_bytes, groups_per_row;
  inline const uint8_t* row(int64_t n) const { return data + n * row_bytes; }
};

// Block b's 32 codes q (0 .. 2^bits - 1) of row r, in weight order.
template <int T>
inline __m256i codes(const uint8_t* r, int64_t K, int64_t b) {
  constexpr int P = Traits<T>::kPlanes;
  const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(r + b * 16));
  __m256i q = _mm256_and_si256(_mm256_inserti128_si256(_mm256_castsi128_si256(raw), _mm_srli_epi16(raw, 4), 1),
                               _mm256_set1_epi8(0x0F));
  const uint8_t* hp = r + K / 2 + 4 * P * b;
  if constexpr (P == 1) {  // 32-bit lane j: bit j of each byte
    uint32_t h;
    std::memcpy(&h, hp, 4);
    const __m256i v = _mm256_srlv_epi32(_mm256_set1_epi32(static_cast<int32_t>(h)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
    q = _mm256_or_si256(q, _mm256_slli_epi32(_mm256_and_si256(v, _mm256_set1_epi8(0x01)), 4));
  } else if constexpr (P == 2) {  // 64-bit lane j: bits 2j, 2j + 1 of each byte
    int64_t h;
    std::memcpy(&h, hp, 8);
    const __m256i v = _mm256_srlv_epi64(_mm256_set1_epi64x(h), _mm256_setr_epi64x(0, 2, 4, 6));
    q = _mm256_or_si256(q, _mm256_slli_epi64(_mm256_and_si256(v, _mm256_set1_epi8(0x03)), 4));
  }
  return q;
}

// The sub-block scales of row r start here.
template <int T>
inline const uint8_t* sub_scales(const uint8_t* r, int64_t K) {
  return r + K / 2 + K / 8 * Traits<T>::kPlanes;
}

// s_b (the block's fp32 weight scale as the int8 kernels use it) and mn_b (its min; 0 without).
template <int T>
inline float block_scale(const RowWeight& w, int64_t n, const uint8_t* r, int64_t b) {
  const float d = half_to_float(w.scales + n * w.groups_per_row + b / Traits<T>::kGroupBlocks);
  if constexpr (Traits<T>::kSub == 1) return d * static_cast<float>(sub_scales<T>(r, w.K)[b]);
  return d;
}
template <int T>
inline float block_min(const RowWeight& w, int64_t n, const uint8_t* r, int64_t b) {
  if constexpr (!Traits<T>::kMins) return 0.f;
  const float m = half_to_float(w.mins + n * w.groups_per_row + b / Traits<T>::kGroupBlocks);
  if constexpr (Traits<T>::kSub == 1) return -(m * static_cast<float>(sub_scales<T>(r, w.K)[w.nb + b]));
  return m;
}

// Row n's per-block fp32 scales and mins, 8 blocks per instruction where the layout allows: s [nb]
// (Q6_K: [2 nb], one per 16 weights, d · sc) and mn [nb] (types with mins). The same values as
// block_scale / block_min (each product is exact).
template <int T>
inline void row_tables(const RowWeight& w, int64_t n, const uint8_t* r, float* s, float* mn) {
  const int64_t nb = w.nb;
  const at::Half* d = w.scales + n * w.groups_per_row;
  const at::Half* m = Traits<T>::kMins ? w.mins + n * w.groups_per_row : nullptr;
  if constexpr (Traits<T>::kSub == 0) {  // Q5_x: fp16 per block
    int64_t b = 0;
    for (; b + 8 <= nb; b += 8) {
      _mm256_storeu_ps(s + b, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(d + b))));
      if constexpr (Traits<T>::kMins)
        _mm256_storeu_ps(mn + b, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(m + b))));
    }
    for (; b < nb; ++b) {
      s[b] = half_to_float(d + b);
      if constexpr (Traits<T>::kMins) mn[b] = half_to_float(m + b);
    }
  } else {  // K types: super-blocks of 8 blocks
    const uint8_t* sub = sub_scales<T>(r, w.K);
    for (int64_t g = 0; g < nb / 8; ++g) {
      const __m256 dg = _mm256_set1_ps(half_to_float(d + g));
      if constexpr (Traits<T>::kSub == 1) {
        const __m256 sc = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sub + 8 * g))));
        const __m256 mm = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(sub + nb + 8 * g))));
        _mm256_storeu_ps(s + 8 * g, _mm256_mul_ps(dg, sc));
        _mm256_storeu_ps(mn + 8 * g, _mm256_sub_ps(_mm256_setzero_ps(), _mm256_mul_ps(_mm256_set1_ps(half_to_float(m + g)), mm)));
      } else {  // Q6_K: 16 int8 scales a super-block
        for (int h = 0; h < 2; ++h) {
          const __m128i sc8 = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(sub + 16 * g + 8 * h));
          _mm256_storeu_ps(s + 16 * g + 8 * h, _mm256_mul_ps(dg, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc8))));
        }
      }
    }
  }
}

// How many rows ahead the one-row kernels ask for a weight row (int8_dot.h's reason).
constexpr int64_t kPrefetchRows = 16;

// ---- fp32 activations: a block as 32 fp32 weights ---------------------------------------------
// Block b's fp32 scales: the first and second 16 weights' (differing in Q6_K only) and the min (0
// without).
template <int T>
inline void block_scales(const RowWeight& w, int64_t n, const uint8_t* r, int64_t b, float& lo, float& hi, float& mn) {
  if constexpr (Traits<T>::kSub == 2) {  // Q6_K: a scale per 16 weights
    const float d = half_to_float(w.scales + n * w.groups_per_row + b / Traits<T>::kGroupBlocks);
    const int8_t* sc = reinterpret_cast<const int8_t*>(sub_scales<T>(r, w.K)) + 2 * b;
    lo = d * static_cast<float>(sc[0]);
    hi = d * static_cast<float>(sc[1]);
  } else {
    lo = hi = block_scale<T>(w, n, r, b);
  }
  mn = block_min<T>(w, n, r, b);
}

// The 8 bytes at `half8` (0..3) of v, widened to 8 int32.
inline __m256i widen(__m256i v, int half8, bool is_signed) {
  const __m128i lane = half8 < 2 ? _mm256_castsi256_si128(v) : _mm256_extracti128_si256(v, 1);
  const __m128i bytes = (half8 & 1) ? _mm_srli_si128(lane, 8) : lane;
  return is_signed ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes);
}

// Block b of row r as 32 fp32 weights, with gguf's operations: the scale times the code (exact),
// then the min added (one rounding; the products are exact, so an FMA would give the same).
template <int T>
inline void decode_block(const uint8_t* r, int64_t K, int64_t b, __m256 lo, __m256 hi, __m256 mn, __m256 out[4]) {
  __m256i q = codes<T>(r, K, b);
  constexpr bool kSigned = Traits<T>::kOffset != 0;
  if constexpr (kSigned) q = _mm256_sub_epi8(q, _mm256_set1_epi8(Traits<T>::kOffset));
  for (int c = 0; c < 4; ++c) {
    __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(widen(q, c, kSigned)), c < 2 ? lo : hi);
    if constexpr (Traits<T>::kMins) v = _mm256_add_ps(v, mn);
    out[c] = v;
  }
}

// quant_gemm's block decoder (its strip gemm and dequantise-once templates).
template <int T>
struct BlockDecoder {
  RowWeight w;
  inline void load(int64_t n, int64_t b, __m256 out[4]) const {
    const uint8_t* r = w.row(n);
    float lo, hi, mn;
    block_scales<T>(w, n, r, b, lo, hi, mn);
    decode_block<T>(r, w.K, b, _mm256_set1_ps(lo), _mm256_set1_ps(hi), _mm256_set1_ps(mn), out);
  }
};

// M <= 4 (decode) rows of fp32 x against outputs [n0, n1): quant_gemm's gemv_rows (each block
// decoded once into registers, used for every row, summed in dense::row_dots' order), with each
// output row's block scales worked out in a loop of their own first, which takes that scalar work
// off the decode loop. The weights are the same fp32 values BlockDecoder gives (each product is
// exact), so a row's bits are those of quant_gemm::run at any other row count.
template <int T, int MR>
void fp32_gemv(const RowWeight& w, const float* x, float* y, int64_t N, int64_t n0, int64_t n1) {
  const int64_t nb = w.nb, K = w.K;
  constexpr int64_t kPer = Traits<T>::kSub == 2 ? 2 : 1;  // scales per block
  std::vector<float> s(kPer * nb), mn(nb);
  for (int64_t n = n0; n < n1; ++n) {
    const uint8_t* r = w.row(n);
    if (n + kPrefetchRows < n1) int8dot::prefetch_row(w.row(n + kPrefetchRows), w.row_bytes);
    row_tables<T>(w, n, r, s.data(), mn.data());
    dense::V16 a0[MR], a1[MR];
    for (int i = 0; i < MR; ++i) a0[i] = a1[i] = dense::v16_zero();
    for (int64_t b = 0; b < nb; ++b) {
      __m256 v[4];
      decode_block<T>(r, K, b, _mm256_broadcast_ss(&s[kPer * b]), _mm256_broadcast_ss(&s[kPer * b + kPer - 1]),
                      Traits<T>::kMins ? _mm256_broadcast_ss(&mn[b]) : _mm256_setzero_ps(), v);
      dense::V16 lo, hi;
      quant_gemm::block_vectors(v, lo, hi);
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

// ---- int8 activations on the row layout ---------------------------------------------------------
// Lane j of the result: the sum of v[j]'s 8 lanes (integers: exact in any order).
inline __m256i hsum8_i32(const __m256i v[8]) {
  const __m256i t0 = _mm256_hadd_epi32(v[0], v[1]), t1 = _mm256_hadd_epi32(v[2], v[3]);
  const __m256i t2 = _mm256_hadd_epi32(v[4], v[5]), t3 = _mm256_hadd_epi32(v[6], v[7]);
  const __m256i u0 = _mm256_hadd_epi32(t0, t1), u1 = _mm256_hadd_epi32(t2, t3);
  return _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u0, u1, 0x31));
}

// One output's block, prepared once and dotted with every activation row of a chunk: 8 int32 lanes
// whose sum is I_b (without Q5_0's offset, which the caller takes out with the integer Σ xq).
template <int T>
struct PreparedBlock {
  __m256i a, b;  // Q6_K: |q - 32| and q - 32 (for its signs); else a = q
  __m256i sc;    // Q6_K: int16 lanes, the first half's scale ×8 then the second's
  inline __m256i dot(__m256i xq) const {
    if constexpr (T == kQ6_K)
      return _mm256_madd_epi16(_mm256_maddubs_epi16(a, _mm256_sign_epi8(xq, b)), sc);
    else
      return int8dot::dot_u8s8(a, xq);
  }
};

template <int T>
inline PreparedBlock<T> prepare(const RowWeight& w, const uint8_t* r, int64_t b) {
  PreparedBlock<T> p;
  const __m256i q = codes<T>(r, w.K, b);
  if constexpr (T == kQ6_K) {
    p.b = _mm256_sub_epi8(q, _mm256_set1_epi8(32));
    p.a = _mm256_abs_epi8(p.b);
    const int8_t* sc = reinterpret_cast<const int8_t*>(sub_scales<T>(r, w.K)) + 2 * b;
    p.sc = _mm256_inserti128_si256(_mm256_castsi128_si256(_mm_set1_epi16(sc[0])), _mm_set1_epi16(sc[1]), 1);
  } else {
    p.a = q;
  }
  return p;
}

// Activation rows [m0, m0 + MR) against the 8 outputs rows[0..7] (a short last group repeats its
// last row; the caller stores only its own): acc[i] lane j = row m0 + i, output j. sT / mnT hold
// each block's s_b / mn_b for the 8 outputs, [nb][8].
template <int T, int MR>
inline void rows_chunk(const RowWeight& w, const uint8_t* const rows[8], const float* sT, const float* mnT,
                       const int8dot::QuantizedRows& x, int64_t m0, __m256 acc[]) {
  const int64_t nb = w.nb, K = w.K;
  for (int i = 0; i < MR; ++i) acc[i] = _mm256_setzero_ps();
  for (int64_t b = 0; b < nb; ++b) {
    PreparedBlock<T> pb[8];
    for (int j = 0; j < 8; ++j) pb[j] = prepare<T>(w, rows[j], b);
    const __m256 s = _mm256_loadu_ps(sT + b * 8);
    for (int i = 0; i < MR; ++i) {
      const int64_t row = m0 + i;
      const __m256i xb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q.data() + row * K + b * 32));
      __m256i p[8];
      for (int j = 0; j < 8; ++j) p[j] = pb[j].dot(xb);
      __m256i dot = hsum8_i32(p);
      if constexpr (T == kQ5_0) dot = _mm256_sub_epi32(dot, _mm256_set1_epi32(16 * x.qs[row * nb + b]));
      acc[i] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(s, _mm256_set1_ps(x.d[row * nb + b])), acc[i]);
      if constexpr (Traits<T>::kMins)
        acc[i] = _mm256_fmadd_ps(_mm256_loadu_ps(mnT + b * 8), _mm256_set1_ps(x.s[row * nb + b]), acc[i]);
    }
  }
}

// y[M, N] for outputs [n0, n1), 8 at a time.
template <int T>
void rows_gemv(const RowWeight& w, const int8dot::QuantizedRows& x, float* y, int64_t N, int64_t n0, int64_t n1) {
  const int64_t nb = w.nb, M = x.M;
  std::vector<float> sT(8 * nb), mnT(8 * nb), s(2 * nb), mn(nb);
  for (int64_t g = n0; g < n1; g += 8) {
    const int outs = static_cast<int>(std::min<int64_t>(8, n1 - g));
    const uint8_t* rows[8];
    for (int j = 0; j < 8; ++j) {
      const int64_t n = g + std::min(j, outs - 1);
      rows[j] = w.row(n);
      row_tables<T>(w, n, rows[j], s.data(), mn.data());
      for (int64_t b = 0; b < nb; ++b) {
        // Q6_K's per-16 scales are folded into its integer dot; its block scale is d.
        sT[b * 8 + j] = Traits<T>::kSub == 2 ? block_scale<T>(w, n, rows[j], b) : s[b];
        if constexpr (Traits<T>::kMins) mnT[b * 8 + j] = mn[b];
      }
      if (n + kPrefetchRows < n1) int8dot::prefetch_row(w.row(n + kPrefetchRows), w.row_bytes);
    }
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
      const int mr = static_cast<int>(std::min<int64_t>(4, M - m0));
      __m256 acc[4];
      switch (mr) {
        case 4: rows_chunk<T, 4>(w, rows, sT.data(), mnT.data(), x, m0, acc); break;
        case 3: rows_chunk<T, 3>(w, rows, sT.data(), mnT.data(), x, m0, acc); break;
        case 2: rows_chunk<T, 2>(w, rows, sT.data(), mnT.data(), x, m0, acc); break;
        default: rows_chunk<T, 1>(w, rows, sT.data(), mnT.data(), x, m0, acc); break;
      }
      for (int i = 0; i < mr; ++i) {
        alignas(32) float out[8];
        _mm256_store_ps(out, acc[i]);
        for (int j = 0; j < outs; ++j) y[(m0 + i) * N + g + j] = out[j];
      }
    }
  }
}

// ---- int8 activations on packed tiles (AVX512-VNNI) ---------------------------------------------
// The tiles layout (gguf_blocks.py `pack_tiles`): outputs in tiles of 16, one per 32-bit lane, as
// int8_dot.h's int4 tiles. Tile t is tile_bytes = nb · 64 · (4 + P) (+ nb · 32 for K types) bytes,
// in the order the kernel reads them (one stream, which the prefetch runs through into the next tile):
//   K types: for each super-block, first its 8 blocks' sub-block scales, 32 bytes a block (Q4_K/Q5_K
//   16 sc then 16 m, uint8, one per lane; Q6_K 16 sc of the block's first half then 16 of its second,
//   int8), then its blocks' registers; other types: the blocks' registers. Block b's 4 + P registers
//   of 64 bytes:
//     registers 0..3: byte (lane j, e) of register k holds q_{4k+e} & 15 low and q_{16+4k+e} & 15 high
//                     of output 16t + j
//     register 4 + p: 8 uint64 masks; mask k, bit 4j + e = bit 4 + p of q_{4k+e} (k = 0..7) of lane j
// scales / mins fp16 [tiles, K / group, 16].
#ifdef INT8DOT_ZMM
struct Tiles {
  const uint8_t* data;
  const uint16_t* scales;
  const uint16_t* mins;  // nullptr without
  int64_t tiles, nb, tile_bytes, groups;
  bool stream;
};

constexpr int kTileRows = 8;  // activation rows per register block
// How far ahead a streamed weight's bytes are prefetched (int8_dot.h's kTilePrefetchBytes reason).
constexpr int64_t kTilePrefetchBytes = 4096;

inline __m512 tile_halves(const uint16_t* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// The integer offsets the unsigned codes need, per activation row: Q5_0 -16 · Σ xq per block [M, nb];
// Q6_K -32 · Σ xq per 16 weights [M, 2 nb]; none for the others. Ready to broadcast.
inline std::vector<int32_t> code_offsets(int64_t type, const int8dot::QuantizedRows& x) {
  if (type == kQ5_0) {
    std::vector<int32_t> out(x.qs.size());
    for (size_t i = 0; i < out.size(); ++i) out[i] = -16 * x.qs[i];
    return out;
  }
  if (type != kQ6_K) return {};
  std::vector<int32_t> out(x.M * (x.K / 16));
  for (int64_t i = 0; i < x.M * (x.K / 16); ++i) {
    const int8_t* q = x.q.data() + i * 16;
    int32_t s = 0;
    for (int k = 0; k < 16; ++k) s += q[k];
    out[i] = -32 * s;
  }
  return out;
}

template <int T, int MR>
inline void tile_rows(const Tiles& p, int64_t t, const int8dot::QuantizedRows& x, const int32_t* offs,
                      int64_t m0, __m512 acc[]) {
  constexpr int P = Traits<T>::kPlanes, R = 4 + P;
  const int64_t nb = p.nb, K = x.K;
  const uint8_t* base = p.data + t * p.tile_bytes;
  // K types: super-block chunks of 8 · 32 sub-scale bytes, then 8 blocks' registers.
  constexpr int64_t kSubBytes = Traits<T>::kSub ? 256 : 0, kChunk = 8 * R * 64 + kSubBytes;
  const int32_t* xq[MR];
  for (int i = 0; i < MR; ++i) {
    xq[i] = reinterpret_cast<const int32_t*>(x.q.data() + (m0 + i) * K);
    acc[i] = _mm512_setzero_ps();
  }
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    const uint8_t* chunk = base + (b / 8) * kChunk;
    const uint8_t* sub = chunk;  // this block's 32 bytes at sub + (b % 8) · 32
    const __m512i* Wb = reinterpret_cast<const __m512i*>(chunk + kSubBytes + (b % 8) * R * 64);
    if (p.stream) {  // the bytes this block starts on (its chunk's sub-scales with its first), ahead
      const char* at = reinterpret_cast<const char*>(b % 8 ? static_cast<const void*>(Wb) : chunk) + kTilePrefetchBytes;
      const int lines = R + (b % 8 ? 0 : static_cast<int>(kSubBytes / 64));
      for (int l = 0; l < lines; ++l) stream_prefetch::line(at + 64 * l);
    }
    // The block's 16 weight scales (and mins), fp32.
    const int64_t g = t * p.groups + b / Traits<T>::kGroupBlocks;
    __m512 s = tile_halves(p.scales + g * 16), mn = _mm512_setzero_ps();
    __m512i sc_lo, sc_hi;
    if constexpr (Traits<T>::kSub == 1) {
      const __m128i* sb = reinterpret_cast<const __m128i*>(sub + (b % 8) * 32);
      s = _mm512_mul_ps(s, _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(sb))));
      mn = _mm512_sub_ps(_mm512_setzero_ps(),
                         _mm512_mul_ps(tile_halves(p.mins + g * 16), _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(sb + 1)))));
    } else if constexpr (Traits<T>::kMins) {
      mn = tile_halves(p.mins + g * 16);
    }
    if constexpr (Traits<T>::kSub == 2) {
      const __m128i* sb = reinterpret_cast<const __m128i*>(sub + (b % 8) * 32);
      sc_lo = _mm512_cvtepi8_epi32(_mm_loadu_si128(sb));
      sc_hi = _mm512_cvtepi8_epi32(_mm_loadu_si128(sb + 1));
    }
    // Each row's block dot in NC independent chains (a chain of 8 dependent vpdpbusd would bound a
    // few-row call by their latency): chain c takes registers k with chain_of(k) == c; halves (k < 4,
    // k >= 4) never share a chain, for Q6_K's scales. Integer sums: the chains' split changes no bit.
    constexpr int NC = MR <= 2 ? 4 : (MR <= 4 || T == kQ6_K) ? 2 : 1;
    constexpr auto chain_of = [](int k) { return NC == 1 ? 0 : NC == 2 ? (k >> 2) : ((k >> 2) << 1 | (k & 1)); };
    __m512i part[MR][NC];
    for (int i = 0; i < MR; ++i) {
      const int64_t row = m0 + i;
      for (int c = 0; c < NC; ++c) part[i][c] = _mm512_setzero_si512();
      if constexpr (T == kQ5_0) part[i][0] = _mm512_set1_epi32(offs[row * nb + b]);
      if constexpr (T == kQ6_K) {
        part[i][0] = _mm512_set1_epi32(offs[(row * nb + b) * 2]);
        part[i][chain_of(4)] = _mm512_set1_epi32(offs[(row * nb + b) * 2 + 1]);
      }
    }
    const uint64_t* masks = reinterpret_cast<const uint64_t*>(Wb + 4);  // [P][8]
    // Unrolled whole, so that part[][] lives in registers.
#pragma GCC unroll 8
    for (int k = 0; k < 8; ++k) {
      __m512i w = k < 4 ? _mm512_and_si512(_mm512_loadu_si512(Wb + k), low4)
                        : _mm512_and_si512(_mm512_srli_epi16(_mm512_loadu_si512(Wb + k - 4), 4), low4);
      for (int pl = 0; pl < P; ++pl)
        w = _mm512_mask_add_epi8(w, _cvtu64_mask64(masks[pl * 8 + k]), w, _mm512_set1_epi8(static_cast<char>(16 << pl)));
#pragma GCC unroll 8
      for (int i = 0; i < MR; ++i)
        part[i][chain_of(k)] = _mm512_dpbusd_epi32(part[i][chain_of(k)], w, _mm512_set1_epi32(xq[i][b * 8 + k]));
    }
    for (int i = 0; i < MR; ++i) {
      const int64_t row = m0 + i;
      __m512i lo = part[i][0], hi = _mm512_setzero_si512();
      for (int c = 1; c < NC; ++c)
        if (c < chain_of(4) || NC == 1) lo = _mm512_add_epi32(lo, part[i][c]);
        else hi = _mm512_add_epi32(hi, part[i][c]);
      __m512i dot = T == kQ6_K ? _mm512_add_epi32(_mm512_mullo_epi32(lo, sc_lo), _mm512_mullo_epi32(hi, sc_hi))
                               : _mm512_add_epi32(lo, hi);
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(s, _mm512_set1_ps(x.d[row * nb + b])), acc[i]);
      if constexpr (Traits<T>::kMins) acc[i] = _mm512_fmadd_ps(mn, _mm512_set1_ps(x.s[row * nb + b]), acc[i]);
    }
  }
}

template <int T>
void tiles_gemm(const Tiles& p, const int8dot::QuantizedRows& x, const int32_t* offs, float* y, int64_t N,
                int64_t t0, int64_t t1) {
  const int64_t M = x.M;
  for (int64_t t = t0; t < t1; ++t)
    for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {
      const int mr = static_cast<int>(std::min<int64_t>(kTileRows, M - m0));
      __m512 acc[kTileRows];
      switch (mr) {
        case 8: tile_rows<T, 8>(p, t, x, offs, m0, acc); break;
        case 7: tile_rows<T, 7>(p, t, x, offs, m0, acc); break;
        case 6: tile_rows<T, 6>(p, t, x, offs, m0, acc); break;
        case 5: tile_rows<T, 5>(p, t, x, offs, m0, acc); break;
        case 4: tile_rows<T, 4>(p, t, x, offs, m0, acc); break;
        case 3: tile_rows<T, 3>(p, t, x, offs, m0, acc); break;
        case 2: tile_rows<T, 2>(p, t, x, offs, m0, acc); break;
        default: tile_rows<T, 1>(p, t, x, offs, m0, acc); break;
      }
      for (int i = 0; i < mr; ++i) _mm512_storeu_ps(y + (m0 + i) * N + t * 16, acc[i]);
    }
}
#endif

// ---- entry points -------------------------------------------------------------------------------
inline void check_type(int64_t type) {
  TORCH_CHECK(type >= 0 && type < kTypes, "GGUF block type code must be 0..4 (Q5_0, Q5_1, Q4_K, Q5_K, Q6_K), not ", type);
}

inline void check_tables(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.scalar_type() == torch::kFloat16 && t.is_contiguous() && t.device().is_cpu(),
              what, " must be contiguous fp16 CPU tensors");
}

// Calls f(std::integral_constant<int, T>) for the runtime type code.
template <typename F>
inline auto dispatch(int64_t type, F f) {
  switch (type) {
    case kQ5_0: return f(std::integral_constant<int, kQ5_0>{});
    case kQ5_1: return f(std::integral_constant<int, kQ5_1>{});
    case kQ4_K: return f(std::integral_constant<int, kQ4_K>{});
    case kQ5_K: return f(std::integral_constant<int, kQ5_K>{});
    default: return f(std::integral_constant<int, kQ6_K>{});
  }
}

// x [M, K] (fp32) · W^T for W in the row layout → [M, N]. int8_x: activations rounded to int8 per
// 32-block (the integer path); else fp32 ones. An empty x [0, K] returns the dequantised weight
// [N, K] instead: the same bits as gguf's dequantize.
inline torch::Tensor linear(torch::Tensor x, torch::Tensor data, torch::Tensor scales, torch::Tensor mins,
                            int64_t type, bool int8_x) {
  check_type(type);
  quant_gemm::check_x(x);
  const int64_t K = x.size(1), group = group_of(type);
  TORCH_CHECK(K % group == 0, "this GGUF type needs K to be a multiple of ", group, ", got ", K);
  TORCH_CHECK(data.scalar_type() == torch::kUInt8 && data.dim() == 2 && data.is_contiguous() &&
                  data.size(1) == row_bytes(type, K),
              "GGUF block data must be contiguous uint8 [N, ", row_bytes(type, K), "] for K = ", K);
  const int64_t N = data.size(0);
  check_tables(scales, "scales");
  TORCH_CHECK(scales.dim() == 2 && scales.size(0) == N && scales.size(1) == K / group, "scales must be [N, K / ", group, "]");
  if (has_mins(type)) {
    check_tables(mins, "mins");
    TORCH_CHECK(mins.sizes() == scales.sizes(), "mins must match scales");
  }
  const RowWeight w{data.data_ptr<uint8_t>(), scales.data_ptr<at::Half>(),
                    has_mins(type) ? mins.data_ptr<at::Half>() : nullptr, K, K / 32, row_bytes(type, K), K / group};
  if (int8_x && x.size(0) > 0) {
    auto y = torch::empty({x.size(0), N}, x.options());
    const int8dot::QuantizedRows qx = quant_gemm::quantize_x(x);
    float* yp = y.data_ptr<float>();
    dispatch(type, [&](auto T) {
      at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) { rows_gemv<decltype(T)::value>(w, qx, yp, N, n0, n1); });
      return 0;
    });
    return y;
  }
  const int64_t M = x.size(0);
  if (M == 0 || M > quant_gemm::kFewRows)  // dequantised strips and dense tiles, same row order
    return dispatch(type, [&](auto T) { return quant_gemm::run(BlockDecoder<decltype(T)::value>{w}, x, N); });
  auto y = torch::empty({M, N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  dispatch(type, [&](auto T) {
    constexpr int kT = decltype(T)::value;
    at::parallel_for(0, N, 16, [&](int64_t n0, int64_t n1) {
      switch (M) {
        case 1: fp32_gemv<kT, 1>(w, xp, yp, N, n0, n1); break;
        case 2: fp32_gemv<kT, 2>(w, xp, yp, N, n0, n1); break;
        case 3: fp32_gemv<kT, 3>(w, xp, yp, N, n0, n1); break;
        default: fp32_gemv<kT, 4>(w, xp, yp, N, n0, n1); break;
      }
    });
    return 0;
  });
  return y;
}

constexpr bool kHasTiles =
#ifdef INT8DOT_ZMM
    true;
#else
    false;
#endif

inline int64_t tile_bytes(int64_t type, int64_t K) {
  return K / 32 * (64 * (4 + planes_of(type)) + (type >= kQ4_K ? 32 : 0));
}

// x [M, K] · the packed tiles^T → [M, N], int8 activations (the only path tiles have).
inline torch::Tensor tiles_linear(torch::Tensor x, torch::Tensor data, torch::Tensor scales, torch::Tensor mins,
                                  int64_t type, bool stream) {
  TORCH_CHECK(kHasTiles, "packed GGUF block tiles need AVX512-VNNI");
  check_type(type);
  quant_gemm::check_x(x);
  const int64_t K = x.size(1), group = group_of(type);
  TORCH_CHECK(K % group == 0, "this GGUF type needs K to be a multiple of ", group, ", got ", K);
  check_tables(scales, "tile scales");
  TORCH_CHECK(scales.dim() == 3 && scales.size(1) == K / group && scales.size(2) == 16,
              "tile scales must be [N / 16, K / ", group, ", 16]");
  const int64_t tiles = scales.size(0), N = tiles * 16;
  TORCH_CHECK(data.scalar_type() == torch::kUInt8 && data.is_contiguous() && data.numel() == tiles * tile_bytes(type, K),
              "tile data must be contiguous uint8 of ", tiles * tile_bytes(type, K), " bytes");
  if (has_mins(type)) {
    check_tables(mins, "tile mins");
    TORCH_CHECK(mins.sizes() == scales.sizes(), "tile mins must match the tile scales");
  }
  auto y = torch::empty({x.size(0), N}, x.options());
  if (x.size(0) == 0) return y;
#ifdef INT8DOT_ZMM
  const int8dot::QuantizedRows qx = quant_gemm::quantize_x(x);
  const std::vector<int32_t> offs = code_offsets(type, qx);
  const Tiles p{data.data_ptr<uint8_t>(), reinterpret_cast<const uint16_t*>(scales.data_ptr<at::Half>()),
                has_mins(type) ? reinterpret_cast<const uint16_t*>(mins.data_ptr<at::Half>()) : nullptr,
                tiles, K / 32, tile_bytes(type, K), K / group, stream};
  float* yp = y.data_ptr<float>();
  dispatch(type, [&](auto T) {
    at::parallel_for(0, tiles, 1, [&](int64_t t0, int64_t t1) {
      tiles_gemm<decltype(T)::value>(p, qx, offs.data(), yp, N, t0, t1);
    });
    return 0;
  });
#endif
  return y;
}

// decoder::LinearWeights kinds of these weights: kRowsKind + type (row layout) and kTilesKind + type.
constexpr int64_t kRowsKind = 5, kTilesKind = kRowsKind + kTypes;
inline bool owns_kind(int64_t kind) { return kind >= kRowsKind && kind < kTilesKind + kTypes; }

// formats.quantized_matmul's dispatch for a weight of `kind`: tiles take int8 activations only; the
// row layout takes them where on, else the fp32 kernels (one summation order at any row count).
inline torch::Tensor linear_kind(int64_t kind, const torch::Tensor& x, const torch::Tensor& data,
                                 const torch::Tensor& scales, const torch::Tensor& mins, bool int8_x, bool stream) {
  TORCH_CHECK(owns_kind(kind), "not a GGUF block kind: ", kind);
  const torch::Tensor m = mins.defined() ? mins : torch::empty({0}, torch::kFloat16);
  if (kind >= kTilesKind) {
    TORCH_CHECK(int8_x, "packed GGUF block tiles take int8 activations only");
    return tiles_linear(x, data, scales, m, kind - kTilesKind, stream);
  }
  return linear(x, data, scales, m, kind - kRowsKind, int8_x);
}

}  // namespace gguf_blocks
