// The memory roofline of a fused Adam step: a kernel with exactly Adam's traffic and almost no
// arithmetic. It reads p, g, m, v and updates p, m, v in place (28 bytes per parameter):
//   m = m * 0.5 + g;  v = v * 0.5 + g;  p = p + g
// and, when `out` is set, also writes a 2-byte copy of p (30 bytes per parameter), with plain
// or non-temporal stores.
//
// With bf16 moments (the *_bf16_moments versions) m and v are 2-byte values, widened, updated
// the same way and truncated back: 20 bytes per parameter (22 with the copy-out).
#pragma once

#include <cstddef>
#include <cstdint>

namespace outcore::bench {

using RooflineFn = void (*)(size_t n, float* p, const float* g, float* m, float* v, uint16_t* out,
                            bool stream_out);

// AVX-512 version (needs AVX-512 F/BW); AVX2 version.
void roofline_avx512(size_t n, float* p, const float* g, float* m, float* v, uint16_t* out,
                     bool stream_out);
void roofline_avx2(size_t n, float* p, const float* g, float* m, float* v, uint16_t* out,
                   bool stream_out);

using RooflineBf16MomentsFn = void (*)(size_t n, float* p, const float* g, uint16_t* m, uint16_t* v,
                                       uint16_t* out, bool stream_out);

void roofline_bf16_moments_avx512(size_t n, float* p, const float* g, uint16_t* m, uint16_t* v,
                                  uint16_t* out, bool stream_out);
void roofline_bf16_moments_avx2(size_t n, float* p, const float* g, uint16_t* m, uint16_t* v,
                                uint16_t* out, bool stream_out);

}  // namespace outcore::bench
