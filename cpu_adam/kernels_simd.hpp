// Internal: the vector kernels, written once against an ISA traits type V and instantiated by
// kernels_avx2.cpp and kernels_avx512.cpp with traits types that have internal linkage (so no
// instantiation can be merged across ISAs by the linker). Each Adam element goes through the
// same IEEE operations, in the same order, as kernels_scalar.cpp.
//
// V provides: F (a vector of kWidth floats), D (a vector of doubles), load/store (unaligned),
// set1, add, sub, mul, div, sqrt, fma(a, b, c) = a*b + c, load_bf16/load_f16 (kWidth 16-bit
// elements to floats), H (kWidth 16-bit elements), to_bf16/to_f16 (round to nearest even, as
// common/dtype.hpp does), store_h, stream_h (non-temporal; needs sizeof(H) alignment),
// dzero, dadd, acc_squares(x, lo, hi) (lo/hi += each half of x squared, in double), reduce(D),
// any_nan(F).
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "cpu_adam/kernels.hpp"

namespace outcore::cpu_adam::detail::simd {

template <class V, int K>
inline typename V::F load_kind(const void* base, size_t i) {
  if constexpr (K == kF32) return V::load(static_cast<const float*>(base) + i);
  if constexpr (K == kBF16) return V::load_bf16(static_cast<const uint16_t*>(base) + i);
  if constexpr (K == kF16) return V::load_f16(static_cast<const uint16_t*>(base) + i);
}

template <class V, int K>
inline void store_kind(void* base, size_t i, typename V::F x) {
  if constexpr (K == kF32) V::store(static_cast<float*>(base) + i, x);
  if constexpr (K == kBF16) V::store_h(static_cast<uint16_t*>(base) + i, V::to_bf16(x));
  if constexpr (K == kF16) V::store_h(static_cast<uint16_t*>(base) + i, V::to_f16(x));
}

// A copy-out at least this large bypasses the cache (non-temporal stores): it is written once
// and read next by a DMA engine or another thread, and streaming it saves the read for
// ownership of each line. Smaller ones stay in cache for a caller that reads them back.
inline constexpr size_t kStreamOutMinBytes = size_t{1} << 20;

template <int K>
inline constexpr size_t kKindBytes = K == kF32 ? 4 : 2;

// Runs body(i, ...) on every whole vector of [0, n), four at a time, then once more on the
// remainder copied into zero-padded stack buffers (so the tail goes through the same vector
// code). Each array is described by its base pointer and element size; `writes` marks the
// ones copied back after the tail.
template <size_t W, size_t N, class Body>
inline void for_vectors(size_t n, void* const (&base)[N], const size_t (&elem_bytes)[N],
                        const bool (&writes)[N], Body&& body) {
  size_t i = 0;
  for (; i + 4 * W <= n; i += 4 * W) {
    body(i, base);
    body(i + W, base);
    body(i + 2 * W, base);
    body(i + 3 * W, base);
  }
  for (; i + W <= n; i += W) body(i, base);
  if (i == n) return;
  const size_t rest = n - i;
  alignas(64) unsigned char buf[N][W * 4] = {};
  void* tail[N];
  for (size_t a = 0; a < N; ++a) {
    tail[a] = buf[a];
    if (base[a] == nullptr) continue;
    __builtin_memcpy(buf[a], static_cast<unsigned char*>(base[a]) + i * elem_bytes[a],
                     rest * elem_bytes[a]);
  }
  body(0, tail);
  for (size_t a = 0; a < N; ++a) {
    if (!writes[a] || base[a] == nullptr) continue;
    __builtin_memcpy(static_cast<unsigned char*>(base[a]) + i * elem_bytes[a], buf[a],
                     rest * elem_bytes[a]);
  }
}

template <class V, int M, int Formula, int G, int O>
void adam(const AdamCoeffs& c, size_t n, float* p, const void* g, void* m, void* v, void* out) {
  using F = typename V::F;
  const F beta1 = V::set1(c.beta1), beta2 = V::set1(c.beta2);
  const F omb1 = V::set1(c.one_minus_beta1), omb2 = V::set1(c.one_minus_beta2);
  const F eps = V::set1(c.eps), step = V::set1(c.step_size), bc2 = V::set1(c.bc2);
  const F l2 = V::set1(c.l2), dec = V::set1(c.decoupled), gs = V::set1(c.grad_scale);
  const bool use_l2 = c.use_l2, use_dec = c.use_decoupled, use_scale = c.use_scale;

  auto body = [&](size_t i, void* const* a, auto stream_out) {
    float* pp = static_cast<float*>(a[0]);
    F grad = load_kind<V, G>(a[1], i);
    F param = V::load(pp + i);
    if (use_scale) grad = V::mul(grad, gs);
    if (use_l2) grad = V::fma(param, l2, grad);
    const F mi = V::fma(grad, omb1, V::mul(load_kind<V, M>(a[2], i), beta1));
    const F vi = V::fma(V::mul(grad, grad), omb2, V::mul(load_kind<V, M>(a[3], i), beta2));
    const F root = V::sqrt(vi);
    if constexpr (Formula == kDeepSpeed) {
      const F update = V::div(mi, V::fma(root, bc2, eps));
      if (use_dec) param = V::fma(param, dec, param);
      param = V::fma(update, step, param);
    } else {
      const F denom = V::add(V::div(root, bc2), eps);
      if (use_dec) param = V::mul(param, dec);
      param = V::add(param, V::div(V::mul(step, mi), denom));
    }
    store_kind<V, M>(a[2], i, mi);
    store_kind<V, M>(a[3], i, vi);
    V::store(pp + i, param);
    if constexpr (O != kOutNone) {
      const auto h = O == kOutBF16 ? V::to_bf16(param) : V::to_f16(param);
      uint16_t* dst = static_cast<uint16_t*>(a[4]) + i;
      if constexpr (decltype(stream_out)::value) {
        V::stream_h(dst, h);
      } else {
        V::store_h(dst, h);
      }
    }
  };
  void* const base[5] = {p, const_cast<void*>(g), m, v, out};
  const size_t bytes[5] = {4, kKindBytes<G>, kKindBytes<M>, kKindBytes<M>, 2};
  const bool writes[5] = {true, false, true, true, O != kOutNone};
  const bool stream = O != kOutNone && n * 2 >= kStreamOutMinBytes &&
                      reinterpret_cast<uintptr_t>(out) % sizeof(typename V::H) == 0;
  if (stream) {
    for_vectors<V::kWidth>(n, base, bytes, writes,
                           [&](size_t i, void* const* a) { body(i, a, std::true_type{}); });
    V::stream_fence();
  } else {
    for_vectors<V::kWidth>(n, base, bytes, writes,
                           [&](size_t i, void* const* a) { body(i, a, std::false_type{}); });
  }
}

// The 16 double lanes of adam_math.hpp's sum of squares (kSquareLanes; not included here, see
// kernels.hpp): 16 / kWidth vectors per 16 elements, each split into two double accumulators,
// so accumulator pair k holds lanes [k * kWidth, (k + 1) * kWidth). One pair per vector is
// enough: the loop is bound by memory, not by FMA latency. The lanes are then added pairwise,
// j with j + 8, + 4, + 2, + 1: with one vector (AVX-512), lo + hi, then V::reduce the rest; with
// two (AVX2), lo[0] + lo[1] and hi[0] + hi[1], then their sum, then V::reduce + 2 and + 1.
template <class V, int K>
double sum_of_squares(const void* x, size_t n) {
  constexpr size_t kLanes = 16;
  constexpr size_t kVecs = kLanes / V::kWidth;
  static_assert(kVecs * V::kWidth == kLanes && (kVecs == 1 || kVecs == 2));
  typename V::D lo[kVecs], hi[kVecs];
  for (size_t k = 0; k < kVecs; ++k) lo[k] = hi[k] = V::dzero();
  auto body = [&](size_t i, void* const* a) {
    for (size_t k = 0; k < kVecs; ++k)
      V::acc_squares(load_kind<V, K>(a[0], i + k * V::kWidth), lo[k], hi[k]);
  };
  void* const base[1] = {const_cast<void*>(x)};
  const size_t bytes[1] = {kKindBytes<K>};
  const bool writes[1] = {false};
  // Steps of 16 elements; a shorter tail is padded with zeros, whose squares add nothing.
  for_vectors<kLanes>(n, base, bytes, writes, body);
  // Lane j + 8: with one vector, the upper accumulator; with two, the second vector's.
  if constexpr (kVecs == 1)
    return V::reduce(V::dadd(lo[0], hi[0]));
  else
    return V::reduce(V::dadd(V::dadd(lo[0], lo[1]), V::dadd(hi[0], hi[1])));
}

template <class V, int K>
bool has_inf_or_nan(const void* x, size_t n) {
  // x - x is 0 for every finite x and NaN for inf or NaN; the running sum stays 0 until a
  // non-finite element is seen. Checked every block so a bad value ends the scan early.
  constexpr size_t kBlock = 4096;
  for (size_t b = 0; b < n; b += kBlock) {
    const size_t len = n - b < kBlock ? n - b : kBlock;
    typename V::F acc = V::set1(0.0f);
    auto body = [&](size_t i, void* const* a) {
      const typename V::F e = load_kind<V, K>(a[0], i);
      acc = V::add(acc, V::sub(e, e));
    };
    void* const base[1] = {
        const_cast<unsigned char*>(static_cast<const unsigned char*>(x) + b * kKindBytes<K>)};
    const size_t bytes[1] = {kKindBytes<K>};
    const bool writes[1] = {false};
    for_vectors<V::kWidth>(len, base, bytes, writes, body);
    if (V::any_nan(acc)) return true;
  }
  return false;
}

template <class V, int K>
void scale_in_place(void* x, size_t n, float scale) {
  const typename V::F s = V::set1(scale);
  auto body = [&](size_t i, void* const* a) {
    store_kind<V, K>(a[0], i, V::mul(load_kind<V, K>(a[0], i), s));
  };
  void* const base[1] = {x};
  const size_t bytes[1] = {kKindBytes<K>};
  const bool writes[1] = {true};
  for_vectors<V::kWidth>(n, base, bytes, writes, body);
}

template <class V, int M, int Formula, int G>
constexpr void fill_outs(KernelTable& t) {
  t.adam[M][Formula][G][kOutNone] = adam<V, M, Formula, G, kOutNone>;
  t.adam[M][Formula][G][kOutBF16] = adam<V, M, Formula, G, kOutBF16>;
  t.adam[M][Formula][G][kOutF16] = adam<V, M, Formula, G, kOutF16>;
}

template <class V, int K>
constexpr void fill_kind(KernelTable& t) {
  fill_outs<V, kF32, kDeepSpeed, K>(t);
  fill_outs<V, kF32, kPyTorch, K>(t);
  fill_outs<V, kBF16, kDeepSpeed, K>(t);
  fill_outs<V, kBF16, kPyTorch, K>(t);
  t.sum_of_squares[K] = sum_of_squares<V, K>;
  t.has_inf_or_nan[K] = has_inf_or_nan<V, K>;
  t.scale_in_place[K] = scale_in_place<V, K>;
}

template <class V>
constexpr KernelTable make_table() {
  KernelTable t{};
  fill_kind<V, kF32>(t);
  fill_kind<V, kBF16>(t);
  fill_kind<V, kF16>(t);
  return t;
}

}  // namespace outcore::cpu_adam::detail::simd
