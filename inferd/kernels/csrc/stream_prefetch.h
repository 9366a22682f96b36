// How the kernels prefetch a weight they stream once a step (a model's fp32 rows in dense_gemv.h,
// its packed tiles in int8_dot.h), chosen at run time: which hint wins depends on the CPU's
// caches, not on the code.
//
// - kL2 (AMD's default): into L2 only (prefetcht1). The rows of x a few-row pass reads for every
//   weight row (a verification step's 2-4 rows: up to 4 x 6.5 KB for the default model's down
//   projection) stay in L1, the weights reach it from L2 by plain loads, and the stream's
//   lookahead no longer competes with them for L1's 32 KB. On a Zen 4 EPYC (AVX512-BF16, 32 MB
//   L3, 2 vCPUs; 2 Dec, session 27), the default model's fp32 weights streamed by dense_linear,
//   the hints alternated in one process: 4 rows took 1.01-1.18x a 1-row pass against
//   1.25-1.40x with kNta, the 1-row pass itself as fast or faster; in the engine's fused step
//   3 verified drafts cost 0.20 of a plain step against 0.91 with kNta (the layers 15.7 against
//   25.3 ms). The GGUF's int4 tiles ran the same under either.
// - kNta: non-temporal. On AMD's victim L3 the lines bypass it, so a 538 MB fp32 stream no
//   longer evicts what the step reuses (the KV cache, a draft head); see dense::kPrefetchFloats
//   for the figures. At one row it was AMD's best before kL2; at 4 rows its lines in L1 crowd
//   out the rows of x.
// - kT0 (everyone else's default) / kOff: on an Intel Xeon (Emerald Rapids, 260 MB shared L3,
//   2 vCPUs; 2 Dec, batch 1, alternated in one process) NTA held the fp32 decode to 16.7 tok/s
//   against 31.7 with T0 (30.6 with no prefetch), and the GGUF's int4 tiles to 104 against 161
//   (122). kL2 was not measured there.
//
// One process-wide setting (`set_stream_prefetch`), read on every prefetch: a branch the
// predictor always gets right, next to a memory stream.
#pragma once

#include <immintrin.h>

namespace stream_prefetch {

enum Hint : int { kNta = 0, kT0 = 1, kOff = 2, kL2 = 3 };

inline int& hint() {
  static int h = kNta;
  return h;
}

inline void line(const void* p) {
  switch (hint()) {
    case kNta: _mm_prefetch(static_cast<const char*>(p), _MM_HINT_NTA); break;
    case kT0: _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T0); break;
    case kL2: _mm_prefetch(static_cast<const char*>(p), _MM_HINT_T1); break;
    default: break;
  }
}

}  // namespace stream_prefetch
