// Integer dot products for decode (what llama.cpp does): the activation rows are quantized once
// per call to int8 per 32-block (x ≈ d · q, d = max|x| / 127, and d · Σ q per block), and
// each 32-weight block meets them in integer arithmetic — 32 multiply-adds in one or two
// instructions — with one fp32 FMA per block for the two scales:
//   q8 (w = s·qw, qw int8):            Σ_k w_k x_k ≈ s·d · Σ qw_k q_k
//   q4 (w = s·qw + m, qw 0..15):       Σ_k w_k x_k ≈ s·d · Σ qw_k q_k + m · d · Σ q_k
// The min term takes the sum of the *rounded* x (llama.cpp's Q8_1 `s`), not the exact one: then
// the error is Σ w_k δ_k over weights of mean ~0, where the exact sum would leave Σ (w_k - m) δ_k
// over weights all of one sign (on the default model's Q4_1 weights, with every matmul on int8
// activations, the exact sum more than doubles the perplexity cost of int8 activations).
// With AVX512-VNNI (+VL) a block is one `vpdpbusd` (u8 × s8 → int32, no int16 saturation);
// with AVX2 it is `vpmaddubsw` + `vpmaddwd`. maddubs multiplies unsigned by signed, so signed
// int8 weights use the sign trick: |qw| · (q with qw's sign). Its int16 pair sums stay in range:
// q4: 2·15·127; q8: 2·128·127 < 32767.
#pragma once

#include <immintrin.h>

#include "stream_prefetch.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define INT8DOT_ZMM 1  // gemm() below: 16 output rows per 512-bit register
#endif

namespace int8dot {

// The activation rows quantized: q [M, K] int8, d and s [M, K / 32] (scale, d · Σ q of the block),
// qs [M, K / 32] the integer Σ q (gemm's correction for q8 weights).
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> d, s;
  std::vector<int32_t> qs;
  int64_t M, K, nb;
};

inline float hmax(__m256 v) {
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_movehdup_ps(m));
  return _mm_cvtss_f32(m);
}

inline float hadd(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline int32_t hsum_i32(__m256i v) {
  __m128i s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0x4E));
  s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0xB1));
  return _mm_cvtsi128_si32(s);
}

// x * id rounded to nearest-even (the default MXCSR mode; torch.round in the Python reference),
// d = amax / 127 and id = 1 / d computed in fp32 exactly as the reference does. Rows [i0, i1).
inline void quantize_rows_range(const float* x, QuantizedRows& r, int64_t i0, int64_t i1) {
  const int64_t K = r.K;
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int64_t i = i0; i < i1; ++i)
    for (int64_t b = 0; b < r.nb; ++b) {
      const float* p = x + i * K + b * 32;
      __m256 v[4];
      for (int j = 0; j < 4; ++j) v[j] = _mm256_loadu_ps(p + 8 * j);
      __m256 mx = _mm256_max_ps(_mm256_max_ps(_mm256_and_ps(v[0], abs_mask), _mm256_and_ps(v[1], abs_mask)),
                                _mm256_max_ps(_mm256_and_ps(v[2], abs_mask), _mm256_and_ps(v[3], abs_mask)));
      const float d = hmax(mx) / 127.0f;
      const __m256 id = _mm256_set1_ps(d != 0.0f ? 1.0f / d : 0.0f);
      __m256i q[4];
      for (int j = 0; j < 4; ++j) q[j] = _mm256_cvtps_epi32(_mm256_mul_ps(v[j], id));
      // packs interleave the 128-bit lanes; the permute puts the 32 bytes back in order.
      __m256i packed = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
      packed = _mm256_permutevar8x32_epi32(packed, order);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(r.q.data() + i * K + b * 32), packed);
      r.d[i * r.nb + b] = d;
      const __m256i qsum = _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3]));
      const int32_t sum = hsum_i32(qsum);
      r.qs[i * r.nb + b] = sum;
      r.s[i * r.nb + b] = d * static_cast<float>(sum);
    }
}

// Every row quantized; `parallel(n, fn)` runs fn(i0, i1) over row ranges (at::parallel_for in
// the extension: a 512-row prefill chunk is ~0.3 ms of rounding on one core).
template <typename Parallel>
inline QuantizedRows quantize_rows(const float* x, int64_t M, int64_t K, Parallel parallel) {
  QuantizedRows r{std::vector<int8_t>(M * K), std::vector<float>(M * (K / 32)),
                  std::vector<float>(M * (K / 32)), std::vector<int32_t>(M * (K / 32)), M, K, K / 32};
  parallel(M, [&](int64_t i0, int64_t i1) { quantize_rows_range(x, r, i0, i1); });
  return r;
}

// Σ over 4-byte groups of u8 · s8 into 8 int32 lanes.
inline __m256i dot_u8s8(__m256i u, __m256i s) {
#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
  return _mm256_dpbusd_epi32(_mm256_setzero_si256(), u, s);
#else
  return _mm256_madd_epi16(_mm256_maddubs_epi16(u, s), _mm256_set1_epi16(1));
#endif
}

// A 32-weight block of each format, prepared once and dotted with every activation row.
struct Q8Block {
  __m256i mag, w;  // |qw| as unsigned, and qw for its signs
  inline __m256i dot(__m256i xq) const { return dot_u8s8(mag, _mm256_sign_epi8(xq, w)); }
};
struct Q4Block {
  __m256i w;  // 0..15, already unsigned
  inline __m256i dot(__m256i xq) const { return dot_u8s8(w, xq); }
};

inline Q8Block load_q8(const int8_t* p) {
  __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return {_mm256_abs_epi8(w), w};
}
// GGUF nibble order: the 16 bytes hold weights 0..15 low and 16..31 high.
inline Q4Block load_q4(const uint8_t* p) {
  __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  __m256i both = _mm256_inserti128_si256(_mm256_castsi128_si256(raw), _mm_srli_epi16(raw, 4), 1);
  return {_mm256_and_si256(both, _mm256_set1_epi8(0x0F))};
}

// out[b] = the per-group values of output row n expanded to one per 32-block.
template <typename S>
inline void expand_blocks(const S* v, int64_t n, int64_t groups_per_row, int64_t blocks_per_group,
                          int64_t nb, float* out) {
  const S* row = v + n * groups_per_row;
  int64_t b = 0;
  if constexpr (sizeof(S) == 2) {
    if (blocks_per_group == 1)  // GGUF's fp16 per block: 8 at a time
      for (; b + 8 <= nb; b += 8)
        _mm256_storeu_ps(out + b, _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + b))));
  }
  for (int64_t g = b / blocks_per_group; b < nb; ++g) {  // no division per block: it costs ~10 cycles
    const float v = static_cast<float>(row[g]);
    for (int64_t e = std::min(nb, (g + 1) * blocks_per_group); b < e; ++b) out[b] = v;
  }
}

// int4's min term of (row i, output n): Σ_b min[n][b] · s[i][b], 8 lanes over the blocks (lane l:
// blocks l, l + 8, ... while a whole 8 remains, a chain of FMAs), summed in hadd's order, then the
// remaining blocks one FMA each. gemm runs the same operations with lanes over activation rows.
inline float dot_f32(const float* a, const float* b, int64_t n) {
  __m256 acc = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= n; k += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + k), _mm256_loadu_ps(b + k), acc);
  float s = hadd(acc);
  for (; k < n; ++k) s = std::fma(a[k], b[k], s);
  return s;
}

// A single core's hardware prefetcher alone streams the 28 MB Q8_0 head at about a quarter of an
// fp32 GEMV's read rate: the rows a few ahead are asked for explicitly.
constexpr int64_t kPrefetchRows = 16;
inline void prefetch_row(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(c + off, _MM_HINT_T0);
}

#ifdef INT8DOT_ZMM
// Lane j of the result: the sum of v[j]'s 8 lanes. Integers, so exact in any order.
inline __m256i hsum8_i32(const __m256i v[8]) {
  const __m256i t0 = _mm256_hadd_epi32(v[0], v[1]), t1 = _mm256_hadd_epi32(v[2], v[3]);
  const __m256i t2 = _mm256_hadd_epi32(v[4], v[5]), t3 = _mm256_hadd_epi32(v[6], v[7]);
  const __m256i u0 = _mm256_hadd_epi32(t0, t1), u1 = _mm256_hadd_epi32(t2, t3);
  return _mm256_add_epi32(_mm256_permute2x128_si256(u0, u1, 0x20), _mm256_permute2x128_si256(u0, u1, 0x31));
}

// The numbers every kernel here computes for (activation row i, output n), whatever else shares
// the call: acc = 0, then for each block b in order acc = fma(float(I_b), s_b · d_b, acc), where
// I_b = Σ_k qw_k q_k is the block's integer dot (exact: |I_b| <= 32 · 128 · 127), s_b the weight
// scale and d_b the activation scale; then y = acc + the min term (dot_f32, int4 only). The
// integer sum is exact, so gemv (8 outputs' sums folded by hadds) and gemm (VNNI tiles) may form
// it however suits them; the fp32 operations that follow are the same ones in the same order.
// One conversion and one FMA per block, where converting each 4-product lane cost 8 of each.

// y[M, N] for output rows [n0, n1), 8 at a time (a short last group repeats its last row and
// stores only its own), on a weight still in the row layout (one the engine did not pack: an
// output count that is not a multiple of 16, or a direct kernel call). Fmt has `scales`, `mins`
// (nullptr for q8), the group layout and `row(n)` / `block(row, b)`.
template <typename Fmt>
void gemv(const Fmt& f, const QuantizedRows& x, float* y, int64_t N, int64_t n0, int64_t n1) {
  const int64_t M = x.M, nb = x.nb, K = x.K;
  std::vector<float> ws(8 * nb), wsT(8 * nb), wm(8 * nb);
  for (int64_t g = n0; g < n1; g += 8) {
    const int outs = static_cast<int>(std::min<int64_t>(8, n1 - g));
    typename Fmt::Row w_row[8];  // pointers hoisted: the block loop stays lean
    for (int j = 0; j < 8; ++j) {
      const int64_t n = g + std::min(j, outs - 1);
      w_row[j] = f.row(n);
      expand_blocks(f.scales, n, f.groups_per_row, f.blocks_per_group, nb, ws.data() + j * nb);
      if (f.mins) expand_blocks(f.mins, n, f.groups_per_row, f.blocks_per_group, nb, wm.data() + j * nb);
      if (n + kPrefetchRows < n1) prefetch_row(f.row(n + kPrefetchRows), f.row_bytes());
    }
    for (int64_t b = 0; b < nb; ++b)
      for (int j = 0; j < 8; ++j) wsT[b * 8 + j] = ws[j * nb + b];
    for (int64_t i = 0; i < M; ++i) {
      const int8_t* xq = x.q.data() + i * K;
      const float* d = x.d.data() + i * nb;
      __m256 acc = _mm256_setzero_ps();
      for (int64_t b = 0; b < nb; ++b) {
        const __m256i xb = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + b * 32));
        __m256i p[8];
        for (int j = 0; j < 8; ++j) p[j] = Fmt::block(w_row[j], b).dot(xb);
        const __m256 dot = _mm256_cvtepi32_ps(hsum8_i32(p));
        acc = _mm256_fmadd_ps(dot, _mm256_mul_ps(_mm256_loadu_ps(wsT.data() + b * 8), _mm256_set1_ps(d[b])), acc);
      }
      alignas(32) float out[8];
      _mm256_store_ps(out, acc);
      for (int j = 0; j < outs; ++j) {
        float v = out[j];
        if (f.mins) v += dot_f32(wm.data() + j * nb, x.s.data() + i * nb, nb);
        y[i * N + g + j] = v;
      }
    }
  }
}
#else
// Without AVX512-VNNI (the AVX2 build: gemv is its only int8 kernel) the numbers are the lane-wise
// ones llama.cpp-style kernels use: each block's 8 four-product lanes converted, scaled and
// FMA'd into 8 lanes per row, reduced by hadd at the end. Summing each block exactly first (the
// tiles' numbers, above) costs ~35% more instructions here, where no tile path amortises it.
// Rows [m0, m0 + MR) of x against output row n: scale[b] = weight scale · activation scale of
// block b for row m0 (row i's at scale + i * nb); two accumulators per row hide the FMA latency.
template <int MR, typename Fmt>
inline void dot_rows(const typename Fmt::Row w_row, const QuantizedRows& x, int64_t m0,
                     const float* scale, float out[MR]) {
  const int64_t nb = x.nb, K = x.K;
  const int8_t* xq = x.q.data() + m0 * K;
  __m256 acc[MR][2];
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm256_setzero_ps();
  // Blocks in pairs with constant accumulator indices (a runtime index would keep acc in memory).
  auto step = [&](int64_t b, int a) __attribute__((always_inline)) {
    const auto w = Fmt::block(w_row, b);
    for (int i = 0; i < MR; ++i) {
      __m256i q = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(xq + i * K + b * 32));
      __m256 p = _mm256_cvtepi32_ps(w.dot(q));
      acc[i][a] = _mm256_fmadd_ps(p, _mm256_broadcast_ss(scale + i * nb + b), acc[i][a]);
    }
  };
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    step(b, 0);
    step(b + 1, 1);
  }
  if (b < nb) step(b, 0);
  for (int i = 0; i < MR; ++i) out[i] = hadd(_mm256_add_ps(acc[i][0], acc[i][1]));
}

// y[M, N] for output rows [n0, n1): Fmt has `scales`, `mins` (nullptr for q8), the group layout
// and `row(n)` / `block(row, b)`. Every row of x meets an output row while its weights are in L1.
template <typename Fmt>
void gemv(const Fmt& f, const QuantizedRows& x, float* y, int64_t N, int64_t n0, int64_t n1) {
  const int64_t M = x.M, nb = x.nb;
  std::vector<float> ws(nb), wm(nb), scale(4 * nb);
  for (int64_t n = n0; n < n1; ++n) {
    expand_blocks(f.scales, n, f.groups_per_row, f.blocks_per_group, nb, ws.data());
    if (f.mins) expand_blocks(f.mins, n, f.groups_per_row, f.blocks_per_group, nb, wm.data());
    const typename Fmt::Row w_row = f.row(n);  // pointers hoisted: the block loop stays lean
    if (n + kPrefetchRows < n1) prefetch_row(f.row(n + kPrefetchRows), f.row_bytes());
    for (int64_t m0 = 0; m0 < M; m0 += 4) {
      const int mr = static_cast<int>(std::min<int64_t>(4, M - m0));
      for (int i = 0; i < mr; ++i) {
        const float* d = x.d.data() + (m0 + i) * nb;
        int64_t b = 0;
        for (; b + 8 <= nb; b += 8)
          _mm256_storeu_ps(scale.data() + i * nb + b,
                           _mm256_mul_ps(_mm256_loadu_ps(ws.data() + b), _mm256_loadu_ps(d + b)));
        for (; b < nb; ++b) scale[i * nb + b] = ws[b] * d[b];
      }
      float out[4];
      switch (mr) {
        case 4: dot_rows<4, Fmt>(w_row, x, m0, scale.data(), out); break;
        case 3: dot_rows<3, Fmt>(w_row, x, m0, scale.data(), out); break;
        case 2: dot_rows<2, Fmt>(w_row, x, m0, scale.data(), out); break;
        default: dot_rows<1, Fmt>(w_row, x, m0, scale.data(), out); break;
      }
      for (int i = 0; i < mr; ++i) {
        if (f.mins) out[i] += dot_f32(wm.data(), x.s.data() + (m0 + i) * nb, nb);
        y[(m0 + i) * N + n] = out[i];
      }
    }
  }
}
#endif

template <typename S>
struct Q8Fmt {
  const int8_t* q;
  const S* scales;
  const S* mins;  // always nullptr
  int64_t K, groups_per_row, blocks_per_group;
  using Row = const int8_t*;
  inline Row row(int64_t n) const { return q + n * K; }
  inline int64_t row_bytes() const { return K; }
  static inline Q8Block block(Row r, int64_t b) { return load_q8(r + b * 32); }
  static constexpr bool kSigned = true;
  // Block b's 32 weights as unsigned bytes, qw + 128 (vpdpbusd's unsigned operand; gemm takes
  // 128 · Σ q back out).
  static inline __m256i unsigned_block(Row r, int64_t b) {
    return _mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r + b * 32)),
                            _mm256_set1_epi8(static_cast<char>(0x80)));
  }
};

template <typename S>
struct Q4Fmt {
  const uint8_t* q;
  const S* scales;
  const S* mins;
  int64_t K, groups_per_row, blocks_per_group;
  using Row = const uint8_t*;
  inline Row row(int64_t n) const { return q + n * (K / 2); }
  inline int64_t row_bytes() const { return K / 2; }
  static inline Q4Block block(Row r, int64_t b) { return load_q4(r + b * 16); }
  static constexpr bool kSigned = false;
  static inline __m256i unsigned_block(Row r, int64_t b) { return load_q4(r + b * 16).w; }
};

#ifdef INT8DOT_ZMM
// ---- gemm: tiles of 16 outputs, AVX512-VNNI ------------------------------------------------
// A weight is rearranged once, at load (pack_tiles; the packed form replaces the row layout),
// so that register k of block b of a tile holds weights 4k..4k+3 of each of its 16 outputs, one
// per 32-bit lane. An activation row's 4 bytes, broadcast, then meet all 16 outputs in one
// vpdpbusd; 8 of them sum the block in int32, and one convert, multiply and FMA finish it: 11
// instructions per row per 512 multiply-adds, with the tile's registers read straight from
// memory. q8 weights enter as qw + 128 (unsigned) and the accumulator starts at -128 · Σ q; q4
// keeps two registers' nibbles in one byte (low: k, high: k + 4), so the packed bytes are as many
// as the row layout's. Scales (and int4 mins) are per block, [tile][block][16], in the type the
// weight came with (GGUF's fp16, or fp32).
constexpr int kTileN = 16;    // output rows per tile: one per lane
constexpr int kTileRows = 8;  // activation rows per register block

// A packed weight, as views of the tensors that hold it.
struct PackedTiles {
  int64_t tiles, nb;
  bool nibbles;          // q4: 4 registers per block, else 8 (q8)
  const __m512i* w;      // [tile][block][4 or 8]
  const void* ws;        // [tile][block][16]: each output's weight scale, per block
  const void* wm;        // the same for the mins; nullptr without
  bool half;             // ws / wm hold fp16 (as the file shipped them), else fp32
  bool stream = true;    // read once a step: prefetched past the caches (kTilePrefetchBytes)
};

// The 16 scales (or mins) at [tile][block] of a packed weight, as fp32 (fp16 converts exactly).
inline __m512 tile_scales(const void* base, int64_t at, bool half) {
  if (half) return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + at)));
  return _mm512_loadu_ps(static_cast<const float*>(base) + at);
}

// 8x8 transpose of 32-bit elements within each 256-bit half of z[0..7].
inline void transpose8_halves(__m512i z[8]) {
  __m512i t[8], u[8];
  for (int j = 0; j < 4; ++j) {
    t[2 * j] = _mm512_unpacklo_epi32(z[2 * j], z[2 * j + 1]);
    t[2 * j + 1] = _mm512_unpackhi_epi32(z[2 * j], z[2 * j + 1]);
  }
  for (int h = 0; h < 2; ++h) {  // rows 0-3, then rows 4-7
    const __m512i* a = t + 4 * h;
    u[4 * h + 0] = _mm512_unpacklo_epi64(a[0], a[2]);  // elements 0 (128-bit lane 0), 4 (lane 1)
    u[4 * h + 1] = _mm512_unpackhi_epi64(a[0], a[2]);  // 1, 5
    u[4 * h + 2] = _mm512_unpacklo_epi64(a[1], a[3]);  // 2, 6
    u[4 * h + 3] = _mm512_unpackhi_epi64(a[1], a[3]);  // 3, 7
  }
  const __m512i lo = _mm512_setr_epi64(0, 1, 8, 9, 4, 5, 12, 13);
  const __m512i hi = _mm512_setr_epi64(2, 3, 10, 11, 6, 7, 14, 15);
  for (int e = 0; e < 4; ++e) {
    z[e] = _mm512_permutex2var_epi64(u[e], lo, u[4 + e]);
    z[e + 4] = _mm512_permutex2var_epi64(u[e], hi, u[4 + e]);
  }
}

// Outputs [0, N) (N a multiple of 16) of the weight into gemm's layout: w [tiles][nb][4 or 8]
// registers, ws and wm (nullptr without mins) [tiles][nb][16] in the scales' own type S (values
// copied, never rounded); `parallel(n, fn)` over tiles.
template <typename Fmt, typename S, typename Parallel>
void pack_tiles(const Fmt& f, int64_t N, int64_t nb, __m512i* w, S* ws, S* wm, Parallel parallel) {
  const int regs = Fmt::kSigned ? 8 : 4;
  parallel(N / kTileN, [&](int64_t t0, int64_t t1) {
    std::vector<float> scales(kTileN * nb), mins(kTileN * nb);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * kTileN;
      for (int j = 0; j < kTileN; ++j) {
        expand_blocks(f.scales, n0 + j, f.groups_per_row, f.blocks_per_group, nb, scales.data() + j * nb);
        if (wm) expand_blocks(f.mins, n0 + j, f.groups_per_row, f.blocks_per_group, nb, mins.data() + j * nb);
      }
      for (int64_t b = 0; b < nb; ++b) {
        for (int j = 0; j < kTileN; ++j) {
          ws[(t * nb + b) * kTileN + j] = static_cast<S>(scales[j * nb + b]);
          if (wm) wm[(t * nb + b) * kTileN + j] = static_cast<S>(mins[j * nb + b]);
        }
        __m512i z[8];
        for (int j = 0; j < 8; ++j)
          z[j] = _mm512_inserti64x4(_mm512_castsi256_si512(Fmt::unsigned_block(f.row(n0 + j), b)),
                                    Fmt::unsigned_block(f.row(n0 + 8 + j), b), 1);
        transpose8_halves(z);
        __m512i* out = w + (t * nb + b) * regs;
        if (!Fmt::kSigned)
          for (int k = 0; k < 4; ++k) _mm512_storeu_si512(out + k, _mm512_or_si512(z[k], _mm512_slli_epi16(z[k + 4], 4)));
        else
          for (int k = 0; k < 8; ++k) _mm512_storeu_si512(out + k, z[k]);
      }
    }
  });
}

// How far ahead of the block being read a streamed weight's tiles are prefetched, non-temporally:
// a decode step streams every weight once (the default model's ~100 MB as int4 tiles), and
// through the caches as usual the stream evicts everything else from the shared L3 each step
// (the engine's Python, the KV cache, the activations). With the hint it bypasses AMD's victim
// L3, which speeds up both batch-1 decode and batched offline throughput (the hint is the CPU's:
// stream_prefetch.h). A weight that is not streamed (`PackedTiles::stream`: a draft head's, 7 MB
// read k times a step) keeps the plain loads, and so its place in L3.
constexpr int64_t kTilePrefetchBytes = 4096;

// Activation rows [m0, m0 + MR) against tile t: acc[i] lane j = row m0 + i, output 16t + j,
// before the min term (the numbers above gemv).
template <int MR, bool Nibbles, bool Signed>
inline void tile_rows(const PackedTiles& p, int64_t t, const QuantizedRows& x, int64_t m0, __m512 acc[]) {
  const int64_t nb = x.nb, K = x.K;
  constexpr int kRegs = Nibbles ? 4 : 8;
  const __m512i* W = p.w + t * nb * kRegs;
  const int64_t ws_at = t * nb * kTileN;
  const int32_t* xq[MR];
  for (int i = 0; i < MR; ++i) {
    xq[i] = reinterpret_cast<const int32_t*>(x.q.data() + (m0 + i) * K);
    acc[i] = _mm512_setzero_ps();
  }
  const __m512i low4 = _mm512_set1_epi8(0x0F);
  for (int64_t b = 0; b < nb; ++b) {
    // The tiles of a thread's range lie end to end: the prefetch runs on into the next tile.
    if (p.stream)
      for (int l = 0; l < kRegs; ++l)
        stream_prefetch::line(reinterpret_cast<const char*>(W + b * kRegs + l) + kTilePrefetchBytes);
    __m512i dot[MR];
    for (int i = 0; i < MR; ++i)
      dot[i] = Signed ? _mm512_set1_epi32(-128 * x.qs[(m0 + i) * nb + b]) : _mm512_setzero_si512();
    for (int k = 0; k < 8; ++k) {
      __m512i w;
      if constexpr (Nibbles)
        w = k < 4 ? _mm512_and_si512(_mm512_loadu_si512(W + b * 4 + k), low4)
                  : _mm512_and_si512(_mm512_srli_epi16(_mm512_loadu_si512(W + b * 4 + k - 4), 4), low4);
      else
        w = _mm512_loadu_si512(W + b * 8 + k);
      for (int i = 0; i < MR; ++i) dot[i] = _mm512_dpbusd_epi32(dot[i], w, _mm512_set1_epi32(xq[i][b * 8 + k]));
    }
    const __m512 ws = tile_scales(p.ws, ws_at + b * kTileN, p.half);
    for (int i = 0; i < MR; ++i)
      acc[i] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[i]), _mm512_mul_ps(ws, _mm512_set1_ps(x.d[(m0 + i) * nb + b])), acc[i]);
  }
}

template <bool Nibbles, bool Signed>
inline void tile_rows_any(int mr, const PackedTiles& p, int64_t t, const QuantizedRows& x, int64_t m0, __m512 acc[]) {
  switch (mr) {
    case 8: tile_rows<8, Nibbles, Signed>(p, t, x, m0, acc); break;
    case 7: tile_rows<7, Nibbles, Signed>(p, t, x, m0, acc); break;
    case 6: tile_rows<6, Nibbles, Signed>(p, t, x, m0, acc); break;
    case 5: tile_rows<5, Nibbles, Signed>(p, t, x, m0, acc); break;
    case 4: tile_rows<4, Nibbles, Signed>(p, t, x, m0, acc); break;
    case 3: tile_rows<3, Nibbles, Signed>(p, t, x, m0, acc); break;
    case 2: tile_rows<2, Nibbles, Signed>(p, t, x, m0, acc); break;
    default: tile_rows<1, Nibbles, Signed>(p, t, x, m0, acc); break;
  }
}

// The min terms of row i for the tile's 16 outputs: dot_f32's operations in its order (8 lanes
// over the blocks, hadd's tree, then the remaining blocks), one output per lane.
inline __m512 tile_min_terms(const PackedTiles& p, int64_t t, const QuantizedRows& x, int64_t i) {
  const int64_t nb = x.nb;
  const int64_t at = t * nb * kTileN;
  const float* s = x.s.data() + i * nb;
  auto term = [&](int64_t b) { return tile_scales(p.wm, at + b * kTileN, p.half); };
  __m512 a[8];
  for (int l = 0; l < 8; ++l) a[l] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 8 <= nb; k += 8)
    for (int l = 0; l < 8; ++l) a[l] = _mm512_fmadd_ps(term(k + l), _mm512_set1_ps(s[k + l]), a[l]);
  __m512 r = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[4]), _mm512_add_ps(a[2], a[6])),
                           _mm512_add_ps(_mm512_add_ps(a[1], a[5]), _mm512_add_ps(a[3], a[7])));
  for (; k < nb; ++k) r = _mm512_fmadd_ps(term(k), _mm512_set1_ps(s[k]), r);
  return r;
}

// y[M, N] (N = tiles · 16) for tiles [t0, t1) of the packed weight.
inline void gemm(const PackedTiles& p, const QuantizedRows& x, float* y, int64_t N, int64_t t0, int64_t t1) {
  const int64_t M = x.M;
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t n0 = t * kTileN;
    for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {
      const int mr = static_cast<int>(std::min<int64_t>(kTileRows, M - m0));
      __m512 acc[kTileRows];
      if (p.nibbles)
        tile_rows_any<true, false>(mr, p, t, x, m0, acc);
      else
        tile_rows_any<false, true>(mr, p, t, x, m0, acc);
      for (int i = 0; i < mr; ++i) {
        const __m512 v = p.wm ? _mm512_add_ps(acc[i], tile_min_terms(p, t, x, m0 + i)) : acc[i];
        _mm512_storeu_ps(y + (m0 + i) * N + n0, v);
      }
    }
  }
}
#endif

}  // namespace int8dot
