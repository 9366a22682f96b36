// Integer dot products for decode (what llama.cpp does): the activation rows are quantized once
// per call to int8 per 32-block (x ≈ d · q, d = max|x| / 127, and d · Σ q per block), and
// each 32-weight block meets them in integer arithmetic — 32 multiply-adds in one or two
// instructions — with one fp32 FMA per block for the two scales:
//   q8 (w = s·qw, qw int8):            Σ_k w_k x_k ≈ s·d · Σ qw_k q_k
//   q4 (w = s·qw + m, qw 0..15):       Σ_k w_k x_k ≈ s·d · Σ qw_k q_k + m · d · Σ q_k
// The min term takes the sum of the *rounded* x (llama.cpp's Q8_1 `s`), not the exact one: then
// the error is Σ w_k δ_k over weights of mean ~0, where the exact sum would leave Σ (w_k - m) δ_k
// over weights all of one sign (default model, Q4_1, 2,048 tokens, every matmul on int8
// activations: perplexity +0.30% against fp32 activations, +0.81% with the exact sum).
// With AVX512-VNNI (+VL) a block is one `vpdpbusd` (u8 × s8 → int32, no int16 saturation);
// with AVX2 it is `vpmaddubsw` + `vpmaddwd`. maddubs multiplies unsigned by signed, so signed
// int8 weights use the sign trick: |qw| · (q with qw's sign). Its int16 pair sums stay in range:
// q4: 2·15·127; q8: 2·128·127 < 32767.
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VNNI__)
#define INT8DOT_ZMM 1  // gemm() below: two output rows per 512-bit register
#endif

namespace int8dot {

// The activation rows quantized: q [M, K] int8, d and s [M, K / 32] (scale, d · Σ q of the block).
struct QuantizedRows {
  std::vector<int8_t> q;
  std::vector<float> d, s;
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
      r.s[i * r.nb + b] = d * static_cast<float>(hsum_i32(qsum));
    }
}

// Every row quantized; `parallel(n, fn)` runs fn(i0, i1) over row ranges (at::parallel_for in
// the extension: a 512-row prefill chunk is ~0.3 ms of rounding on one core).
template <typename Parallel>
inline QuantizedRows quantize_rows(const float* x, int64_t M, int64_t K, Parallel parallel) {
  QuantizedRows r{std::vector<int8_t>(M * K), std::vector<float>(M * (K / 32)),
                  std::vector<float>(M * (K / 32)), M, K, K / 32};
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

// A single core's hardware prefetcher alone left the 28 MB Q8_0 head streaming at ~1/4 of what
// an fp32 GEMV reads: ask for the rows a few ahead explicitly.
constexpr int64_t kPrefetchRows = 16;
inline void prefetch_row(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(c + off, _MM_HINT_T0);
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
#ifdef INT8DOT_ZMM
  static constexpr bool kSigned = true;
  // Block b of rows r0 and r1 side by side, as stored (signed: tile_rows offsets x instead).
  static inline __m512i pair(Row r0, Row r1, int64_t b) {
    return _mm512_inserti64x4(
        _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(r0 + b * 32))),
        _mm256_loadu_si256(reinterpret_cast<const __m256i*>(r1 + b * 32)), 1);
  }
#endif
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
#ifdef INT8DOT_ZMM
  static constexpr bool kSigned = false;
  // Block b of rows r0 and r1 as 2 x 32 nibbles in weight order (load_q4's, per 256-bit half).
  static inline __m512i pair(Row r0, Row r1, int64_t b) {
    const __m256i raw = _mm256_inserti128_si256(
        _mm256_castsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(r0 + b * 16))),
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(r1 + b * 16)), 1);
    // 128-bit lanes [r0 lo, r1 lo, r0 hi, r1 hi] → [r0 lo, r0 hi, r1 lo, r1 hi]
    __m512i z = _mm512_inserti64x4(_mm512_castsi256_si512(raw), _mm256_srli_epi16(raw, 4), 1);
    z = _mm512_shuffle_i64x2(z, z, _MM_SHUFFLE(3, 1, 2, 0));
    return _mm512_and_si512(z, _mm512_set1_epi8(0x0F));
  }
#endif
};

#ifdef INT8DOT_ZMM
// ---- gemm: many activation rows (prefill chunks, batched decode), AVX512-VNNI --------------
// Bit for bit what gemv gives for every (row, output) pair, so that a request's numerics never
// depend on how many rows share its call: each pair keeps gemv's 8 lanes per block (a block's
// 8 int32 partial dots, converted, times the fp32 product weight scale · activation scale, FMA'd
// into the even- or odd-block accumulator), gemv's final reduction and its min term. What changes
// is only the packing: one zmm holds the same 8 lanes of two output rows, so a block costs one
// vpdpbusd, one convert, one multiply and one FMA per two pairs instead of per pair, and a tile
// of 4 output rows is unpacked once for every activation row of a chunk.
constexpr int kTileN = 4;          // output rows per tile: 2 zmm pairs
constexpr int64_t kRowChunk = 64;  // activation rows per pass over a tile (int8 rows stay in L1/L2)

// Activation rows [m0, m0 + MR) against one unpacked tile: w[b * 2 + p] the weights of pair p
// (output rows 2p, 2p + 1 of the tile) for block b, ws the matching weight scales. Signed
// weights meet x + 128 (unsigned, x's sign bit flipped) with the accumulator started at
// corr = -128 · (the lane's 4 weights summed): Σ (x + 128) w - 128 Σ w = Σ x w, the same int32 as
// gemv's sign trick, for one xor per activation block instead of a masked negate per pair.
// out[r * 4 + e]: the dot of row m0 + e with output row r of the tile.
template <int MR, bool Signed>
inline void tile_rows(const __m512i* w, const __m512i* corr, const __m512* ws, const QuantizedRows& x,
                      int64_t m0, float out[16]) {
  const int64_t nb = x.nb, K = x.K;
  __m512 acc[MR][2][2];
  for (int i = 0; i < MR; ++i)
    for (int p = 0; p < 2; ++p) acc[i][p][0] = acc[i][p][1] = _mm512_setzero_ps();
  auto step = [&](int64_t b, int a) __attribute__((always_inline)) {
    for (int i = 0; i < MR; ++i) {
      const __m512i xq = _mm512_broadcast_i64x4(
          _mm256_loadu_si256(reinterpret_cast<const __m256i*>(x.q.data() + (m0 + i) * K + b * 32)));
      const __m512 d = _mm512_set1_ps(x.d[(m0 + i) * nb + b]);
      __m512i xu = xq;
      if constexpr (Signed) xu = _mm512_xor_si512(xq, _mm512_set1_epi8(static_cast<char>(0x80)));
      for (int p = 0; p < 2; ++p) {
        __m512i dot_i;
        if constexpr (Signed)
          dot_i = _mm512_dpbusd_epi32(corr[b * 2 + p], xu, w[b * 2 + p]);
        else
          dot_i = _mm512_dpbusd_epi32(_mm512_setzero_si512(), w[b * 2 + p], xq);
        const __m512 dot = _mm512_cvtepi32_ps(dot_i);
        acc[i][p][a] = _mm512_fmadd_ps(dot, _mm512_mul_ps(ws[b * 2 + p], d), acc[i][p][a]);
      }
    }
  };
  int64_t b = 0;
  for (; b + 2 <= nb; b += 2) {
    step(b, 0);
    step(b + 1, 1);
  }
  if (b < nb) step(b, 0);
  // gemv's hadd(acc0 + acc1) for all 16 pairs at once, in its order: lanes j + (j + 4), then
  // (0 + 2) and (1 + 3), then those two. After the first level, 128-bit lane r of S[i] holds
  // output r's four partial sums for row i; the next two levels fold rows in, ending with lane r
  // holding output r for rows 0..3.
  __m512 S[4];
  for (int i = 0; i < 4; ++i) {
    if (i >= MR) {
      S[i] = _mm512_setzero_ps();
      continue;
    }
    const __m512 A = _mm512_add_ps(acc[i][0][0], acc[i][0][1]), B = _mm512_add_ps(acc[i][1][0], acc[i][1][1]);
    S[i] = _mm512_add_ps(_mm512_shuffle_f32x4(A, B, _MM_SHUFFLE(2, 0, 2, 0)),
                         _mm512_shuffle_f32x4(A, B, _MM_SHUFFLE(3, 1, 3, 1)));
  }
  const __m512 V = _mm512_add_ps(_mm512_shuffle_ps(S[0], S[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(S[0], S[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 W = _mm512_add_ps(_mm512_shuffle_ps(S[2], S[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                 _mm512_shuffle_ps(S[2], S[3], _MM_SHUFFLE(3, 2, 3, 2)));
  _mm512_storeu_ps(out, _mm512_add_ps(_mm512_shuffle_ps(V, W, _MM_SHUFFLE(2, 0, 2, 0)),
                                      _mm512_shuffle_ps(V, W, _MM_SHUFFLE(3, 1, 3, 1))));
}

// y[M, N] for tiles [t0, t1) of kTileN output rows (N's remainder past the last tile: gemv).
template <typename Fmt>
void gemm(const Fmt& f, const QuantizedRows& x, float* y, int64_t N, int64_t t0, int64_t t1) {
  const int64_t M = x.M, nb = x.nb;
  std::vector<__m512i> w(nb * 2);
  std::vector<__m512i> corr(Fmt::kSigned ? nb * 2 : 0);
  std::vector<__m512> ws(nb * 2);
  std::vector<float> scales(kTileN * nb), mins(kTileN * nb);
  // The chunk's block sums transposed ([b][row]) and the tile's min terms ([output][row]): the
  // min terms (dot_f32's operations, 16 activation rows per instruction) run over it.
  std::vector<float> sT(nb * kRowChunk), mt(kTileN * kRowChunk);
  for (int64_t mc = 0; mc < M; mc += kRowChunk) {
    const int64_t mend = std::min(M, mc + kRowChunk);
    if (f.mins)
      for (int64_t b = 0; b < nb; ++b)
        for (int64_t i = 0; i < kRowChunk; ++i) sT[b * kRowChunk + i] = mc + i < mend ? x.s[(mc + i) * nb + b] : 0.0f;
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t n0 = t * kTileN;
      for (int j = 0; j < kTileN; ++j) {
        // gemv's prefetch distance: without it the Q8_0 head streamed at ~6 GB/s at 4-9 rows.
        if (n0 + kPrefetchRows + j < N) prefetch_row(f.row(n0 + kPrefetchRows + j), f.row_bytes());
        expand_blocks(f.scales, n0 + j, f.groups_per_row, f.blocks_per_group, nb, scales.data() + j * nb);
        if (f.mins) expand_blocks(f.mins, n0 + j, f.groups_per_row, f.blocks_per_group, nb, mins.data() + j * nb);
      }
      for (int p = 0; p < 2; ++p) {
        const float* s0 = scales.data() + (2 * p) * nb;
        const float* s1 = scales.data() + (2 * p + 1) * nb;
        for (int64_t b = 0; b < nb; ++b) {
          __m512i z = Fmt::pair(f.row(n0 + 2 * p), f.row(n0 + 2 * p + 1), b);
          if constexpr (Fmt::kSigned)  // -128 · Σ of each lane's 4 weights (tile_rows)
            corr[b * 2 + p] = _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_slli_epi32(
                _mm512_dpbusd_epi32(_mm512_setzero_si512(), _mm512_set1_epi8(1), z), 7));
          w[b * 2 + p] = z;
          ws[b * 2 + p] = _mm512_mask_blend_ps(0xFF00, _mm512_set1_ps(s0[b]), _mm512_set1_ps(s1[b]));
        }
      }
      if (f.mins)  // dot_f32 for 16 activation rows at a time, operation for operation
        for (int j = 0; j < kTileN; ++j)
          for (int64_t i = 0; i < mend - mc; i += 16) {
            const float* wm = mins.data() + j * nb;
            auto s_at = [&](int64_t b) { return _mm512_loadu_ps(sT.data() + b * kRowChunk + i); };
            __m512 a[8];
            for (int l = 0; l < 8; ++l) a[l] = _mm512_setzero_ps();
            int64_t k = 0;
            for (; k + 8 <= nb; k += 8)
              for (int l = 0; l < 8; ++l) a[l] = _mm512_fmadd_ps(_mm512_set1_ps(wm[k + l]), s_at(k + l), a[l]);
            __m512 r = _mm512_add_ps(_mm512_add_ps(_mm512_add_ps(a[0], a[4]), _mm512_add_ps(a[2], a[6])),
                                     _mm512_add_ps(_mm512_add_ps(a[1], a[5]), _mm512_add_ps(a[3], a[7])));
            for (; k < nb; ++k) r = _mm512_fmadd_ps(_mm512_set1_ps(wm[k]), s_at(k), r);
            _mm512_storeu_ps(mt.data() + j * kRowChunk + i, r);
          }
      for (int64_t m0 = mc; m0 < mend; m0 += 4) {
        const int mr = static_cast<int>(std::min<int64_t>(4, mend - m0));
        alignas(64) float out[16];
        switch (mr) {
          case 4: tile_rows<4, Fmt::kSigned>(w.data(), corr.data(), ws.data(), x, m0, out); break;
          case 3: tile_rows<3, Fmt::kSigned>(w.data(), corr.data(), ws.data(), x, m0, out); break;
          case 2: tile_rows<2, Fmt::kSigned>(w.data(), corr.data(), ws.data(), x, m0, out); break;
          default: tile_rows<1, Fmt::kSigned>(w.data(), corr.data(), ws.data(), x, m0, out); break;
        }
        for (int e = 0; e < mr; ++e)
          for (int r = 0; r < kTileN; ++r) {
            float v = out[r * 4 + e];
            if (f.mins) v += mt[r * kRowChunk + (m0 - mc) + e];
            y[(m0 + e) * N + n0 + r] = v;
          }
      }
    }
  }
}
#endif

}  // namespace int8dot
