// cpu_adam: one fused Adam/AdamW pass over flat fp32 arrays (moments fp32 or bf16), plus the
// companion kernels a mixed-precision trainer needs (sum of squares, inf/NaN check, scale in
// place).
//
// The library knows nothing of training: every call works on plain pointer + length, so a
// caller may step any sub-range of a partition (the NVMe swapper steps one sub-group at a
// time). All arrays are caller-owned; no call keeps a pointer after it returns and no call
// allocates memory.
//
// Kernels exist for AVX-512, AVX2+FMA+F16C and plain scalar code. The best one the CPU
// supports is chosen once at run time (cpuid); request_isa() or set_isa() overrides the choice
// (the outcore tools and the Python module pass the environment variable
// OUTCORE_CPU_ADAM_ISA=scalar|avx2|avx512 to request_isa(); this layer reads no environment). Every
// ISA gives bit-identical results for adam_step, scale_in_place, block_sums_of_squares and a
// single-threaded sum_of_squares (same IEEE operations in the same order, written down in
// adam_math.hpp, which the GPU's kernels follow too); a threaded sum_of_squares depends on the
// thread count by double rounding.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>
#include <type_traits>

#include "common/dtype.hpp"
#include "cpu_adam/kernels.hpp"

namespace outcore::cpu_adam {

// ---------------------------------------------------------------------------------------------
// Instruction set selection

enum class Isa : uint8_t { kScalar, kAvx2, kAvx512 };

// "scalar", "avx2", "avx512".
std::string_view isa_name(Isa isa);

// Parses "scalar" | "avx2" | "avx512". Throws InvalidArgument naming the text otherwise.
Isa parse_isa(std::string_view text);

// The best ISA this CPU supports: kAvx512 needs AVX-512 F/BW/VL/DQ, kAvx2 needs AVX2, FMA
// and F16C. Pure; thread-safe.
Isa detect_isa();

// True if this CPU can run `isa`'s kernels.
bool isa_supported(Isa isa);

// The ISA every kernel call uses now: detect_isa() until request_isa() or set_isa() changes
// it. Thread-safe.
Isa active_isa();

// Makes every later kernel call use `isa` (for tests and benchmarks). Throws InvalidArgument
// if the CPU cannot run it. REQUIRES: no kernel call is running concurrently.
void set_isa(Isa isa);

// A setting from outside the program (the tools pass OUTCORE_CPU_ADAM_ISA, with `source` =
// "OUTCORE_CPU_ADAM_ISA"): makes every later kernel call use the ISA named by `text`
// ("scalar" | "avx2" | "avx512"). Empty text changes nothing. Never throws: text that is not an
// ISA, or names one this CPU cannot run, is ignored after one warning on stderr naming
// `source`, the text and the ISA kept ("<source>=<text>: this CPU cannot run it; using avx2").
// REQUIRES: no kernel call is running concurrently.
void request_isa(std::string_view text, std::string_view source);

// ---------------------------------------------------------------------------------------------
// Threads

// A fixed team of threads (a oneTBB task_arena) that kernels split their range over. Each
// thread gets one contiguous chunk whose boundaries are whole multiples of the kernel's grain
// (64 elements: 256 bytes of fp32, 128 bytes of bf16) from the start of the range, so with
// 64-byte aligned arrays no two threads write the same cache line. Creating one may allocate;
// a kernel call through it does not allocate (beyond oneTBB's pooled task storage). Move-only.
// Calls may be made on one Executor from several threads at once.
class Executor {
 public:
  static constexpr unsigned kMaxThreads = 256;

  // threads == 0 means one per hardware thread. Throws InvalidArgument if threads > kMaxThreads.
  explicit Executor(unsigned threads = 1);
  ~Executor();
  Executor(Executor&&) noexcept;
  Executor& operator=(Executor&&) noexcept;
  Executor(const Executor&) = delete;
  Executor& operator=(const Executor&) = delete;

  unsigned threads() const { return threads_; }

  // Runs fn(chunk, begin, end) over [0, n) split into at most threads() chunks of whole
  // `grain`s (the last chunk takes the remainder; chunk counts from 0), in parallel, and
  // returns when all are done. Ranges below `min_parallel` run on the calling thread as chunk
  // 0. n == 0 calls nothing. fn must not throw.
  template <typename Fn>
  void for_chunks(size_t n, size_t grain, size_t min_parallel, Fn&& fn) const;

 private:
  using ChunkFn = void (*)(void* ctx, size_t chunk, size_t begin, size_t end);
  void run_chunks(size_t n, size_t grain, size_t min_parallel, ChunkFn fn, void* ctx) const;

  struct Arena;  // wraps a tbb::task_arena
  std::unique_ptr<Arena> arena_;
  unsigned threads_ = 1;
};

template <typename Fn>
void Executor::for_chunks(size_t n, size_t grain, size_t min_parallel, Fn&& fn) const {
  using F = std::remove_reference_t<Fn>;
  auto tramp = [](void* ctx, size_t k, size_t b, size_t e) { (*static_cast<F*>(ctx))(k, b, e); };
  run_chunks(n, grain, min_parallel, tramp, const_cast<void*>(static_cast<const void*>(&fn)));
}

// ---------------------------------------------------------------------------------------------
// Adam / AdamW

// Which rounding order the update follows. Both compute the same mathematical update
// (docs/decisions/014-cpu-adam-numerics.md); they differ only in the last bits.
enum class Formula : uint8_t {
  // DeepSpeed's CPU Adam (csrc/adam/cpu_adam_impl.cpp): denom = sqrt(v) * (1/sqrt(bc2)) + eps,
  // decoupled decay p += (-lr*wd) * p, p += (-lr/bc1) * (m / denom), all as FMAs.
  kDeepSpeed,
  // torch.optim.Adam/AdamW: denom = sqrt(v) / sqrt(bc2) + eps, decoupled decay
  // p *= (1 - lr*wd), p += ((-lr/bc1) * m) / denom. One more division per element.
  kPyTorch,
};

// Hyper-parameters of one step. Defaults are DeepSpeedCPUAdam's. They are doubles (as they
// come from the JSON config or Python); every per-step coefficient (1 - beta1, lr / bc1, ...)
// is computed from them in double and rounded once to fp32, as PyTorch does, so that
// beta2 = 0.999 gives (1 - beta2) = 0.001f and not 1 - 0.999f.
struct AdamParams {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;  // 0 disables decay in both modes
  // true: AdamW, decoupled decay (p -= lr*wd*p). false: classic L2 Adam (g += wd*p).
  bool adamw_mode = true;
  bool bias_correction = true;
  // Step number t of this update, starting at 1 (bias corrections use beta^t).
  uint64_t step = 1;
  Formula formula = Formula::kDeepSpeed;
  // Every gradient element is multiplied by this (rounded to fp32) before use, in the same
  // pass: 1/loss_scale, times the clipping coefficient. 1 leaves gradients as given.
  double grad_scale = 1.0;

  bool operator==(const AdamParams&) const = default;
};

// Checks the hyper-parameters: lr >= 0, 0 <= beta1, beta2 < 1, eps >= 0, weight_decay >= 0,
// step >= 1, grad_scale finite in fp32, all finite. Throws InvalidArgument naming the field and
// value.
void validate(const AdamParams& hp);

// The per-step constants of `hp` (validated first) that the Adam kernels read, for a kernel
// outside this library that steps with math::adam_element (adam_math.hpp): the GPU's.
detail::AdamCoeffs adam_coefficients(const AdamParams& hp);

// Gradient input: n elements of fp32, bf16 or fp16.
struct GradIn {
  const void* data = nullptr;
  DType dtype = DType::F32;
};

// Optional low-precision copy of the updated parameters (for pushing them to the device):
// n elements of bf16 or fp16, rounded to nearest even. data == nullptr: no copy.
struct ParamsOut {
  void* data = nullptr;
  DType dtype = DType::BF16;
};

// The Adam moments exp_avg and exp_avg_sq: n elements each, both fp32 or both bf16. bf16
// moments are widened exactly to fp32 for the update and rounded back to nearest even on store
// (DeepSpeed's `fp32_optimizer_states: false`); the parameter update of that step uses the
// fp32 values before rounding, as DeepSpeed's CPU Adam does. Master parameters stay fp32.
struct Moments {
  void* exp_avg = nullptr;
  void* exp_avg_sq = nullptr;
  DType dtype = DType::F32;  // F32 or BF16
};

// One Adam step over n elements, in place:
//   params[i], exp_avg[i], exp_avg_sq[i] updated from grads[i] * hp.grad_scale;
//   out[i] = round(params[i] new) if out.data is set.
// Arrays must not overlap each other (params and out included); any alignment works, 64-byte
// alignment is fastest. Non-finite gradients propagate into the state (check them first with
// has_inf_or_nan). Throws InvalidArgument (before touching memory) for invalid hp, a null
// pointer with n > 0, an F32 `out.dtype`, a moments dtype other than F32 or BF16. `ex` null:
// runs on the calling thread. Thread-safe for disjoint arrays.
void adam_step(const AdamParams& hp, size_t n, float* params, GradIn grads, Moments moments,
               ParamsOut out = {}, const Executor* ex = nullptr);

// adam_step with fp32 moments.
inline void adam_step(const AdamParams& hp, size_t n, float* params, GradIn grads, float* exp_avg,
                      float* exp_avg_sq, ParamsOut out = {}, const Executor* ex = nullptr) {
  adam_step(hp, n, params, grads, Moments{exp_avg, exp_avg_sq, DType::F32}, out, ex);
}

// The plain scalar reference of adam_step for one element range, on the calling thread,
// whatever the active ISA. Same contract and same results as adam_step.
void adam_step_reference(const AdamParams& hp, size_t n, float* params, GradIn grads,
                         Moments moments, ParamsOut out = {});

inline void adam_step_reference(const AdamParams& hp, size_t n, float* params, GradIn grads,
                                float* exp_avg, float* exp_avg_sq, ParamsOut out = {}) {
  adam_step_reference(hp, n, params, grads, Moments{exp_avg, exp_avg_sq, DType::F32}, out);
}

// ---------------------------------------------------------------------------------------------
// Companion kernels (x may be fp32, bf16 or fp16; n may be 0)

// Sum of x[i]^2 accumulated in double (for the global gradient norm). The result is finite
// if and only if every element is finite (an fp32 square cannot overflow a double), so the
// fp16 loss scaler can use it as its overflow check too. Throws InvalidArgument for a null
// pointer with n > 0.
double sum_of_squares(const void* x, DType dtype, size_t n, const Executor* ex = nullptr);

// Sums of squares of consecutive blocks of `block` elements (the last one may be shorter):
// out[b] covers x[b*block, min(n, (b+1)*block)), ceil(n / block) values. Each value depends
// only on the block's elements, never on the ISA, the thread count or where the block lies
// (math::square_lane and reduce_square_lanes in adam_math.hpp give its bits), so an array cut at
// block boundaries into pieces (a partition per data-parallel rank) gives the same values however
// it is cut; adding them in block order gives a total that is the same for every cut. Throws
// InvalidArgument for block == 0 or a null pointer with n > 0.
void block_sums_of_squares(const void* x, DType dtype, size_t n, size_t block, double* out,
                           const Executor* ex = nullptr);

// True if any element is +-inf or NaN. Throws InvalidArgument for a null pointer with n > 0.
bool has_inf_or_nan(const void* x, DType dtype, size_t n, const Executor* ex = nullptr);

// x[i] = round(x[i] * scale) in x's dtype (for gradient clipping, unscaling). Throws
// InvalidArgument for a null pointer with n > 0.
void scale_in_place(void* x, DType dtype, size_t n, float scale, const Executor* ex = nullptr);

}  // namespace outcore::cpu_adam
