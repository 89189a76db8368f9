// Argument checking, per-step coefficients, and the split of each call over the Executor.
#include "cpu_adam/cpu_adam.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <string>

#include "common/error.hpp"
#include "cpu_adam/dispatch.hpp"
#include "cpu_adam/kernels.hpp"

namespace outcore::cpu_adam {
namespace {

using detail::AdamCoeffs;

static_assert(static_cast<int>(DType::F32) == detail::kF32 &&
              static_cast<int>(DType::BF16) == detail::kBF16 &&
              static_cast<int>(DType::F16) == detail::kF16);

// Chunks are whole multiples of this many elements: 256 bytes of fp32, 128 of a 2-byte type.
constexpr size_t kGrain = 64;
// Below this many elements a call runs on the calling thread: waking workers costs more.
constexpr size_t kMinParallelAdam = size_t{1} << 16;
constexpr size_t kMinParallelReduce = size_t{1} << 18;

void check_field(bool ok, const char* field, double value, const char* allowed) {
  if (!ok) {
    throw InvalidArgument(fmt::format("cpu_adam: {} = {} is invalid ({})", field, value, allowed));
  }
}

void check_dtype(DType t, const char* what) {
  if (static_cast<int>(t) > detail::kF16) {
    throw InvalidArgument(
        fmt::format("cpu_adam: {} has unknown dtype code {}", what, static_cast<int>(t)));
  }
}

void check_pointer(const void* p, size_t n, const char* what) {
  if (p == nullptr && n > 0) {
    throw InvalidArgument(fmt::format("cpu_adam: {} is null for {} elements", what, n));
  }
}

struct Span {
  const void* p;
  size_t bytes;
  const char* name;
};

void check_no_overlap(std::initializer_list<Span> spans) {
  for (auto a = spans.begin(); a != spans.end(); ++a) {
    for (auto b = a + 1; b != spans.end(); ++b) {
      if (a->p == nullptr || b->p == nullptr) continue;
      const auto pa = reinterpret_cast<uintptr_t>(a->p), pb = reinterpret_cast<uintptr_t>(b->p);
      if (pa < pb + b->bytes && pb < pa + a->bytes) {
        throw InvalidArgument(fmt::format("cpu_adam: {} and {} overlap", a->name, b->name));
      }
    }
  }
}

AdamCoeffs make_coeffs(const AdamParams& hp) {
  double bc1 = 1.0, bc2 = 1.0;
  if (hp.bias_correction) {
    const double t = static_cast<double>(hp.step);
    bc1 = 1.0 - std::pow(hp.beta1, t);
    bc2 = 1.0 - std::pow(hp.beta2, t);
  }
  const bool ds = hp.formula == Formula::kDeepSpeed;
  const bool decay = hp.weight_decay > 0.0;
  AdamCoeffs c{};
  c.beta1 = static_cast<float>(hp.beta1);
  c.beta2 = static_cast<float>(hp.beta2);
  c.one_minus_beta1 = static_cast<float>(1.0 - hp.beta1);
  c.one_minus_beta2 = static_cast<float>(1.0 - hp.beta2);
  c.eps = static_cast<float>(hp.eps);
  c.step_size = static_cast<float>(-hp.lr / bc1);
  c.bc2 = static_cast<float>(ds ? 1.0 / std::sqrt(bc2) : std::sqrt(bc2));
  c.use_l2 = decay && !hp.adamw_mode;
  c.l2 = static_cast<float>(hp.weight_decay);
  c.use_decoupled = decay && hp.adamw_mode;
  c.decoupled = static_cast<float>(ds ? -hp.lr * hp.weight_decay : 1.0 - hp.lr * hp.weight_decay);
  c.grad_scale = static_cast<float>(hp.grad_scale);
  c.use_scale = c.grad_scale != 1.0f;
  return c;
}

struct CheckedStep {
  AdamCoeffs coeffs;
  int moment_kind, formula, grad_kind, out_kind;
};

CheckedStep check_step(const AdamParams& hp, size_t n, const float* params, GradIn grads,
                       const Moments& moments, ParamsOut out) {
  validate(hp);
  check_dtype(grads.dtype, "grads");
  if (moments.dtype != DType::F32 && moments.dtype != DType::BF16) {
    throw InvalidArgument("cpu_adam: the Adam moments must be fp32 or bf16");
  }
  check_pointer(params, n, "params");
  check_pointer(grads.data, n, "grads");
  check_pointer(moments.exp_avg, n, "exp_avg");
  check_pointer(moments.exp_avg_sq, n, "exp_avg_sq");
  if (out.data != nullptr && out.dtype != DType::BF16 && out.dtype != DType::F16) {
    throw InvalidArgument("cpu_adam: the parameter copy-out must be bf16 or fp16");
  }
  const size_t mbytes = n * dtype_size(moments.dtype);
  check_no_overlap({{params, n * sizeof(float), "params"},
                    {grads.data, n * dtype_size(grads.dtype), "grads"},
                    {moments.exp_avg, mbytes, "exp_avg"},
                    {moments.exp_avg_sq, mbytes, "exp_avg_sq"},
                    {out.data, n * 2, "params copy-out"}});
  const int out_kind = out.data == nullptr        ? detail::kOutNone
                       : out.dtype == DType::BF16 ? detail::kOutBF16
                                                  : detail::kOutF16;
  return {make_coeffs(hp), static_cast<int>(moments.dtype),
          hp.formula == Formula::kDeepSpeed ? detail::kDeepSpeed : detail::kPyTorch,
          static_cast<int>(grads.dtype), out_kind};
}

void check_vector(const void* x, DType dtype, size_t n) {
  check_dtype(dtype, "input");
  check_pointer(x, n, "input");
}

}  // namespace

void validate(const AdamParams& hp) {
  auto finite = [](double x) { return std::isfinite(x); };
  check_field(finite(hp.lr) && hp.lr >= 0.0, "lr", hp.lr, "must be finite and >= 0");
  check_field(finite(hp.beta1) && hp.beta1 >= 0.0 && hp.beta1 < 1.0, "beta1", hp.beta1,
              "must be in [0, 1)");
  check_field(finite(hp.beta2) && hp.beta2 >= 0.0 && hp.beta2 < 1.0, "beta2", hp.beta2,
              "must be in [0, 1)");
  check_field(finite(hp.eps) && hp.eps >= 0.0, "eps", hp.eps, "must be finite and >= 0");
  check_field(finite(hp.weight_decay) && hp.weight_decay >= 0.0, "weight_decay", hp.weight_decay,
              "must be finite and >= 0");
  check_field(hp.step >= 1, "step", static_cast<double>(hp.step), "counts from 1");
  check_field(finite(hp.grad_scale) && std::isfinite(static_cast<float>(hp.grad_scale)),
              "grad_scale", hp.grad_scale, "must be finite in fp32");
  if (hp.formula != Formula::kDeepSpeed && hp.formula != Formula::kPyTorch) {
    throw InvalidArgument("cpu_adam: unknown formula code " +
                          std::to_string(static_cast<int>(hp.formula)));
  }
}

detail::AdamCoeffs adam_coefficients(const AdamParams& hp) {
  validate(hp);
  return make_coeffs(hp);
}

void adam_step(const AdamParams& hp, size_t n, float* params, GradIn grads, Moments moments,
               ParamsOut out, const Executor* ex) {
  const CheckedStep s = check_step(hp, n, params, grads, moments, out);
  const detail::AdamFn fn =
      detail::active_kernels().adam[s.moment_kind][s.formula][s.grad_kind][s.out_kind];
  const size_t gbytes = dtype_size(grads.dtype);
  const size_t mbytes = dtype_size(moments.dtype);
  auto* m = static_cast<std::byte*>(moments.exp_avg);
  auto* v = static_cast<std::byte*>(moments.exp_avg_sq);
  auto chunk = [&](size_t, size_t b, size_t e) {
    fn(s.coeffs, e - b, params + b, static_cast<const std::byte*>(grads.data) + b * gbytes,
       m + b * mbytes, v + b * mbytes,
       out.data == nullptr ? nullptr : static_cast<std::byte*>(out.data) + b * 2);
  };
  if (ex == nullptr) {
    chunk(0, 0, n);
  } else {
    ex->for_chunks(n, kGrain, kMinParallelAdam, chunk);
  }
}

void adam_step_reference(const AdamParams& hp, size_t n, float* params, GradIn grads,
                         Moments moments, ParamsOut out) {
  const CheckedStep s = check_step(hp, n, params, grads, moments, out);
  detail::scalar_kernels().adam[s.moment_kind][s.formula][s.grad_kind][s.out_kind](
      s.coeffs, n, params, grads.data, moments.exp_avg, moments.exp_avg_sq, out.data);
}

double sum_of_squares(const void* x, DType dtype, size_t n, const Executor* ex) {
  check_vector(x, dtype, n);
  const detail::SumSqFn fn = detail::active_kernels().sum_of_squares[static_cast<int>(dtype)];
  const auto* bytes = static_cast<const std::byte*>(x);
  const size_t esize = dtype_size(dtype);
  if (ex == nullptr || ex->threads() == 1) return fn(x, n);
  // One partial per chunk, on its own cache line; summed in chunk order.
  struct alignas(64) Partial {
    double sum;
  };
  Partial partials[Executor::kMaxThreads];
  for (unsigned k = 0; k < ex->threads(); ++k) partials[k].sum = 0.0;
  ex->for_chunks(n, kGrain, kMinParallelReduce, [&](size_t k, size_t b, size_t e) {
    partials[k].sum = fn(bytes + b * esize, e - b);
  });
  double total = 0.0;
  for (unsigned k = 0; k < ex->threads(); ++k) total += partials[k].sum;
  return total;
}

void block_sums_of_squares(const void* x, DType dtype, size_t n, size_t block, double* out,
                           const Executor* ex) {
  check_vector(x, dtype, n);
  if (block == 0) throw InvalidArgument("block_sums_of_squares: block size must be > 0");
  if (n == 0) return;
  if (out == nullptr) throw InvalidArgument("block_sums_of_squares: null output");
  const detail::SumSqFn fn = detail::active_kernels().sum_of_squares[static_cast<int>(dtype)];
  const auto* bytes = static_cast<const std::byte*>(x);
  const size_t esize = dtype_size(dtype);
  const size_t blocks = (n + block - 1) / block;
  auto run = [&](size_t, size_t b, size_t e) {
    for (size_t k = b; k < e; ++k) {
      const size_t first = k * block;
      out[k] = fn(bytes + first * esize, std::min(block, n - first));
    }
  };
  if (ex == nullptr || ex->threads() == 1) {
    run(0, 0, blocks);
    return;
  }
  ex->for_chunks(blocks, 1, std::max<size_t>(1, kMinParallelReduce / block), run);
}

bool has_inf_or_nan(const void* x, DType dtype, size_t n, const Executor* ex) {
  check_vector(x, dtype, n);
  const detail::NonFiniteFn fn = detail::active_kernels().has_inf_or_nan[static_cast<int>(dtype)];
  if (ex == nullptr) return fn(x, n);
  const auto* bytes = static_cast<const std::byte*>(x);
  const size_t esize = dtype_size(dtype);
  std::atomic<bool> found{false};
  ex->for_chunks(n, kGrain, kMinParallelReduce, [&](size_t, size_t b, size_t e) {
    if (fn(bytes + b * esize, e - b)) found.store(true, std::memory_order_relaxed);
  });
  return found.load();
}

void scale_in_place(void* x, DType dtype, size_t n, float scale, const Executor* ex) {
  check_vector(x, dtype, n);
  const detail::ScaleFn fn = detail::active_kernels().scale_in_place[static_cast<int>(dtype)];
  auto* bytes = static_cast<std::byte*>(x);
  const size_t esize = dtype_size(dtype);
  auto chunk = [&](size_t, size_t b, size_t e) { fn(bytes + b * esize, e - b, scale); };
  if (ex == nullptr) {
    chunk(0, 0, n);
  } else {
    ex->for_chunks(n, kGrain, kMinParallelAdam, chunk);
  }
}

}  // namespace outcore::cpu_adam
