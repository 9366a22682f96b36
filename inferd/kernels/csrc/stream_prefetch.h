// How the kernels prefetch a weight they stream once a step (a model's fp32 rows in dense_gemv.h,
// its packed tiles in int8_dot.h), chosen at run time: which hint wins depends on the CPU's
// caches, not on the code.
//
// - kNta (AMD's default): non-temporal. On AMD's victim L3 the lines bypass it, so a 538 MB
//   fp32 stream no longer evicts what the step reuses (the KV cache, a draft head); see
//   dense::kPrefetchFloats for the figures.
// - kT0 / kOff: on an Intel Xeon (Emerald Rapids, 260 MB shared L3, 2 vCPUs; 2 Dec) the NTA
//   prefetch held the fp32 decode to ~11 GB/s against ~31 GB/s the same kernel reads one long
//   matrix at, and the int4 tiles' 92 MB to 1/1.3 of their speed with no prefetch at all.
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
