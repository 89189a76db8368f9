// Element types and scalar conversions. bf16 is the upper half of an fp32, rounded to
// nearest even (NaN stays NaN); fp16 is IEEE binary16 converted with F16C.
#pragma once

#include <immintrin.h>

#include <bit>
#include <cstddef>
#include <cstdint>
#include <string_view>

namespace outcore {

enum class DType : uint8_t { F32, BF16, F16 };

constexpr size_t dtype_size(DType t) { return t == DType::F32 ? 4 : 2; }
constexpr std::string_view dtype_name(DType t) {
  return t == DType::F32 ? "fp32" : t == DType::BF16 ? "bf16" : "fp16";
}
// safetensors spelling: "F32", "BF16", "F16".
constexpr std::string_view dtype_safetensors_name(DType t) {
  return t == DType::F32 ? "F32" : t == DType::BF16 ? "BF16" : "F16";
}

inline uint16_t fp32_to_bf16(float f) {
  uint32_t u = std::bit_cast<uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((u >> 16) | 0x40u);  // NaN
  u += 0x7fffu + ((u >> 16) & 1u);
  return static_cast<uint16_t>(u >> 16);
}
inline float bf16_to_fp32(uint16_t h) {
  return std::bit_cast<float>(static_cast<uint32_t>(h) << 16);
}

inline uint16_t fp32_to_fp16(float f) { return _cvtss_sh(f, _MM_FROUND_TO_NEAREST_INT); }
inline float fp16_to_fp32(uint16_t h) { return _cvtsh_ss(h); }

// Rounds x to the nearest value representable in `t` (identity for F32).
inline float round_to(DType t, float x) {
  if (t == DType::BF16) return bf16_to_fp32(fp32_to_bf16(x));
  if (t == DType::F16) return fp16_to_fp32(fp32_to_fp16(x));
  return x;
}

}  // namespace outcore
