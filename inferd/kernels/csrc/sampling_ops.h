// The sampler's per-row work over a vocabulary of logits (fp32 CPU rows), where ATen's CPU code
// is slow: argmax (a scalar loop) and the top-k / top-p filter (a full sort of every row: 8 ms for
// one row of the default model's 49k logits, 170 ms for 32 rows, more than a decode step).
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "layer_ops.h"

namespace sampling_ops {

// torch.argmax(x, -1) of each row of x [T, N] (fp32, unit column stride): the first index of the
// row's largest value, or of its first NaN (which torch ranks above everything). The max in 8
// lanes, then the first lane equal to it: ~6x faster than ATen's.
inline torch::Tensor argmax_rows(const torch::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.size(1) > 0, "argmax_rows: [T, N] with N > 0 expected");
  const int64_t t = x.size(0), n = x.size(1);
  layer_ops::check_rows(x, n, "argmax_rows");
  auto out = torch::empty({t}, x.options().dtype(torch::kLong));
  const float* xp = x.data_ptr<float>();
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t stride = x.stride(0);
  at::parallel_for(0, t, std::max<int64_t>(1, (int64_t{1} << 16) / n), [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* v = xp + r * stride;
      __m256 vmax = _mm256_set1_ps(-INFINITY);
      __m256 nan = _mm256_setzero_ps();
      int64_t i = 0;
      for (; i + 8 <= n; i += 8) {
        const __m256 a = _mm256_loadu_ps(v + i);
        vmax = _mm256_max_ps(vmax, a);
        nan = _mm256_or_ps(nan, _mm256_cmp_ps(a, a, _CMP_UNORD_Q));
      }
      alignas(32) float lanes[8];
      _mm256_store_ps(lanes, vmax);
      float m = lanes[0];
      for (int l = 1; l < 8; ++l) m = std::max(m, lanes[l]);
      bool has_nan = _mm256_movemask_ps(nan) != 0;
      for (int64_t j = i; j < n; ++j) {
        has_nan |= std::isnan(v[j]);
        m = std::max(m, v[j]);
      }
      int64_t found = 0;
      if (has_nan) {
        while (!std::isnan(v[found])) ++found;
      } else {
        const __m256 target = _mm256_set1_ps(m);
        int64_t j = 0;
        for (; j + 8 <= n; j += 8)
          if (_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(v + j), target, _CMP_EQ_OQ)) != 0) break;
        while (v[j] != m) ++j;  // the first equal one: in this 8 or the tail
        found = j;
      }
      op[r] = found;
    }
  });
  return out;
}

// The sampler's top-k then top-p filter: each row of logits [T, V] keeps its top_k[r] largest
// (0: all), then, of those renormalised, the fewest largest whose probability mass reaches
// top_p[r] (the largest always; 1: all); the rest become -inf. Ties keep the lower index.
//
// Why not a sort of the row: the kept set only needs its boundary. A token x is kept by top-p
// exactly when the tokens above it hold less than top_p. Top-p alone: a peaked row sorts its few
// possible members (nucleus_of_peaked_row), a flat one bins them by value and sorts the boundary
// bin (nucleus_of_flat_row). With top-k, one pass bins the row's logits below its max (kHistBins
// bins over kHistNats nats, the rest in the last bin) by count: the tokens down to the bin where
// the running count reaches k are sorted and cut to k, and top-p walks those.
constexpr int kHistBins = 4096;
constexpr size_t kSortDirectly = 4096;  // candidates a top-p row sorts without the histogram
constexpr float kHistNats = 32.f;  // below max - 32 a token's probability is < 1.3e-14

// Candidates (logit, index) largest first, the lower index first among equal logits.
inline void sort_largest_first(std::vector<std::pair<float, int64_t>>& cand) {
  std::sort(cand.begin(), cand.end(), [](const auto& a, const auto& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  });
}

// Top-p's walk over sorted candidates: each is kept while the mass before it (`before`, from the
// tokens already kept above them) stays under `target`; the first is kept regardless unless
// some token above was.
inline void keep_nucleus(const std::vector<std::pair<float, int64_t>>& cand, const float* ev, double before,
                         bool kept_above, double target, float* o) {
  for (const auto& c : cand) {
    if (kept_above && !(before < target)) break;
    o[c.second] = c.first;
    before += ev[c.second];
    kept_above = true;
  }
}

inline float row_max(const float* l, int64_t v) {
  __m256 vmax = _mm256_set1_ps(-INFINITY);
  int64_t i = 0;
  for (; i + 8 <= v; i += 8) vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(l + i));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  float m = lanes[0];
  for (int j = 1; j < 8; ++j) m = std::max(m, lanes[j]);
  for (; i < v; ++i) m = std::max(m, l[i]);
  return m;
}

// The first index in [lo, hi) holding `value` (hi if none).
inline int64_t first_equal(const float* v, int64_t lo, int64_t hi, float value) {
  const __m256 target = _mm256_set1_ps(value);
  int64_t i = lo;
  for (; i + 8 <= hi; i += 8)
    if (_mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(v + i), target, _CMP_EQ_OQ)) != 0) break;
  while (i < hi && v[i] != value) ++i;
  return i;
}

// Each row's next `n_alt` likeliest indices after `best` (its argmax_rows): the first index of
// the largest value other than those already picked, then the next, [T, n_alt], and the softmax
// probabilities of best and of each [T, 1 + n_alt] (a draft tree ranks its nodes by them). A
// pass per pick and one for the softmax's sum, no allocation: ATen's ops for it (a clone, a
// scatter, logsumexp) cost ~70 µs a draft step, a fifth of a draft chain. A row holding a NaN or
// +inf gets probabilities 0; a row too narrow for a pick repeats `best` there, at probability 0.
// (layer_ops' exp clamps below -87: those terms add ~1e-38.)
inline std::tuple<torch::Tensor, torch::Tensor> runner_ups(const torch::Tensor& scores, const torch::Tensor& best,
                                                           int64_t n_alt) {
  TORCH_CHECK(scores.dim() == 2 && scores.size(1) > 0 && best.scalar_type() == torch::kLong &&
                  best.numel() == scores.size(0) && n_alt >= 1 && n_alt <= 8,
              "runner_ups: scores [T, N], their argmax [T] and 1..8 picks expected");
  const int64_t t = scores.size(0), n = scores.size(1);
  layer_ops::check_rows(scores, n, "runner_ups");
  auto others = torch::empty({t, n_alt}, best.options());
  auto probs = torch::empty({t, 1 + n_alt}, scores.options());
  const float* sp = scores.data_ptr<float>();
  const int64_t* bp = best.data_ptr<int64_t>();
  int64_t* op = others.data_ptr<int64_t>();
  float* pp = probs.data_ptr<float>();
  for (int64_t r = 0; r < t; ++r) {
    const float* v = sp + r * scores.stride(0);
    const int64_t b = bp[r];
    TORCH_CHECK(b >= 0 && b < n, "runner_ups: best index out of range");
    const float m = v[b];
    // sum of exp(v - m): 1 for the best itself.
    __m256 acc = _mm256_setzero_ps();
    const __m256 vm = _mm256_set1_ps(m);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8)
      acc = _mm256_add_ps(acc, layer_ops::exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(v + i), vm)));
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, acc);
    double z = 0.0;
    for (int l = 0; l < 8; ++l) z += lanes[l];
    for (; i < n; ++i) z += std::exp(static_cast<double>(v[i]) - m);
    const bool ok = std::isfinite(m) && std::isfinite(z) && z >= 1.0 - 1e-3;
    pp[r * (1 + n_alt)] = ok ? static_cast<float>(1.0 / z) : 0.f;
    int64_t picked[9] = {b};  // ascending once sorted; the row's excluded indices
    int64_t num = 1;
    for (int64_t a = 0; a < n_alt; ++a) {
      int64_t sorted[9];
      std::copy(picked, picked + num, sorted);
      std::sort(sorted, sorted + num);
      // The largest value outside the picked indices, then its first index there.
      float top = -INFINITY;
      int64_t lo = 0;
      for (int64_t e = 0; e <= num; ++e) {
        const int64_t hi = e < num ? sorted[e] : n;
        if (hi > lo) top = std::max(top, row_max(v + lo, hi - lo));
        lo = (e < num ? sorted[e] : n) + 1;
      }
      int64_t j = n;
      lo = 0;
      for (int64_t e = 0; e <= num && j == n; ++e) {
        const int64_t hi = e < num ? sorted[e] : n;
        if (hi > lo) {
          const int64_t f = first_equal(v, lo, hi, top);
          if (f < hi) j = f;
        }
        lo = hi + 1;
      }
      const bool found = j < n;
      op[r * n_alt + a] = found ? j : b;
      pp[r * (1 + n_alt) + 1 + a] = ok && found ? static_cast<float>(std::exp(static_cast<double>(top) - m) / z) : 0.f;
      if (found) picked[num++] = j;
    }
  }
  return {others, probs};
}

// Top-p alone on a row whose candidates are few (a language model's usual, peaked row): every
// token of the nucleus has probability >= (1 - p) / V — the tokens below that hold less than
// 1 - p in all, so the ones above already reach p — so only those are sorted. Writes the row
// and returns true; false (nothing written) when there are too many to sort directly, with ev
// (exp(l - max) of every token), their sum z and that floor left for nucleus_of_flat_row.
inline bool nucleus_of_peaked_row(const float* l, int64_t v, float m, double p, float* ev, double& z,
                                  float& floor, std::vector<std::pair<float, int64_t>>& cand, float* o) {
  const __m256 vm = _mm256_set1_ps(m);
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= v; i += 8) {
    const __m256 e = layer_ops::exp_nonpositive(_mm256_sub_ps(_mm256_loadu_ps(l + i), vm));
    _mm256_storeu_ps(ev + i, e);
    acc = _mm256_add_ps(acc, e);
  }
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, acc);
  z = 0.0;
  for (int j = 0; j < 8; ++j) z += lanes[j];
  for (; i < v; ++i) {
    alignas(32) float one[8] = {l[i] - m, 0, 0, 0, 0, 0, 0, 0};
    _mm256_store_ps(one, layer_ops::exp_nonpositive(_mm256_load_ps(one)));
    ev[i] = l[i] == -INFINITY ? 0.f : one[0];
    z += ev[i];
  }
  // Half the bound (rounding): candidates are kept generously, the walk below decides.
  floor = static_cast<float>(0.5 * (1.0 - p) * z / v);
  const __m256 vf = _mm256_set1_ps(floor);
  cand.clear();
  for (i = 0; i + 8 <= v; i += 8) {
    int mask = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(ev + i), vf, _CMP_GE_OQ));
    while (mask != 0) {
      const int j = __builtin_ctz(mask);
      mask &= mask - 1;
      if (l[i + j] != -INFINITY) cand.emplace_back(l[i + j], i + j);
    }
    if (cand.size() > kSortDirectly) return false;
  }
  for (; i < v; ++i)
    if (ev[i] >= floor && l[i] != -INFINITY) cand.emplace_back(l[i], i);
  if (cand.size() > kSortDirectly) return false;
  sort_largest_first(cand);
  std::fill_n(o, v, -INFINITY);
  keep_nucleus(cand, ev, 0.0, false, p * z, o);
  return true;
}

// Top-p alone on a flat row (too many candidates to sort: a near-uniform distribution, a high
// temperature), from nucleus_of_peaked_row's ev, z and floor. Tokens below the floor can be
// neither in the nucleus nor above one of its tokens, so only the others are binned, by the top
// bits of their fp32 exp(l - max) (exponent and 5 mantissa bits: ~3 %-wide bins, ordered as the
// values are, hence as the logits): the bins above the one where the running mass reaches top_p
// are kept whole, and only that one's tokens are sorted and walked. Reusing ev (no second exp),
// binning by bits and finding the kept tokens by vector compares make this about half the cost of
// the logit-distance histogram the top-k path uses, on flat rows.
constexpr int kValueShift = 18;  // fp32 bits >> 18: sign 0, 8 exponent bits, 5 mantissa bits
constexpr int kValueBins = 1 << (31 - kValueShift);

inline void nucleus_of_flat_row(const float* l, int64_t v, double p, const float* ev, double z, float floor,
                                std::vector<int32_t>& count, std::vector<double>& mass,
                                std::vector<std::pair<float, int64_t>>& cand, float* o) {
  const auto key = [](float e) {
    uint32_t bits;
    std::memcpy(&bits, &e, sizeof bits);
    return static_cast<int32_t>(bits >> kValueShift);
  };
  if (count.size() < static_cast<size_t>(kValueBins)) {  // sized on a thread's first flat row
    count.resize(kValueBins);
    mass.resize(kValueBins);
  }
  const int32_t lo = key(std::max(floor, std::numeric_limits<float>::min())), hi = key(1.f);
  std::fill(count.begin() + lo, count.begin() + hi + 1, 0);
  std::fill(mass.begin() + lo, mass.begin() + hi + 1, 0.0);
  const __m256 vf = _mm256_set1_ps(floor);
  int64_t i = 0;
  const auto add = [&](int64_t t) {
    const int32_t b = key(ev[t]);
    ++count[b];
    mass[b] += ev[t];
  };
  for (; i + 8 <= v; i += 8) {
    int bits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(ev + i), vf, _CMP_GE_OQ));
    while (bits != 0) {
      add(i + __builtin_ctz(bits));
      bits &= bits - 1;
    }
  }
  for (; i < v; ++i)
    if (ev[i] >= floor) add(i);
  // From the top bin down to the one where the running mass reaches top_p.
  double above = 0.0;
  int32_t boundary = lo;
  for (int32_t b = hi; b >= lo; --b) {
    if (above + mass[b] >= p * z) {
      boundary = b;
      break;
    }
    above += mass[b];
  }
  // Tokens in higher bins are kept whole; the boundary bin's are the candidates.
  uint32_t edge_bits = static_cast<uint32_t>(boundary + 1) << kValueShift, low_bits = static_cast<uint32_t>(boundary) << kValueShift;
  float edge, low;
  std::memcpy(&edge, &edge_bits, sizeof edge);
  std::memcpy(&low, &low_bits, sizeof low);
  const __m256 ve = _mm256_set1_ps(edge), vl = _mm256_set1_ps(std::max(low, floor));
  std::fill_n(o, v, -INFINITY);
  cand.clear();
  for (i = 0; i + 8 <= v; i += 8) {
    const __m256 e = _mm256_loadu_ps(ev + i);
    int whole = _mm256_movemask_ps(_mm256_cmp_ps(e, ve, _CMP_GE_OQ));
    int in_bin = _mm256_movemask_ps(_mm256_cmp_ps(e, vl, _CMP_GE_OQ)) & ~whole;
    while (whole != 0) {
      const int j = __builtin_ctz(whole);
      whole &= whole - 1;
      o[i + j] = l[i + j];
    }
    while (in_bin != 0) {
      const int j = __builtin_ctz(in_bin);
      in_bin &= in_bin - 1;
      cand.emplace_back(l[i + j], i + j);
    }
  }
  for (; i < v; ++i) {
    if (ev[i] >= edge) o[i] = l[i];
    else if (ev[i] >= std::max(low, floor)) cand.emplace_back(l[i], i);
  }
  sort_largest_first(cand);
  keep_nucleus(cand, ev, above, above > 0.0, p * z, o);
}

inline torch::Tensor top_k_top_p(const torch::Tensor& logits, const torch::Tensor& top_k, const torch::Tensor& top_p) {
  TORCH_CHECK(logits.dim() == 2 && logits.size(1) > 0, "top_k_top_p: logits [T, V] expected");
  const int64_t t = logits.size(0), v = logits.size(1);
  layer_ops::check_rows(logits, v, "top_k_top_p");
  TORCH_CHECK(top_k.scalar_type() == torch::kLong && top_k.is_contiguous() && top_k.numel() == t,
              "top_k_top_p: top_k int64 [T] expected");
  TORCH_CHECK(top_p.scalar_type() == torch::kFloat32 && top_p.is_contiguous() && top_p.numel() == t,
              "top_k_top_p: top_p float32 [T] expected");
  auto out = torch::empty({t, v}, logits.options());
  const float* lp = logits.data_ptr<float>();
  const int64_t* kp = top_k.data_ptr<int64_t>();
  const float* pp = top_p.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t stride = logits.stride(0);
  at::parallel_for(0, t, 1, [&](int64_t r0, int64_t r1) {
    std::vector<int64_t> count(kHistBins);
    std::vector<double> value_mass;  // nucleus_of_flat_row's bins (peaked rows never touch them)
    std::vector<int32_t> value_count;
    std::vector<int32_t> bin(v);
    std::vector<float> ev(v);  // exp(logit - max): the mass the bins sum and the walk adds
    std::vector<std::pair<float, int64_t>> cand;  // (logit, index)
    for (int64_t r = r0; r < r1; ++r) {
      const float* l = lp + r * stride;
      float* o = op + r * v;
      const int64_t k = kp[r] > 0 && kp[r] < v ? kp[r] : v;
      const double p = pp[r];
      float m = row_max(l, v);
      if ((k == v && !(p < 1.0)) || !std::isfinite(m)) {  // nothing to filter (or nothing finite)
        std::copy_n(l, v, o);
        continue;
      }
      if (k == v) {  // top-p alone
        double z = 0.0;
        float floor = 0.f;
        if (!nucleus_of_peaked_row(l, v, m, p, ev.data(), z, floor, cand, o))
          nucleus_of_flat_row(l, v, p, ev.data(), z, floor, value_count, value_mass, cand, o);
        continue;
      }
      // Bins by distance below the max, and each token's exp(l - max) (8 at a time); -inf tokens
      // (masked) in no bin: they stay -inf whatever is kept.
      std::fill(count.begin(), count.end(), 0);
      const __m256 vm = _mm256_set1_ps(m), last_bin = _mm256_set1_ps(kHistBins - 1);
      const __m256 per_nat = _mm256_set1_ps(kHistBins / kHistNats);
      for (int64_t i = 0; i < v; i += 8) {
        alignas(32) float chunk[8];
        const int64_t n = std::min<int64_t>(8, v - i);
        std::fill_n(chunk, 8, -INFINITY);
        std::copy_n(l + i, n, chunk);
        const __m256 x = _mm256_load_ps(chunk);
        alignas(32) float e8[8];
        alignas(32) int32_t b8[8];
        _mm256_store_ps(e8, layer_ops::exp_nonpositive(_mm256_sub_ps(x, vm)));
        const __m256 below = _mm256_min_ps(_mm256_mul_ps(_mm256_sub_ps(vm, x), per_nat), last_bin);
        _mm256_store_si256(reinterpret_cast<__m256i*>(b8), _mm256_cvttps_epi32(below));
        for (int64_t j = 0; j < n; ++j) {
          ev[i + j] = e8[j];
          if (chunk[j] == -INFINITY) {
            bin[i + j] = -1;
            continue;
          }
          bin[i + j] = b8[j];
          ++count[b8[j]];
        }
      }
      // Top-k: the bin where the running count reaches k; the tokens down to it are the
      // candidates, sorted (largest first, lower index on ties), cut to exactly k.
      int32_t last = kHistBins - 1;
      int64_t seen = 0;
      for (int32_t b = 0; b < kHistBins; ++b)
        if ((seen += count[b]) >= k) {
          last = b;
          break;
        }
      cand.clear();
      std::fill_n(o, v, -INFINITY);
      for (int64_t i = 0; i < v; ++i)
        if (bin[i] >= 0 && bin[i] <= last) cand.emplace_back(l[i], i);
      sort_largest_first(cand);
      cand.resize(std::min<size_t>(cand.size(), k));
      if (!(p < 1.0)) {  // top-k alone
        for (const auto& c : cand) o[c.second] = c.first;
        continue;
      }
      // Top-p over the k kept, renormalised among them.
      double z = 0.0;
      for (const auto& c : cand) z += ev[c.second];
      keep_nucleus(cand, ev.data(), 0.0, false, p * z, o);
    }
  });
  return out;
}

// One token per row of probs [T, V] (>= 0, unnormalised) for u [T] uniform in [0, 1): the first
// index whose running sum (fp64, in index order) exceeds u · total, the inverse CDF. The total is
// summed in the same order, so the walk always ends inside the row, and a token of probability 0
// is never drawn. One random number per row: exponential-race sampling draws one per token, and
// PyTorch's CPU exponential_ costs 1.4 ms for a 49k row, 38 ms for 32 (a decode step's worth).
inline torch::Tensor sample_rows(const torch::Tensor& probs, const torch::Tensor& u) {
  TORCH_CHECK(probs.dim() == 2 && probs.size(1) > 0, "sample_rows: probs [T, V] expected");
  const int64_t t = probs.size(0), v = probs.size(1);
  layer_ops::check_rows(probs, v, "sample_rows");
  TORCH_CHECK(u.scalar_type() == torch::kFloat64 && u.is_contiguous() && u.numel() == t,
              "sample_rows: u float64 [T] expected");
  auto out = torch::empty({t}, probs.options().dtype(torch::kLong));
  const float* pp = probs.data_ptr<float>();
  const double* up = u.data_ptr<double>();
  int64_t* op = out.data_ptr<int64_t>();
  const int64_t stride = probs.stride(0);
  at::parallel_for(0, t, 1, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const float* p = pp + r * stride;
      double total = 0.0;
      for (int64_t i = 0; i < v; ++i) total += p[i];
      const double x = up[r] * total;
      double run = 0.0;
      int64_t pick = 0;  // a row of zeros (nothing to draw): token 0, as an argmax would give
      for (int64_t i = 0; i < v; ++i) {
        run += p[i];
        if (run > x) {
          pick = i;
          break;
        }
      }
      op[r] = pick;
    }
  });
  return out;
}

}  // namespace sampling_ops
