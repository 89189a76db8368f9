// AVX-512 roofline kernel (see roofline.hpp). Compiled with OUTCORE_AVX512_FLAGS.
#include <immintrin.h>

#include "roofline.hpp"

namespace outcore::bench {

void roofline_avx512(size_t n, float* p, const float* g, float* m, float* v, uint16_t* out,
                     bool stream_out) {
  const __m512 half = _mm512_set1_ps(0.5f);
  size_t i = 0;
  auto one = [&](size_t j) {
    const __m512 gj = _mm512_loadu_ps(g + j);
    const __m512 pj = _mm512_add_ps(_mm512_loadu_ps(p + j), gj);
    _mm512_storeu_ps(m + j, _mm512_fmadd_ps(_mm512_loadu_ps(m + j), half, gj));
    _mm512_storeu_ps(v + j, _mm512_fmadd_ps(_mm512_loadu_ps(v + j), half, gj));
    _mm512_storeu_ps(p + j, pj);
    if (out != nullptr) {
      const __m256i h = _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(pj), 16));
      auto* dst = reinterpret_cast<__m256i*>(out + j);
      if (stream_out) {
        _mm256_stream_si256(dst, h);
      } else {
        _mm256_storeu_si256(dst, h);
      }
    }
  };
  for (; i + 64 <= n; i += 64) {
    one(i);
    one(i + 16);
    one(i + 32);
    one(i + 48);
  }
  for (; i + 16 <= n; i += 16) one(i);
  for (; i < n; ++i) {
    p[i] += g[i];
    m[i] = m[i] * 0.5f + g[i];
    v[i] = v[i] * 0.5f + g[i];
    if (out != nullptr) out[i] = static_cast<uint16_t>(__builtin_bit_cast(uint32_t, p[i]) >> 16);
  }
  if (stream_out) _mm_sfence();
}

}  // namespace outcore::bench
