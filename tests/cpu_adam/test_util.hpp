// Shared helpers for the cpu_adam tests: deterministic inputs, ISA switching, bitwise compares.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "common/dtype.hpp"
#include "cpu_adam/cpu_adam.hpp"

namespace outcore::cpu_adam::testing {

// Every ISA this CPU can run.
inline std::vector<Isa> supported_isas() {
  std::vector<Isa> out;
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
    if (isa_supported(isa)) out.push_back(isa);
  }
  return out;
}

// Selects an ISA for the lifetime of the guard, then restores the previous one.
class IsaGuard {
 public:
  explicit IsaGuard(Isa isa) : saved_(active_isa()) { set_isa(isa); }
  ~IsaGuard() { set_isa(saved_); }
  IsaGuard(const IsaGuard&) = delete;
  IsaGuard& operator=(const IsaGuard&) = delete;

 private:
  Isa saved_;
};

// Values spread over many magnitudes, with some exact zeros and negative zeros.
inline std::vector<float> random_floats(size_t n, uint32_t seed, float scale = 1.0f) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> expo(-6, 2);
  std::uniform_int_distribution<int> pick(0, 49);
  std::vector<float> x(n);
  for (auto& v : x) {
    const int k = pick(rng);
    v = k == 0 ? 0.0f : k == 1 ? -0.0f : scale * normal(rng) * std::ldexp(1.0f, 3 * expo(rng));
  }
  return x;
}

// Raw storage of n elements of `t`, filled from fp32 values (rounded to nearest even).
inline std::vector<uint16_t> to_half(const std::vector<float>& x, DType t) {
  std::vector<uint16_t> out(x.size());
  for (size_t i = 0; i < x.size(); ++i) {
    out[i] = t == DType::BF16 ? fp32_to_bf16(x[i]) : fp32_to_fp16(x[i]);
  }
  return out;
}

// Index of the first element whose bits differ, or -1.
template <typename T>
long first_bit_difference(const T* a, const T* b, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (std::memcmp(a + i, b + i, sizeof(T)) != 0) return static_cast<long>(i);
  }
  return -1;
}

inline float bits_to_float(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

}  // namespace outcore::cpu_adam::testing
