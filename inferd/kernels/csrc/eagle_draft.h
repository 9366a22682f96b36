// A learned draft head's greedy chains (inferd/spec/eagle_head.py `EagleHead.draft`) in one call:
// the head's layer, its attention over each sequence's own cache, the draft vocabulary's scores
// and the next input, k times.
//
// Why: a k = 3 chain is ~100 ATen calls from Python, run right after the target's forward has
// swept every cache, so the interpreter's own state comes back from memory too; speculation's own
// time is what its speedup loses. Why op for op: the same kernels in the same order as the Python
// chain (the tiles' int8-activation matmuls, paged attention, layer_ops.h, argmax_rows) give the
// same bits, so drafts never depend on the path; tests/test_eagle_head.py checks it.
#pragma once

#include <torch/extension.h>

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "decoder_layers.h"
#include "layer_ops.h"
#include "paged_attention.h"
#include "quant_gemm.h"
#include "sampling_ops.h"

namespace eagle {

struct HeadWeights {
  torch::Tensor hidden_norm, embed_norm, attn_norm, mlp_norm, out_norm;  // RMSNorm weights [H]
  decoder::LinearWeights fc, qkv, o, gate_up, down;
  decoder::LinearWeights vocab;  // the draft vocabulary's rows of the target's LM head
  torch::Tensor vocab_ids;       // int64 [V']: the token of each row
  // The target's embedding, as a linear's weights: an fp32 table [V, H] (kFloat), packed tiles, or
  // the row layout's int8 / int4 / fp8 blocks (an AVX2-only CPU keeps a quantized table so).
  decoder::LinearWeights embed;
  // The target's fp32 LM head [V, H] where `vocab` holds its rows quantized (an fp32 target):
  // the close candidates of each draft step are rescored against it (`rescore_close`); undefined:
  // the vocab rows are the target's own.
  torch::Tensor exact;
  double exact_within = 0.0;
  int64_t exact_max = 0;
};

// Each row of scores [B, V'] (the draft vocabulary's int4 scores of features [B, H]): the entries
// within `within` of the row's max (at most `max_candidates`, the largest; ties to the lower
// index) replaced by the exact score, the feature against the target's fp32 LM head row of that
// token (`exact` [V, H], `ids` [V'] the token of each entry), by the fp32 matrix-vector kernel's
// own dot (dense_gemv.h: the same bits as the target's logits). Why: int4 rounding moves a score
// by up to ~1.7 (the default model's head), enough to swap close tokens and so to draft a token
// the target would not pick; rescoring costs a few rows of 2.3 KB a step and lengthens the
// accepted runs. Rows whose max is not finite are left as they are.
inline void rescore_close(const torch::Tensor& scores, const torch::Tensor& feature, const torch::Tensor& ids,
                          const torch::Tensor& exact, double within, int64_t max_candidates) {
  TORCH_CHECK(scores.dim() == 2 && scores.scalar_type() == torch::kFloat32 && scores.stride(1) == 1 &&
                  feature.dim() == 2 && feature.size(0) == scores.size(0) && feature.stride(1) == 1 &&
                  feature.scalar_type() == torch::kFloat32 && ids.scalar_type() == torch::kInt64 &&
                  ids.is_contiguous() && ids.numel() == scores.size(1) && exact.dim() == 2 &&
                  exact.is_contiguous() && exact.scalar_type() == torch::kFloat32 &&
                  exact.size(1) == feature.size(1),
              "rescore_close: fp32 scores [B, V'], features [B, H], int64 ids [V'], fp32 table [V, H]");
  const int64_t b = scores.size(0), n = scores.size(1), h = feature.size(1), vocab = exact.size(0);
  const int64_t* idp = ids.data_ptr<int64_t>();
  const float* table = exact.data_ptr<float>();
  std::vector<std::pair<float, int64_t>> close;
  for (int64_t r = 0; r < b; ++r) {
    float* v = scores.data_ptr<float>() + r * scores.stride(0);
    const float m = sampling_ops::row_max(v, n);
    if (!std::isfinite(m)) continue;
    const float floor = m - static_cast<float>(within);
    const __m256 lo = _mm256_set1_ps(floor);
    close.clear();
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
      int bits = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(v + i), lo, _CMP_GE_OQ));
      for (; bits != 0; bits &= bits - 1) {
        const int64_t j = i + __builtin_ctz(bits);
        close.emplace_back(v[j], j);
      }
    }
    for (; i < n; ++i)
      if (v[i] >= floor) close.emplace_back(v[i], i);
    if (static_cast<int64_t>(close.size()) > max_candidates) {
      const auto before = [](const auto& a, const auto& c) {
        return a.first > c.first || (a.first == c.first && a.second < c.second);
      };
      std::partial_sort(close.begin(), close.begin() + max_candidates, close.end(), before);
      close.resize(max_candidates);
    }
    const float* x = feature.data_ptr<float>() + r * feature.stride(0);
    for (const auto& c : close) {
      const int64_t token = idp[c.second];
      TORCH_CHECK(token >= 0 && token < vocab, "rescore_close: token id out of range");
      dense::row_dots<1>(x, h, table + token * h, h, v + c.second, 0, 0.f, false);
    }
  }
}

// The embedding's rows of `tokens` [T] as fp32 [T, H], by inferd/quantization/formats.py
// `dequantize_rows`'s own operations (ATen's, in its order: the row layout's int4 is q * scale,
// then + min, each rounded), so both paths give the same bits.
inline torch::Tensor embedding_rows(const decoder::LinearWeights& e, const torch::Tensor& tokens) {
  using K = decoder::LinearWeights;
  if (e.kind == K::kFloat) return e.weight.index_select(0, tokens);
  if (e.kind == K::kTiles)
    return quant_gemm::tiles_rows(e.weight, e.scales, e.mins.defined() ? e.mins : torch::empty({0}), tokens);
  const auto expand = [&](const torch::Tensor& groups) {
    return groups.index_select(0, tokens).to(torch::kFloat32).repeat_interleave(e.group, 1);
  };
  const torch::Tensor data = e.weight.index_select(0, tokens);
  if (e.kind == K::kInt8) return data.to(torch::kFloat32) * expand(e.scales);
  if (e.kind == K::kFp8) return data.view(torch::kFloat8_e4m3fn).to(torch::kFloat32) * expand(e.scales);
  TORCH_CHECK(e.kind == K::kInt4 && e.mins.defined(), "embedding_rows: an fp32, tiles, int8, int4 or fp8 table");
  const torch::Tensor blocks = data.reshape({data.size(0), -1, 16});  // formats.unpack_int4
  const torch::Tensor q = torch::cat({blocks.bitwise_and(0x0F), blocks.bitwise_right_shift(4)}, 2);
  return q.reshape({data.size(0), -1}).to(torch::kFloat32) * expand(e.scales) + expand(e.mins);
}

// EagleHead.inputs: the layer's input from a feature (the target's hidden state, or the head's
// prediction of it) and the embedding of the token after it.
inline torch::Tensor inputs(const HeadWeights& w, const decoder::Shape& s, const torch::Tensor& feature,
                            const torch::Tensor& tokens) {
  const torch::Tensor e = embedding_rows(w.embed, tokens);
  return decoder::linear(w.fc, torch::cat({layer_ops::rms_norm(feature, w.hidden_norm, s.eps),
                                           layer_ops::rms_norm(e, w.embed_norm, s.eps)}, -1), s);
}

// EagleHead.qkv_of: rotated queries [T, NH, D], keys [T, KVH, D] and values [T, KVH, D] of x at
// `pos`; cos / sin [P, D]: the full-width rotary tables over every position reached.
inline std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> qkv_of(const HeadWeights& w, const decoder::Shape& s,
                                                                      const torch::Tensor& x, const torch::Tensor& pos,
                                                                      const torch::Tensor& cos_table,
                                                                      const torch::Tensor& sin_table) {
  const int64_t nh = s.n_heads, nkv = s.n_kv, d = s.head_dim;
  const torch::Tensor qkv = decoder::linear(w.qkv, layer_ops::rms_norm(x, w.attn_norm, s.eps), s);
  const torch::Tensor cos = cos_table.index_select(0, pos).unsqueeze(-2);
  const torch::Tensor sin = sin_table.index_select(0, pos).unsqueeze(-2);
  const torch::Tensor qk = layer_ops::rotary(qkv.narrow(1, 0, (nh + nkv) * d).view({-1, nh + nkv, d}), cos, sin);
  return {qk.narrow(1, 0, nh), qk.narrow(1, nh, nkv), qkv.narrow(1, (nh + nkv) * d, nkv * d).view({-1, nkv, d})};
}

// EagleHead.cache_entries: (x, keys, values) of true positions, for DraftCache.
inline std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> cache_entries(
    const HeadWeights& w, const decoder::Shape& s, const torch::Tensor& hidden, const torch::Tensor& next_tokens,
    const torch::Tensor& pos, const torch::Tensor& cos_table, const torch::Tensor& sin_table) {
  const torch::Tensor x = inputs(w, s, hidden, next_tokens);
  auto [q, k, v] = qkv_of(w, s, x, pos, cos_table, sin_table);
  return {x, k, v};
}

// inferd/spec/draft_tree.py's stopping rule: after `depth` steps, a chain whose drafts' path
// probabilities are c_1 >= ... >= c_depth, with alternatives (runner-up, third) at each depth,
// can gain no deeper node in its k likeliest when its depth chain nodes and the alternatives
// above c_depth are k or more (a deeper node is worth at most c_depth, and loses ties to the
// chain's shallower nodes). path[i], leaves[i]: each chain's c_depth and alternatives' values so
// far, updated here with this step's probabilities p [B, 1 + alternatives] (in double, as
// ranked_nodes computes them).
inline bool chains_settled(const torch::Tensor& p, int64_t depth, int64_t k, std::vector<double>& path,
                           std::vector<std::vector<double>>& leaves) {
  const float* pp = p.data_ptr<float>();
  const int64_t width = p.size(1);
  bool all = true;
  for (size_t i = 0; i < path.size(); ++i) {
    for (int64_t a = 1; a < width; ++a) leaves[i].push_back(path[i] * static_cast<double>(pp[width * i + a]));
    path[i] *= static_cast<double>(pp[width * i]);
    int64_t count = depth;
    for (const double v : leaves[i]) count += v > path[i];
    all = all && count >= k;
  }
  return all;
}

// A ranked chain's alternatives at each depth (EagleHead.ALTERNATIVES): the runner-up and the
// third likeliest token. A tree that may also branch on the third accepts slightly more tokens per
// verification than one branching on runners-up only, for the same k rows.
constexpr int64_t kAlternatives = 2;

// x [B, H]: each chain's first input (DraftCache.x_last); pos [B] int64: its position. k_bufs /
// v_bufs [cap, KVH, D] each sequence's cache buffers, `used` the true rows in them (room reserved
// for k more).
// Returns the drafted tokens [B, k]; the chains' own keys and values are left in the buffers.
// With `confidences`, also each step's next likeliest tokens after the drafted one [B, k, A]
// (runner-up, third: kAlternatives) and the draft vocabulary's softmax probabilities of the
// drafted token and of those [B, k, 1 + A] (EagleHead.draft's); else those two are empty. With
// `confidences` the chains also stop once no deeper draft can be among any chain's k likeliest
// nodes (`chains_settled`): the three come back narrower.
inline std::tuple<torch::Tensor, torch::Tensor, torch::Tensor> draft_chains(
    const HeadWeights& w, const decoder::Shape& s, torch::Tensor x, torch::Tensor pos,
    const std::vector<torch::Tensor>& k_bufs, const std::vector<torch::Tensor>& v_bufs,
    const std::vector<int64_t>& used, const torch::Tensor& cos_table, const torch::Tensor& sin_table,
    int64_t k, bool confidences) {
  const int64_t b = x.size(0), nh = s.n_heads, d = s.head_dim;
  TORCH_CHECK(static_cast<int64_t>(k_bufs.size()) == b && static_cast<int64_t>(v_bufs.size()) == b &&
                  static_cast<int64_t>(used.size()) == b && pos.numel() == b,
              "draft_chains: one cache and one position per chain");
  auto tokens = torch::empty({b, k}, torch::kInt64);
  torch::Tensor alternatives, probs;
  if (confidences) {
    alternatives = torch::empty({b, k, kAlternatives}, torch::kInt64);
    probs = torch::empty({b, k, 1 + kAlternatives}, torch::kFloat32);
  }
  const auto longs = torch::TensorOptions().dtype(torch::kInt64);
  const torch::Tensor zero = torch::zeros({1}, longs), one = torch::ones({1}, longs);
  const torch::Tensor table = torch::zeros({1, 1}, longs);  // each cache is one block of its own
  std::vector<double> path(b, 1.0);
  std::vector<std::vector<double>> leaves(b);
  int64_t steps = k;
  for (int64_t step = 0; step < k; ++step) {
    auto [q_rows, kk, vv] = qkv_of(w, s, x, pos, cos_table, sin_table);
    if (step > 0)  // each chain's key and value from its previous step, after the true ones
      for (int64_t i = 0; i < b; ++i) {
        const int64_t n = used[i] + step;
        k_bufs[i][n - 1].copy_(kk[i]);
        v_bufs[i][n - 1].copy_(vv[i]);
      }
    const torch::Tensor q = q_rows.contiguous();
    torch::Tensor attn = torch::empty({b, nh, d});
    for (int64_t i = 0; i < b; ++i)
      paged_attn::paged_attention_short(q.narrow(0, i, 1), k_bufs[i].unsqueeze(0), v_bufs[i].unsqueeze(0), zero,
                                        one, torch::full({1}, used[i] + step, longs), table,
                                        attn.narrow(0, i, 1), s.scale);
    // finish
    torch::Tensor y, h;
    std::tie(y, h) = layer_ops::add_rms_norm(x, decoder::linear(w.o, attn.reshape({b, nh * d}), s), w.mlp_norm, s.eps);
    const torch::Tensor mlp = decoder::linear(w.down, layer_ops::silu_mul(decoder::linear(w.gate_up, h, s)), s);
    const torch::Tensor feature = std::get<1>(layer_ops::add_rms_norm(y, mlp, w.out_norm, s.eps));
    // greedy, over the draft vocabulary
    const torch::Tensor scores = decoder::linear(w.vocab, feature, s);
    if (w.exact.defined()) rescore_close(scores, feature, w.vocab_ids, w.exact, w.exact_within, w.exact_max);
    const torch::Tensor best = sampling_ops::argmax_rows(scores);
    const torch::Tensor tok = w.vocab_ids.index_select(0, best);
    tokens.select(1, step).copy_(tok);
    if (confidences) {
      const auto [alts, p] = sampling_ops::runner_ups(scores, best, kAlternatives);
      const torch::Tensor alt_tokens = w.vocab_ids.index_select(0, alts.reshape({-1}));
      alternatives.select(1, step).copy_(alt_tokens.view({b, kAlternatives}));
      probs.select(1, step).copy_(p);
      if (step + 1 < k && chains_settled(p, step + 1, k, path, leaves)) {
        steps = step + 1;
        break;
      }
    }
    if (step + 1 < k) {  // the predicted feature beside the drafted token's embedding
      x = inputs(w, s, feature, tok);
      pos = pos + 1;
    }
  }
  if (steps < k)
    return {tokens.narrow(1, 0, steps), alternatives.narrow(1, 0, steps), probs.narrow(1, 0, steps)};
  return {tokens, alternatives, probs};
}

}  // namespace eagle
