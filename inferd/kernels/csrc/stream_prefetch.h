// How the kernels prefetch a weight they stream once a step (a model's fp32 rows in dense_gemv.h,
// its packed tiles in int8_dot.h), chosen at run time: which hint wins depends on the CPU's
// caches, not on the code.
//
// - kL2Rows (AMD's default): fp32 rows read for several rows of x at once (a verification
//   step's 2-4 rows, a small batch) into L2 only (prefetcht1, as kL2); everything else
//   non-temporally (as kNta: one-row decodes, the packed tiles).
//   Why: the rows of x a few-row pass reads for every weight row (up to 4 x 6.5 KB for the default
//   model's down projection) then stay in L1, the weights reach it from L2 by plain loads, and
//   the stream's lookahead no longer competes with them for L1's 32 KB; on a Zen 4 EPYC this is
//   what makes verifying a few drafts cost a small fraction of a plain step. One-row decodes and
//   the tiles gain nothing from L2, and kNta keeps their stream out of L3.
// - kL2: every streamed weight into L2.
// - kNta: non-temporal. On AMD's victim L3 the lines bypass it, so a 538 MB fp32 stream does not
//   evict what the step reuses (the KV cache, a draft head); see dense::kPrefetchFloats. At 4
//   rows of x its lines in L1 crowd those rows out, hence kL2Rows.
// - kT0 (everyone else's default) / kOff: on an Intel Xeon (Emerald Rapids) the fp32 decode and
//   the GGUF's int4 tiles run markedly slower with NTA than with T0, and T0 is also ahead of no
//   prefetch at all.
//
// One process-wide setting (`set_stream_prefetch`), read on every prefetch: a branch the
// predictor always gets right, next to a memory stream.
#pragma once

#include <immintrin.h>

namespace stream_prefetch {

enum Hint : int { kNta = 0, kT0 = 1, kOff = 2, kL2 = 3, kL2Rows = 4 };

inline int& hint() {
  static int h = kNta;
  return h;
}

inline void fetch(const void* p, int h) {
  switch (h) {
    case kNta: _mm_prefetch(static_cast<const char*>(p), _MM_HINT_NTA); break;
    case kT0: _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); break;
    case kL2: _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); break;
    default: break;
  }
}

// A streamed weight read by one row of activations at a time (the packed tiles' path); kL2Rows
// prefetches these non-temporally.
inline void line(const void* p) {
  const int h = hint();
  fetch(p, h == kL2Rows ? kNta : h);
}

// A streamed fp32 weight row read for `rows` rows of x at once (dense_gemv.h's row_dots).
inline void line_rows(const void* p, int rows) {
  const int h = hint();
  fetch(p, h == kL2Rows ? (rows > 1 ? kL2 : kNta) : h);
}

}  // namespace stream_prefetch
