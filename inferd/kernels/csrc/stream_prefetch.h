// How the kernels prefetch a weight they stream once a step (a model's fp32 rows in dense_gemv.h,
// its packed tiles in int8_dot.h), chosen at run time: which hint wins depends on the CPU's
// caches, not on the code.
//
// - kNta (AMD's default): non-temporal. On AMD's victim L3 the lines bypass it, so a 538 MB
//   fp32 stream no longer evicts what the step reuses (the KV cache, a draft head); see
//   dense::kPrefetchFloats for the figures.
// - kT0 (everyone else's default) / kOff: on an Intel Xeon (Emerald Rapids, 260 MB shared L3,
//   2 vCPUs; 2 Dec, batch 1, alternated in one process) NTA held the fp32 decode to 16.7 tok/s
//   against 31.7 with T0 (30.6 with no prefetch), and the GGUF's int4 tiles to 104 against 161
//   (122).
//
// One process-wide setting (`set_stream_prefetch`), read on every prefetch: a branch the
// predictor always gets right, next to a memory stream.
#pragma once

#include <immintrin.h>

namespace stream_prefetch {

enum Hint : int { kNta = 0, kT0 = 1, kOff = 2 };

inline int& hint() {
  static int h = kNta;
  return h;
}

inline void line(const void* p) {
  switch (hint()) {
    case kNta: _mm_prefetch(static_cast<const char*>(p), _MM_HINT_NTA); break;
    case kT0: _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); break;
    default: break;
  }
}

}  // namespace stream_prefetch
