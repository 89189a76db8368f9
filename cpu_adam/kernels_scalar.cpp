// The scalar reference kernels. Each Adam element is math::adam_element (adam_math.hpp, shared
// with the GPU's kernel): the same sequence of IEEE operations (explicit fma, correctly rounded
// sqrt and division) as the vector kernels, so every ISA gives bit-identical parameters and
// moments.
#include <cmath>
#include <cstdint>

#include "common/dtype.hpp"
#include "cpu_adam/adam_math.hpp"
#include "cpu_adam/kernels.hpp"

namespace outcore::cpu_adam::detail {
namespace {

template <int K>
float load(const void* x, size_t i) {
  if constexpr (K == kF32) return static_cast<const float*>(x)[i];
  if constexpr (K == kBF16) return bf16_to_fp32(static_cast<const uint16_t*>(x)[i]);
  if constexpr (K == kF16) return fp16_to_fp32(static_cast<const uint16_t*>(x)[i]);
}

template <int K>
void store(void* x, size_t i, float f) {
  if constexpr (K == kF32) static_cast<float*>(x)[i] = f;
  if constexpr (K == kBF16) static_cast<uint16_t*>(x)[i] = fp32_to_bf16(f);
  if constexpr (K == kF16) static_cast<uint16_t*>(x)[i] = fp32_to_fp16(f);
}

// Moments of kind M are widened exactly to fp32, updated, and rounded once to M on store; the
// parameter update uses the unrounded fp32 moments (as DeepSpeed's CPU Adam does with
// half-precision optimizer states).
template <int M, int Formula, int G, int O>
void adam(const AdamCoeffs& c, size_t n, float* p, const void* g, void* m, void* v, void* out) {
  for (size_t i = 0; i < n; ++i) {
    float param = p[i];
    float mi = load<M>(m, i);
    float vi = load<M>(v, i);
    math::adam_element<Formula>(c, load<G>(g, i), param, mi, vi);
    store<M>(m, i, mi);
    store<M>(v, i, vi);
    p[i] = param;
    if constexpr (O == kOutBF16) store<kBF16>(out, i, param);
    if constexpr (O == kOutF16) store<kF16>(out, i, param);
  }
}

// The lanes of math::kSquareLanes, as the vector kernels and the GPU hold them.
template <int K>
double sum_of_squares(const void* x, size_t n) {
  double lanes[math::kSquareLanes] = {};
  for (size_t i = 0; i < n; ++i) {
    const double d = load<K>(x, i);
    double& acc = lanes[i % math::kSquareLanes];
    acc = math::fma_rn(d, d, acc);
  }
  return math::reduce_square_lanes(lanes);
}

template <int K>
bool has_inf_or_nan(const void* x, size_t n) {
  for (size_t i = 0; i < n; ++i) {
    if (!std::isfinite(load<K>(x, i))) return true;
  }
  return false;
}

template <int K>
void scale_in_place(void* x, size_t n, float scale) {
  for (size_t i = 0; i < n; ++i) store<K>(x, i, load<K>(x, i) * scale);
}

template <int M, int Formula, int G>
constexpr void fill_outs(KernelTable& t) {
  t.adam[M][Formula][G][kOutNone] = adam<M, Formula, G, kOutNone>;
  t.adam[M][Formula][G][kOutBF16] = adam<M, Formula, G, kOutBF16>;
  t.adam[M][Formula][G][kOutF16] = adam<M, Formula, G, kOutF16>;
}

template <int K>
constexpr void fill_kind(KernelTable& t) {
  fill_outs<kF32, kDeepSpeed, K>(t);
  fill_outs<kF32, kPyTorch, K>(t);
  fill_outs<kBF16, kDeepSpeed, K>(t);
  fill_outs<kBF16, kPyTorch, K>(t);
  t.sum_of_squares[K] = sum_of_squares<K>;
  t.has_inf_or_nan[K] = has_inf_or_nan<K>;
  t.scale_in_place[K] = scale_in_place<K>;
}

constexpr KernelTable make_table() {
  KernelTable t{};
  fill_kind<kF32>(t);
  fill_kind<kBF16>(t);
  fill_kind<kF16>(t);
  return t;
}

constexpr KernelTable kTable = make_table();

}  // namespace

const KernelTable& scalar_kernels() { return kTable; }

}  // namespace outcore::cpu_adam::detail
