// Paged attention for short queries (decodes, short prefill chunks) on the CPU, reading K/V in
// place from the block pool: no gathered copy of each sequence's context per layer.
//
// One task per (sequence, kv head): the G = Hq / Hkv query heads that share the kv head and all
// of the sequence's q_len queries are scored against each key as it is read, so K and V are read
// once per task. Two passes (scores, then weighted V) with an exact softmax in fp32. A 2-byte cache
// (fp16 / bf16) is widened to fp32 in registers as it is read; a quantized cache (int8 / fp8 codes
// with a scale per slot and head) is decoded a row at a time.
//
// Per layer, a sliding window (a query at position p sees keys (p - window, p]; 0: no window) and
// soft-capping of the scores (s -> cap * tanh(s / cap) before the softmax; 0: none). Splits wholly
// before a sequence's first window are never read.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <utility>
#include <vector>

#include "layer_ops.h"

namespace paged_attn {
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

// s[0, n) := exp(s - max s); returns {max, sum}. n >= 1.
inline std::pair<float, float> exp_shifted(float* s, int64_t n) {
  __m256 vm = _mm256_set1_ps(-std::numeric_limits<float>::infinity());
  int64_t j = 0;
  for (; j + 8 <= n; j += 8) vm = _mm256_max_ps(vm, _mm256_loadu_ps(s + j));
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(vm), _mm256_extractf128_ps(vm, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_movehdup_ps(m4));
  float m = _mm_cvtss_f32(m4);
  for (; j < n; ++j) m = std::max(m, s[j]);
  return {m, layer_ops::exp_shift_sum(s, n, m)};
}

// A row's cache lines requested ahead of use: one head's rows are strided (a slot holds every kv
// head), and one core's hardware prefetcher alone reads a long context at well under half the
// rate of the same rows already in cache.
inline void prefetch_bytes(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(c + off, _MM_HINT_T0);
}
constexpr int64_t kPrefetchKeys = 16;  // how far ahead, in keys

#ifdef __AVX512F__
// 16 elements widened to fp32. fp16 and bf16 widen exactly, so everything after the load is the
// fp32 cache's arithmetic: a 2-byte cache gives the bits an fp32 cache holding the same (rounded)
// values would.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline __m512 load16(const c10::BFloat16* p) {  // bf16 is an fp32's top half
  const __m512i w = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(w, 16));
}
#endif

// Where a slot-head's K or V row comes from. PlainRows: fp32, fp16 or bf16 elements in place (a
// 2-byte cache halves the bytes a decode step reads; at batch 32 that is most of attention's
// time). CodeRows: one byte per element (int8, fp8 e4m3 or e5m2 bits) decoded into a buffer, and
// the row's scale, which the caller folds into the score (K) or the softmax weight (V) rather
// than into every element.
template <class T>
struct PlainRows {
  using elem = T;
  static constexpr bool kInPlace = true;
  const T* base;
  int64_t hkv, d;
  const T* ptr(int64_t slot, int64_t h) const { return base + (slot * hkv + h) * d; }
  const float* row(int64_t slot, int64_t h, float* buf) const {
    if constexpr (std::is_same_v<T, float>) {
      return ptr(slot, h);
    } else {
      const T* p = ptr(slot, h);
      for (int64_t i = 0; i < d; ++i) buf[i] = static_cast<float>(p[i]);
      return buf;
    }
  }
  float scale(int64_t, int64_t) const { return 1.f; }
  void prefetch(int64_t slot, int64_t h) const { prefetch_bytes(ptr(slot, h), d * static_cast<int64_t>(sizeof(T))); }
#ifdef __AVX512F__
  // Columns [col, col + 64) of the row, widened to fp32.
  void load64(int64_t slot, int64_t h, int64_t col, float*, __m512 out[4]) const {
    const T* p = ptr(slot, h) + col;
    for (int c = 0; c < 4; ++c) out[c] = load16(p + 16 * c);
  }
#endif
};

enum Code : int64_t { kInt8 = 0, kE4M3 = 1, kE5M2 = 2 };

template <int64_t C>
struct CodeRows {
  static constexpr bool kInPlace = false;
  const uint8_t* base;
  const float* scales;  // [slots, hkv]
  int64_t hkv, d;
  const float* row(int64_t slot, int64_t h, float* buf) const {
    decode(base + (slot * hkv + h) * d, d, buf);
    return buf;
  }
  static void decode(const uint8_t* src, int64_t n, float* buf) {
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      const uint32_t b = src[i];
      if constexpr (C == kInt8) {
        buf[i] = static_cast<float>(static_cast<int8_t>(src[i]));
      } else {
        // Place sign, exponent and mantissa in an fp32's bit fields, then rebias the exponent by
        // a multiply (2^(127-7) for e4m3, 2^(127-15) for e5m2): exact, subnormal codes included.
        const uint32_t bits = C == kE4M3 ? ((b & 0x80u) << 24) | ((b & 0x7Fu) << 20)
                                         : ((b & 0x80u) << 24) | ((b & 0x7Fu) << 21);
        float f;
        std::memcpy(&f, &bits, sizeof f);
        buf[i] = f * (C == kE4M3 ? 0x1p120f : 0x1p112f);
      }
    }
  }
  float scale(int64_t slot, int64_t h) const { return scales[slot * hkv + h]; }
  void prefetch(int64_t slot, int64_t h) const { prefetch_bytes(base + (slot * hkv + h) * d, d); }
#ifdef __AVX512F__
  void load64(int64_t slot, int64_t h, int64_t col, float* buf, __m512 out[4]) const {
    decode(base + (slot * hkv + h) * d + col, 64, buf);
    for (int c = 0; c < 4; ++c) out[c] = _mm512_loadu_ps(buf + 16 * c);
  }
#endif
};

// A sequence's key position → its slot in the pool, through its block table. The engine's block
// sizes are powers of two: a shift and a mask instead of the division and remainder, which cost
// two 64-bit idivs per key and pass (a key's own slot and the one prefetched ahead). The draft
// head's caches come as one block of any size.
struct Slots {
  const int64_t* table;
  int64_t block_size;
  int shift;  // log2(block_size), or -1 when it is not a power of two
  Slots(const int64_t* t, int64_t bs)
      : table(t), block_size(bs), shift(bs > 0 && (bs & (bs - 1)) == 0 ? __builtin_ctzll(bs) : -1) {}
  int64_t operator()(int64_t j) const {
    if (shift >= 0) return (table[j >> shift] << shift) | (j & (block_size - 1));
    return table[j / block_size] * block_size + j % block_size;
  }
};

// Keys per split: a context longer than this is attended in pieces of it by separate tasks, each
// with its own running max and sum, merged exactly afterwards (flash-decoding's split-K). At batch
// 1 one task per kv head would leave cores idle (the default model's 3 kv heads on 2 cores: one
// idle a third of the time) on the long contexts where attention is most of the step. The pieces
// are fixed by key position, so a sequence's result never depends on the batch, the thread count
// or its other query rows.
constexpr int64_t kSplitKeys = 256;

#ifdef __AVX512F__
// Head sizes 64, 128 and 256 (any number of query heads per kv head), AVX-512: keys scored 16 at a
// time against one query head with the 16 sums in registers, and pass 2 keeps up to 4 query
// heads' sums of a 64-column slice in registers across the keys instead of loading and storing
// them per key (the generic loops below cost ~180 cycles per key and kv head at batch 1 for the
// default model's head size 64; these, ~60).
constexpr bool kFastPath = true;
constexpr int64_t kMaxFastD = 256;

inline bool fast_head_dim(int64_t d) { return d == 64 || d == 128 || d == 256; }

// Lane t of the result: the sum of v[t]'s 16 lanes. Unpack-and-add within 128-bit lanes, then
// across them: ~45 instructions for 16 sums, against ~8 per sum for _mm512_reduce_add_ps.
inline __m512 sum16x16(const __m512 v[16]) {
  __m512 x[8], z[4];
  for (int t = 0; t < 8; ++t)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    x[t] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * t], v[2 * t + 1]), _mm512_unpackhi_ps(v[2 * t], v[2 * t + 1]));
  for (int t = 0; t < 4; ++t) {  // per 128-bit lane: that lane's sums of four vectors
    const __m512d a = _mm512_castps_pd(x[2 * t]), b = _mm512_castps_pd(x[2 * t + 1]);
    z[t] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(a, b)), _mm512_castpd_ps(_mm512_unpackhi_pd(a, b)));
  }
  // Across the four 128-bit lanes: z[t]'s four partial sums end in 128-bit lane t.
  const __m512 u0 = _mm512_add_ps(_mm512_shuffle_f32x4(z[0], z[1], 0x88), _mm512_shuffle_f32x4(z[0], z[1], 0xDD));
  const __m512 u1 = _mm512_add_ps(_mm512_shuffle_f32x4(z[2], z[3], 0x88), _mm512_shuffle_f32x4(z[2], z[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, 0x88), _mm512_shuffle_f32x4(u0, u1, 0xDD));
}

// Scores of one query head against 16 keys at once: out[t] = s[t] · q · key[t], t < 16, each
// lane's products summed in column order (the same bits for a key wherever it falls in a block).
// Keys outer, columns inner: the 16 sums stay in registers (with columns outer, GCC keeps them on
// the stack, a store and a load per FMA); each lane's operations and their order are the same
// either way.
template <int D>
inline void scores16(const float* q, const float* const key[16], const float* s, float* out) {
  __m512 acc[16];
#pragma GCC unroll 16
  for (int t = 0; t < 16; ++t) {
    const float* k = key[t];
    __m512 a = _mm512_mul_ps(_mm512_loadu_ps(q), _mm512_loadu_ps(k));
#pragma GCC unroll 16
    for (int c = 1; c < D / 16; ++c) a = _mm512_fmadd_ps(_mm512_loadu_ps(q + 16 * c), _mm512_loadu_ps(k + 16 * c), a);
    acc[t] = a;
  }
  _mm512_storeu_ps(out, _mm512_mul_ps(sum16x16(acc), _mm512_loadu_ps(s)));
}

// A key row as fp32 for scores16: fp32 in place; fp16 / bf16 widened, int8 / fp8 decoded into
// `buf` (once per key, not once per query head).
template <class Rows>
inline const float* fp32_row(const Rows& rows, int64_t slot, int64_t h, int64_t d, float* buf) {
  if constexpr (!Rows::kInPlace) {
    return rows.row(slot, h, buf);
  } else if constexpr (std::is_same_v<typename Rows::elem, float>) {
    return rows.ptr(slot, h);
  } else {
    const auto* p = rows.ptr(slot, h);
    for (int64_t c = 0; c < d / 16; ++c) _mm512_store_ps(buf + 16 * c, load16(p + 16 * c));
    return buf;
  }
}

// For each of Q queries (r < Q): o[r][g][col, col + 64) = Σ_{j in [ja[r], jend[r])} p[r][g][j - j0] ·
// scale_j · V_j[col, col + 64), for G query heads (o rows d apart). Q = 2 (two queries of a prefill
// chunk or a verification) reads each V row once for both; every query's sums are the same
// operations in the same key order as with Q = 1, so its bits do not depend on its neighbour.
template <int G, int Q, class Rows>
inline void values64(const Rows& vals, const Slots& slot_of, int64_t h, int64_t j0, const int64_t* ja,
                     const int64_t* jend, int64_t col, const float* const* p, int64_t p_stride, float* const* o,
                     int64_t d, float* buf) {
  __m512 acc[Q][G][4];
  int64_t lo = ja[0], hi = jend[0];
  for (int r = 0; r < Q; ++r) {
    lo = std::min(lo, ja[r]);
    hi = std::max(hi, jend[r]);
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < 4; ++c) acc[r][g][c] = _mm512_setzero_ps();
  }
  for (int64_t j = lo; j < hi; ++j) {
    const int64_t slot = slot_of(j);
    if (const int64_t a = j + kPrefetchKeys; a < hi && col == 0) vals.prefetch(slot_of(a), h);
    const float vs = vals.scale(slot, h);
    __m512 vc[4];
    vals.load64(slot, h, col, buf, vc);
    for (int r = 0; r < Q; ++r) {
      if (Q > 1 && (j < ja[r] || j >= jend[r])) continue;
      for (int g = 0; g < G; ++g) {
        const __m512 w = _mm512_set1_ps(p[r][g * p_stride + j - j0] * vs);
        for (int c = 0; c < 4; ++c) acc[r][g][c] = _mm512_fmadd_ps(w, vc[c], acc[r][g][c]);
      }
    }
  }
  for (int r = 0; r < Q; ++r)
    for (int g = 0; g < G; ++g)
      for (int c = 0; c < 4; ++c) _mm512_storeu_ps(o[r] + g * d + col + 16 * c, acc[r][g][c]);
}

// values64 for every 64-column slice and every query head of the group, 4 heads at a time, for Q
// queries (1, or 2 while 2 · 3 heads' sums fit in the registers; 4 heads take them one by one).
template <int Q, class Rows>
inline void values_fast(const Rows& vals, const Slots& slot_of, int64_t h, int64_t j0, const int64_t* ja,
                        const int64_t* jend, int64_t group, const float* const* p, int64_t p_stride,
                        float* const* o, int64_t d, float* buf) {
  for (int64_t g0 = 0; g0 < group; g0 += 4) {
    const int64_t heads = std::min<int64_t>(4, group - g0);
    const float* pg[Q];
    float* og[Q];
    for (int r = 0; r < Q; ++r) {
      pg[r] = p[r] + g0 * p_stride;
      og[r] = o[r] + g0 * d;
    }
    for (int64_t col = 0; col < d; col += 64) {
      switch (heads) {
        case 1: values64<1, Q>(vals, slot_of, h, j0, ja, jend, col, pg, p_stride, og, d, buf); break;
        case 2: values64<2, Q>(vals, slot_of, h, j0, ja, jend, col, pg, p_stride, og, d, buf); break;
        case 3: values64<3, Q>(vals, slot_of, h, j0, ja, jend, col, pg, p_stride, og, d, buf); break;
        default:
          for (int r = 0; r < Q; ++r)
            values64<4, 1>(vals, slot_of, h, j0, ja + r, jend + r, col, pg + r, p_stride, og + r, d, buf);
          break;
      }
    }
  }
}
#else
constexpr bool kFastPath = false;
inline bool fast_head_dim(int64_t) { return false; }
#endif

// q, out: [T, Hq, D] (rows of the flat batch); K/V rows per slot and kv head (see above).
// row_start, q_lens, ctx_lens: [B]; block_tables: [B, max_blocks]. Query i of sequence b is flat
// row row_start[b] + i at position p = ctx_lens[b] - q_lens[b] + i and sees keys [0, p], or
// (p - window, p] with a window (> 0); with softcap (> 0) its scores are soft-capped.
template <class Rows>
void attend(const torch::Tensor& q, const Rows& keys, const Rows& vals, int64_t hkv,
            int64_t block_size, const torch::Tensor& row_start, const torch::Tensor& q_lens,
            const torch::Tensor& ctx_lens, const torch::Tensor& block_tables, torch::Tensor& out,
            double scale, int64_t window, double softcap) {
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && out.scalar_type() == torch::kFloat32,
              "paged_attention: fp32 queries only");
  TORCH_CHECK(q.is_contiguous() && out.is_contiguous() && block_tables.is_contiguous(),
              "paged_attention: contiguous tensors expected");
  TORCH_CHECK(window >= 0 && softcap >= 0.0, "paged_attention: window and softcap must be >= 0");
  const int64_t hq = q.size(1), d = q.size(2);
  const int64_t group = hq / hkv;
  const int64_t num_seqs = row_start.size(0), max_blocks = block_tables.size(1);
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t* rs = row_start.data_ptr<int64_t>();
  const int64_t* ql = q_lens.data_ptr<int64_t>();
  const int64_t* cl = ctx_lens.data_ptr<int64_t>();
  const int64_t* bt = block_tables.data_ptr<int64_t>();
  const float fscale = static_cast<float>(scale);
  const float cap = static_cast<float>(softcap), inv_cap = softcap > 0.0 ? 1.f / cap : 0.f;
  constexpr float kNegInf = -std::numeric_limits<float>::infinity();
  const bool fast = kFastPath && fast_head_dim(d);
  // Key positions [lo, ...) query position p sees.
  const auto first_key = [window](int64_t p) { return window > 0 ? std::max<int64_t>(0, p - window + 1) : 0; };

  // Tasks are (sequence, kv head, split) over the splits from the one holding the first query's
  // first key; each (task, query row) owns a partial result: the unnormalised weighted sum of
  // values, the max score and the sum of exp(score - max).
  std::vector<int64_t> task_start(num_seqs + 1, 0), part_start(num_seqs + 1, 0), first_split(num_seqs);
  bool any_split = false;
  for (int64_t b = 0; b < num_seqs; ++b) {
    const int64_t splits = (cl[b] + kSplitKeys - 1) / kSplitKeys;
    first_split[b] = first_key(cl[b] - ql[b]) / kSplitKeys;
    const int64_t n_splits = splits - first_split[b];
    any_split = any_split || n_splits > 1;
    task_start[b + 1] = task_start[b] + hkv * n_splits;
    part_start[b + 1] = part_start[b] + hkv * n_splits * ql[b] * group;
  }
  // (part_o uninitialised: pass 2 writes every row it owns before anything reads it.)
  std::unique_ptr<float[]> part_o(new float[part_start[num_seqs] * d]);
  std::vector<float> part_m(part_start[num_seqs]), part_l(part_start[num_seqs]);

  at::parallel_for(0, task_start[num_seqs], 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> buf(d);
    int64_t b = std::upper_bound(task_start.begin(), task_start.end(), begin) - task_start.begin() - 1;
    for (int64_t task = begin; task < end; ++task) {
      while (task >= task_start[b + 1]) ++b;
      const int64_t n_q = ql[b], ctx = cl[b], first_pos = ctx - n_q;
      const int64_t splits = (ctx + kSplitKeys - 1) / kSplitKeys - first_split[b];
      const int64_t local = task - task_start[b];
      const int64_t h = local / splits, c = local % splits;
      const int64_t j0 = (first_split[b] + c) * kSplitKeys, j1 = std::min(ctx, j0 + kSplitKeys);
      const int64_t span = j1 - j0;
      const int64_t rows = n_q * group;  // (query i, head g) pairs, row r = i * group + g
      const int64_t part0 = part_start[b] + (h * splits + c) * rows;
      // Queries [0, i_end(j)) can see key j (those from j - first_pos on are past it, and with a
      // window those from j + window - first_pos on have left it behind).
      const auto i_end = [&](int64_t j) {
        return window > 0 ? std::min(n_q, std::max<int64_t>(0, j + window - first_pos)) : n_q;
      };
      const int64_t j_first = std::max(j0, first_key(first_pos));  // no query sees keys before
      scores.assign(rows * span, kNegInf);
      const Slots slot_of(bt + b * max_blocks, block_size);
      // Pass 1: scores for every (query, head) against every visible key of the split.
      int64_t j = j_first;
#ifdef __AVX512F__
      // Fast head sizes (any cache dtype): every key of the split 16 at a time, the last block
      // padded with copies of the last key (their scores are dropped). Every lane of scores16
      // sums in the same order, so a key's score has the same bits wherever it falls in a block:
      // a query's output never depends on the context length's remainder or on other query rows
      // (a decode and the same position inside a verification agree to the bit). A query scores
      // the block's keys it cannot see too: the softmax and pass 2 use its visible keys only.
      if (fast) {
        alignas(64) float wide[16 * kMaxFastD];  // the 16 keys in fp32, where the cache is not
        alignas(64) float s16[16];  // each key's score multiplier: the softmax scale x its own
        for (; j < j1; j += 16) {
          const int64_t valid = std::min<int64_t>(16, j1 - j);
          const float* key16[16];
          for (int t = 0; t < 16; ++t) {
            const int64_t jt = j + std::min<int64_t>(t, valid - 1), a = j + t + kPrefetchKeys;
            const int64_t slot = slot_of(jt);
            key16[t] = fp32_row(keys, slot, h, d, wide + t * d);
            s16[t] = fscale * keys.scale(slot, h);
            if (a < j1) keys.prefetch(slot_of(a), h);
          }
          alignas(64) float part[16];
          const int64_t i_stop = i_end(j + 15);
          for (int64_t i = std::max<int64_t>(0, j - first_pos); i < i_stop; ++i) {
            const float* qrow = qp + ((rs[b] + i) * hq + h * group) * d;
            for (int64_t g = 0; g < group; ++g) {
              float* dst = scores.data() + (i * group + g) * span + j - j0;
              float* to = valid == 16 ? dst : part;
              switch (d) {
                case 64: scores16<64>(qrow + g * d, key16, s16, to); break;
                case 128: scores16<128>(qrow + g * d, key16, s16, to); break;
                default: scores16<256>(qrow + g * d, key16, s16, to); break;
              }
              if (valid < 16) std::copy_n(part, valid, dst);
            }
          }
        }
      }
#endif
      for (; j < j1; ++j) {
        const int64_t slot = slot_of(j);
        if (const int64_t a = j + kPrefetchKeys; a < j1) keys.prefetch(slot_of(a), h);
        const float* key = keys.row(slot, h, buf.data());
        const float s = fscale * keys.scale(slot, h);
        const int64_t i0 = std::max<int64_t>(0, j - first_pos);  // first query that sees key j
        for (int64_t i = i0, ie = i_end(j); i < ie; ++i) {
          const float* qrow = qp + ((rs[b] + i) * hq + h * group) * d;
          float* dst = scores.data() + i * group * span + j - j0;
          for (int64_t g = 0; g < group; ++g) dst[g * span] = dot(qrow + g * d, key, d) * s;
        }
      }
      // exp(score - max) per row over its visible keys of the split, [lo, hi) (none: max -inf,
      // sum 0), soft-capped first.
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t pos = first_pos + r / group;
        const int64_t lo = std::max(j0, first_key(pos)), hi = std::min(j1, pos + 1);
        float* sr = scores.data() + r * span + lo - j0;
        if (hi > lo && cap > 0.f)
          for (int64_t k = 0; k < hi - lo; ++k) sr[k] = cap * std::tanh(sr[k] * inv_cap);
        const auto [m, sum] = hi > lo ? exp_shifted(sr, hi - lo) : std::pair<float, float>{kNegInf, 0.f};
        part_m[part0 + r] = m;
        part_l[part0 + r] = sum;
      }
      // Pass 2: the split's weighted sum of values, unnormalised.
      float* o = part_o.get() + part0 * d;
      // A context of one split needs no merge: its rows are normalised into the output here, as
      // the merge below would do it (0 + o, times 1 / (0 + 1 * sum): the same bits), without the
      // merge's second parallel region (at batch 1, two regions of a few us per layer).
      const auto finish_single = [&] {
        if (splits != 1) return;
        for (int64_t r = 0; r < rows; ++r) {
          float* orow = op + ((rs[b] + r / group) * hq + h * group + r % group) * d;
          const float* src = o + r * d;
          const float inv = 1.f / part_l[part0 + r];
          for (int64_t e = 0; e < d; ++e) orow[e] = (0.f + src[e]) * inv;
        }
      };
#ifdef __AVX512F__
      if (fast) {
        // Queries in pairs (the last alone): each V row read once for both.
        for (int64_t i = 0; i < n_q; i += 2) {
          const int64_t n = std::min<int64_t>(2, n_q - i);
          int64_t ja[2], jend[2];
          const float* p[2];
          float* orow[2];
          for (int64_t r = 0; r < n; ++r) {
            const int64_t pos = first_pos + i + r;
            ja[r] = std::max(j0, first_key(pos));  // keys query i + r sees: [ja, jend)
            jend[r] = std::max(ja[r], std::min(j1, pos + 1));
            p[r] = scores.data() + (i + r) * group * span;
            orow[r] = o + (i + r) * group * d;
          }
          if (n == 2) values_fast<2>(vals, slot_of, h, j0, ja, jend, group, p, span, orow, d, buf.data());
          else values_fast<1>(vals, slot_of, h, j0, ja, jend, group, p, span, orow, d, buf.data());
        }
        finish_single();
        continue;
      }
#endif
      std::fill_n(o, rows * d, 0.f);
      for (int64_t j = j_first; j < j1; ++j) {
        const int64_t slot = slot_of(j);
        if (const int64_t a = j + kPrefetchKeys; a < j1) vals.prefetch(slot_of(a), h);
        const float* val = vals.row(slot, h, buf.data());
        const float vs = vals.scale(slot, h);
        const int64_t i0 = std::max<int64_t>(0, j - first_pos);
        for (int64_t r = i0 * group, re = i_end(j) * group; r < re; ++r)
          axpy(o + r * d, val, scores[r * span + j - j0] * vs, d);
      }
      finish_single();
    }
  });
  if (!any_split) return;
  // Merge the splits of each (sequence, kv head, row) in split order: weights exp(m_c - max).
  at::parallel_for(0, num_seqs * hkv, 1, [&](int64_t begin, int64_t end) {
    for (int64_t task = begin; task < end; ++task) {
      const int64_t b = task / hkv, h = task % hkv, n_q = ql[b], rows = n_q * group;
      const int64_t splits = (cl[b] + kSplitKeys - 1) / kSplitKeys - first_split[b];
      if (splits == 1) continue;  // written by its task already
      for (int64_t r = 0; r < rows; ++r) {
        const int64_t i = r / group, g = r % group;
        float* orow = op + ((rs[b] + i) * hq + h * group + g) * d;
        float m = kNegInf;
        for (int64_t c = 0; c < splits; ++c) m = std::max(m, part_m[part_start[b] + (h * splits + c) * rows + r]);
        float sum = 0.f;
        std::fill_n(orow, d, 0.f);
        for (int64_t c = 0; c < splits; ++c) {
          const int64_t part = part_start[b] + (h * splits + c) * rows + r;
          const float w = std::exp(part_m[part] - m);  // 0 for a split the row sees nothing of
          if (w == 0.f) continue;  // (its partial sums may be of keys the row cannot see)
          sum += w * part_l[part];
          axpy(orow, part_o.get() + part * d, w, d);
        }
        const float inv = 1.f / sum;
        for (int64_t e = 0; e < d; ++e) orow[e] *= inv;
      }
    }
  });
}

}  // namespace

// k_cache, v_cache: [num_blocks, block_size, Hkv, D], fp32, fp16 or bf16 (both the same).
void paged_attention_short(torch::Tensor q, torch::Tensor k_cache, torch::Tensor v_cache,
                           torch::Tensor row_start, torch::Tensor q_lens, torch::Tensor ctx_lens,
                           torch::Tensor block_tables, torch::Tensor out, double scale, int64_t window = 0,
                           double softcap = 0.0) {
  const auto dtype = k_cache.scalar_type();
  TORCH_CHECK(v_cache.scalar_type() == dtype &&
                  (dtype == torch::kFloat32 || dtype == torch::kFloat16 || dtype == torch::kBFloat16),
              "paged_attention_short: K and V caches of one dtype, fp32, fp16 or bf16");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "paged_attention_short: contiguous cache expected");
  const int64_t hkv = k_cache.size(2), d = k_cache.size(3);
  const auto run = [&](auto tag) {
    using T = decltype(tag);
    const PlainRows<T> keys{k_cache.data_ptr<T>(), hkv, d}, vals{v_cache.data_ptr<T>(), hkv, d};
    attend(q, keys, vals, hkv, k_cache.size(1), row_start, q_lens, ctx_lens, block_tables, out, scale, window,
           softcap);
  };
  if (dtype == torch::kFloat32) run(float{});
  else if (dtype == torch::kFloat16) run(c10::Half{});
  else run(c10::BFloat16{});
}

// k_data, v_data: [num_blocks, block_size, Hkv, D] uint8 codes; k_scale, v_scale: [num_blocks,
// block_size, Hkv] fp32; code: 0 int8, 1 fp8 e4m3, 2 fp8 e5m2. Element = decode(code) * scale.
void paged_attention_short_quant(torch::Tensor q, torch::Tensor k_data, torch::Tensor v_data,
                                 torch::Tensor k_scale, torch::Tensor v_scale, int64_t code,
                                 torch::Tensor row_start, torch::Tensor q_lens, torch::Tensor ctx_lens,
                                 torch::Tensor block_tables, torch::Tensor out, double scale,
                                 int64_t window = 0, double softcap = 0.0) {
  TORCH_CHECK(k_data.scalar_type() == torch::kUInt8 && v_data.scalar_type() == torch::kUInt8 &&
                  k_scale.scalar_type() == torch::kFloat32 && v_scale.scalar_type() == torch::kFloat32,
              "paged_attention_short_quant: uint8 codes and fp32 scales expected");
  TORCH_CHECK(k_data.is_contiguous() && v_data.is_contiguous() && k_scale.is_contiguous() && v_scale.is_contiguous(),
              "paged_attention_short_quant: contiguous cache expected");
  const int64_t hkv = k_data.size(2), d = k_data.size(3), bs = k_data.size(1);
  const auto run = [&](auto rows_tag) {
    using Rows = decltype(rows_tag);
    const Rows keys{k_data.data_ptr<uint8_t>(), k_scale.data_ptr<float>(), hkv, d};
    const Rows vals{v_data.data_ptr<uint8_t>(), v_scale.data_ptr<float>(), hkv, d};
    attend(q, keys, vals, hkv, bs, row_start, q_lens, ctx_lens, block_tables, out, scale, window, softcap);
  };
  switch (code) {
    case kInt8: run(CodeRows<kInt8>{}); break;
    case kE4M3: run(CodeRows<kE4M3>{}); break;
    case kE5M2: run(CodeRows<kE5M2>{}); break;
    default: TORCH_CHECK(false, "paged_attention_short_quant: unknown code ", code);
  }
}

}  // namespace paged_attn
