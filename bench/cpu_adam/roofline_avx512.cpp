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

namespace {

__m512 widen(const uint16_t* x) {
  const __m512i h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(x)));
  return _mm512_castsi512_ps(_mm512_slli_epi32(h, 16));
}

__m256i narrow(__m512 x) {
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(x), 16));
}

uint16_t narrow1(float x) { return static_cast<uint16_t>(__builtin_bit_cast(uint32_t, x) >> 16); }
float widen1(uint16_t x) { return __builtin_bit_cast(float, static_cast<uint32_t>(x) << 16); }

}  // namespace

void roofline_bf16_moments_avx512(size_t n, float* p, const float* g, uint16_t* m, uint16_t* v,
                                  uint16_t* out, bool stream_out) {
  const __m512 half = _mm512_set1_ps(0.5f);
  size_t i = 0;
  auto one = [&](size_t j) {
    const __m512 gj = _mm512_loadu_ps(g + j);
    const __m512 pj = _mm512_add_ps(_mm512_loadu_ps(p + j), gj);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(m + j),
                        narrow(_mm512_fmadd_ps(widen(m + j), half, gj)));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(v + j),
                        narrow(_mm512_fmadd_ps(widen(v + j), half, gj)));
    _mm512_storeu_ps(p + j, pj);
    if (out != nullptr) {
      auto* dst = reinterpret_cast<__m256i*>(out + j);
      if (stream_out) {
        _mm256_stream_si256(dst, narrow(pj));
      } else {
        _mm256_storeu_si256(dst, narrow(pj));
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
    m[i] = narrow1(widen1(m[i]) * 0.5f + g[i]);
    v[i] = narrow1(widen1(v[i]) * 0.5f + g[i]);
    if (out != nullptr) out[i] = narrow1(p[i]);
  }
  if (stream_out) _mm_sfence();
}

}  // namespace outcore::bench
