// AVX2 roofline kernel (see roofline.hpp).
#include <immintrin.h>

#include "roofline.hpp"

namespace outcore::bench {

void roofline_avx2(size_t n, float* p, const float* g, float* m, float* v, uint16_t* out,
                   bool stream_out) {
  const __m256 half = _mm256_set1_ps(0.5f);
  size_t i = 0;
  auto one = [&](size_t j) {
    const __m256 gj = _mm256_loadu_ps(g + j);
    const __m256 pj = _mm256_add_ps(_mm256_loadu_ps(p + j), gj);
    _mm256_storeu_ps(m + j, _mm256_fmadd_ps(_mm256_loadu_ps(m + j), half, gj));
    _mm256_storeu_ps(v + j, _mm256_fmadd_ps(_mm256_loadu_ps(v + j), half, gj));
    _mm256_storeu_ps(p + j, pj);
    if (out != nullptr) {
      const __m256i hi = _mm256_srli_epi32(_mm256_castps_si256(pj), 16);
      const __m128i h =
          _mm_packus_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1));
      auto* dst = reinterpret_cast<__m128i*>(out + j);
      if (stream_out) {
        _mm_stream_si128(dst, h);
      } else {
        _mm_storeu_si128(dst, h);
      }
    }
  };
  for (; i + 32 <= n; i += 32) {
    one(i);
    one(i + 8);
    one(i + 16);
    one(i + 24);
  }
  for (; i + 8 <= n; i += 8) one(i);
  for (; i < n; ++i) {
    p[i] += g[i];
    m[i] = m[i] * 0.5f + g[i];
    v[i] = v[i] * 0.5f + g[i];
    if (out != nullptr) out[i] = static_cast<uint16_t>(__builtin_bit_cast(uint32_t, p[i]) >> 16);
  }
  if (stream_out) _mm_sfence();
}

namespace {

__m256 widen(const uint16_t* x) {
  const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(x)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(h, 16));
}

__m128i narrow(__m256 x) {
  const __m256i hi = _mm256_srli_epi32(_mm256_castps_si256(x), 16);
  return _mm_packus_epi32(_mm256_castsi256_si128(hi), _mm256_extracti128_si256(hi, 1));
}

uint16_t narrow1(float x) { return static_cast<uint16_t>(__builtin_bit_cast(uint32_t, x) >> 16); }
float widen1(uint16_t x) { return __builtin_bit_cast(float, static_cast<uint32_t>(x) << 16); }

}  // namespace

void roofline_bf16_moments_avx2(size_t n, float* p, const float* g, uint16_t* m, uint16_t* v,
                                uint16_t* out, bool stream_out) {
  const __m256 half = _mm256_set1_ps(0.5f);
  size_t i = 0;
  auto one = [&](size_t j) {
    const __m256 gj = _mm256_loadu_ps(g + j);
    const __m256 pj = _mm256_add_ps(_mm256_loadu_ps(p + j), gj);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(m + j),
                     narrow(_mm256_fmadd_ps(widen(m + j), half, gj)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(v + j),
                     narrow(_mm256_fmadd_ps(widen(v + j), half, gj)));
    _mm256_storeu_ps(p + j, pj);
    if (out != nullptr) {
      auto* dst = reinterpret_cast<__m128i*>(out + j);
      if (stream_out) {
        _mm_stream_si128(dst, narrow(pj));
      } else {
        _mm_storeu_si128(dst, narrow(pj));
      }
    }
  };
  for (; i + 32 <= n; i += 32) {
    one(i);
    one(i + 8);
    one(i + 16);
    one(i + 24);
  }
  for (; i + 8 <= n; i += 8) one(i);
  for (; i < n; ++i) {
    p[i] += g[i];
    m[i] = narrow1(widen1(m[i]) * 0.5f + g[i]);
    v[i] = narrow1(widen1(v[i]) * 0.5f + g[i]);
    if (out != nullptr) out[i] = narrow1(p[i]);
  }
  if (stream_out) _mm_sfence();
}

}  // namespace outcore::bench
