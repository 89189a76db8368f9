// The CPU's bf16 GEMM (bf16_gemm.hpp): oneDNN's matmul where the CPU multiplies bf16 in
// hardware, compiled once per shape; OpenBLAS's sgemm on widened operands elsewhere.
#include "engine/device/cpu/bf16_gemm.hpp"

#include <fmt/format.h>
#include <omp.h>
#include <tbb/parallel_for.h>

#include <algorithm>
#include <atomic>
#include <bit>
#include <cstddef>
#include <cstring>
#include <dnnl.hpp>
#include <memory>
#include <mutex>
#include <optional>
#include <unordered_map>
#include <vector>

#include "common/dtype.hpp"
#include "common/error.hpp"
#include "engine/device/cpu/kernels.hpp"

namespace outcore::device::cpu {
namespace {

using dnnl::memory;

// Everything a compiled matmul depends on.
struct Shape {
  bool f32;  // fp32 operands (gemm_f32_serial), else bf16
  bool ta, tb;
  int64_t m, n, k, lda, ldb, ldc;
  uint32_t alpha, beta;  // the bits of alpha and beta
  int threads;           // the OpenMP threads it runs on
  bool operator==(const Shape&) const = default;
};

struct ShapeHash {
  size_t operator()(const Shape& s) const noexcept {
    uint64_t h = 0xcbf29ce484222325ull;
    for (const uint64_t v :
         {uint64_t(s.f32) << 2 | uint64_t(s.ta) << 1 | uint64_t(s.tb), uint64_t(s.m), uint64_t(s.n),
          uint64_t(s.k), uint64_t(s.lda), uint64_t(s.ldb), uint64_t(s.ldc),
          uint64_t(s.alpha) << 32 | s.beta, uint64_t(s.threads)})
      h = (h ^ v) * 0x100000001b3ull;
    return static_cast<size_t>(h);
  }
};

// GEMMs of fewer FLOPs than this run on the calling thread alone: starting and joining oneDNN's
// OpenMP team costs more than a second thread gains on them, and much more when the other
// cores are busy (a team's barrier then waits for a descheduled thread). Attention's blocks,
// a head at a time, are such GEMMs.
constexpr double kSerialFlops = double(1 << 25);

// oneDNN's threads for the other GEMMs: set_bf16_gemm_threads's, else OpenMP's default number
// (OMP_NUM_THREADS, or the processors this process may run on), taken at the first GEMM.
std::atomic<int> chosen_threads{0};

thread_local bool serial_here = false;  // a SerialGemms is alive on this thread

int gemm_threads() {
  if (const int n = chosen_threads.load(std::memory_order_relaxed); n > 0) return n;
  static const int threads = std::max(1, omp_get_max_threads());
  return threads;
}

// While alive, the OpenMP regions the calling thread starts have `threads` threads: oneDNN
// sizes a kernel's work split by omp_get_max_threads() when it is compiled, and runs it so.
class Threads {
 public:
  explicit Threads(int threads) : previous_(omp_get_max_threads()) {
    if (threads != previous_) omp_set_num_threads(threads);
  }
  ~Threads() {
    if (omp_get_max_threads() != previous_) omp_set_num_threads(previous_);
  }
  Threads(const Threads&) = delete;
  Threads& operator=(const Threads&) = delete;

 private:
  int previous_;
};

// A shape's compiled matmul, or none where oneDNN has no hardware-bf16 kernel for it.
struct Plan {
  std::optional<dnnl::matmul> matmul;
  int threads = 1;             // OpenMP threads it is compiled for and runs on
  std::string implementation;  // oneDNN's name of the matmul's implementation
  memory::desc scratchpad;     // its scratch, the caller's (so that threads may run it at once)
  memory::desc a, b, c;
};

dnnl::engine& cpu_engine() {
  static dnnl::engine engine(dnnl::engine::kind::cpu, 0);
  return engine;
}

// Whether the CPU, as oneDNN sees it (ONEDNN_MAX_CPU_ISA included), has bf16 dot products.
bool hardware_bf16() {
  static const bool has = [] {
    const auto isa = static_cast<unsigned>(dnnl::get_effective_cpu_isa());
    return (isa & dnnl_cpu_isa_avx512_core_bf16) == dnnl_cpu_isa_avx512_core_bf16;
  }();
  return has;
}

// The logical [rows, cols] matrix stored row-major with leading dimension ld, or transposed
// (stored [cols, rows]).
memory::desc matrix(int64_t rows, int64_t cols, bool transposed, int64_t ld, memory::data_type t) {
  return memory::desc({rows, cols}, t, transposed ? memory::dims{1, ld} : memory::dims{ld, 1});
}

Plan make_plan(const Shape& s) {
  Plan p;
  const auto operands = s.f32 ? memory::data_type::f32 : memory::data_type::bf16;
  p.a = matrix(s.m, s.k, s.ta, s.lda, operands);
  p.b = matrix(s.k, s.n, s.tb, s.ldb, operands);
  p.c = matrix(s.m, s.n, false, s.ldc, memory::data_type::f32);
  if ((!s.f32 && !hardware_bf16()) || s.k == 0) return p;
  p.threads = s.threads;
  const Threads threads(p.threads);
  try {
    dnnl::primitive_attr attr;
    // oneDNN's own scratchpad would be shared by every thread running the matmul at once.
    attr.set_scratchpad_mode(dnnl::scratchpad_mode::user);
    const float alpha = std::bit_cast<float>(s.alpha), beta = std::bit_cast<float>(s.beta);
    if (alpha != 1.0f) attr.set_output_scales(0, {alpha});
    if (beta != 0.0f) {
      dnnl::post_ops ops;
      ops.append_sum(beta);
      attr.set_post_ops(ops);
    }
    const dnnl::matmul::primitive_desc pd(dnnl::matmul::desc(p.a, p.b, p.c), attr, cpu_engine());
    // A generic (reference) implementation is slower than widening for sgemm.
    p.implementation = pd.impl_info_str();
    p.scratchpad = pd.scratchpad_desc();
    if (!p.implementation.starts_with("ref")) p.matmul.emplace(pd);
  } catch (const dnnl::error&) {
    // No implementation of this shape or stride: widened below.
  }
  return p;
}

std::shared_ptr<const Plan> plan_for(const Shape& s) {
  static std::mutex mu;
  static std::unordered_map<Shape, std::shared_ptr<const Plan>, ShapeHash> plans;
  const std::lock_guard lock(mu);
  auto& slot = plans[s];
  if (!slot) slot = std::make_shared<const Plan>(make_plan(s));
  return slot;
}

// Elements widened per range on oneTBB's threads (exact: any split gives the same values).
constexpr int64_t kWidenRange = int64_t{1} << 16;

// The `rows` x `cols` bf16 matrix at `src` (leading dimension ld) as fp32 in `buf`, its rows
// packed (leading dimension cols): a head's columns of attention's q, k and v are widened
// without the other heads' between them. Large ones on oneTBB's threads (not under
// SerialGemms, where the caller's threads are busy with other heads): the sgemm after it runs
// on every core, and a widening on one would cost a tenth of a step on two.
const float* widen(const void* src, int64_t rows, int64_t cols, int64_t ld,
                   std::vector<float>& buf) {
  const auto size = static_cast<size_t>(std::max<int64_t>(1, rows * cols));
  if (buf.size() < size) buf.resize(size);
  const auto* from = static_cast<const uint16_t*>(src);
  // Rows [first, first + count) into buf.
  auto rows_of = [&](int64_t first, int64_t count) {
    if (ld == cols)
      to_fp32(from + first * cols, DType::BF16, buf.data() + first * cols, count * cols);
    else
      for (int64_t r = first; r < first + count; ++r)
        to_fp32(from + r * ld, DType::BF16, buf.data() + r * cols, cols);
  };
  if (serial_here || rows * cols < 2 * kWidenRange || rows < 2) {
    rows_of(0, rows);
    return buf.data();
  }
  const int64_t per_range = std::max<int64_t>(1, kWidenRange / std::max<int64_t>(1, cols));
  tbb::parallel_for(int64_t{0}, (rows + per_range - 1) / per_range, [&](int64_t i) {
    const int64_t first = i * per_range;
    rows_of(first, std::min(per_range, rows - first));
  });
  return buf.data();
}

// Rows [0, rows) of `cols` elements from `src` (leading dimension lds) to `dst` (ldd).
template <typename T>
void copy_rows(const T* src, int64_t lds, T* dst, int64_t ldd, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; ++r) std::memcpy(dst + r * ldd, src + r * lds, cols * sizeof(T));
}

// The `rows` x `cols` bf16 matrix at `src` (leading dimension ld) packed into `buf`.
const uint16_t* packed(const uint16_t* src, int64_t rows, int64_t cols, int64_t ld,
                       std::vector<uint16_t>& buf) {
  buf.resize(static_cast<size_t>(rows * cols));
  copy_rows(src, ld, buf.data(), cols, rows, cols);
  return buf.data();
}

// Runs a compiled matmul on A, B and C (as its plan describes them) on its threads, with this
// thread's scratch.
void run(const Plan& plan, const void* a, const void* b, float* c, int64_t m, int64_t n,
         int64_t k) {
  const Threads threads(plan.threads);
  try {
    thread_local dnnl::stream stream(cpu_engine());
    auto& engine = cpu_engine();
    const memory ma(plan.a, engine, const_cast<void*>(a));
    const memory mb(plan.b, engine, const_cast<void*>(b));
    const memory mc(plan.c, engine, c);
    thread_local std::vector<std::byte> scratch;
    scratch.resize(std::max<size_t>(1, plan.scratchpad.get_size()));
    const memory ms(plan.scratchpad, engine, scratch.data());
    plan.matmul->execute(stream, {{DNNL_ARG_SRC, ma},
                                  {DNNL_ARG_WEIGHTS, mb},
                                  {DNNL_ARG_DST, mc},
                                  {DNNL_ARG_SCRATCHPAD, ms}});
    stream.wait();
  } catch (const dnnl::error& e) {
    throw Error(fmt::format("{} GEMM {}x{}x{}: oneDNN's matmul failed: {}",
                            plan.a.data_type() == memory::data_type::f32 ? "fp32" : "bf16", m, n, k,
                            e.what()));
  }
}

}  // namespace

void gemm_bf16(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
               const void* a, int64_t lda, const void* b, int64_t ldb, float beta, float* c,
               int64_t ldc) {
  if (m == 0 || n == 0) return;
  const int64_t ca = trans_a ? m : k, cb = trans_b ? k : n;  // each operand's row length
  if (hardware_bf16() && k > 0) {
    // oneDNN's AMX and AVX512_BF16 kernels take dense matrices only (others go to a slower
    // generic kernel): a strided operand or C is copied to this thread's dense scratch, which
    // changes no value.
    thread_local std::vector<uint16_t> dense_a, dense_b;
    thread_local std::vector<float> dense_c;
    const auto* a16 = static_cast<const uint16_t*>(a);
    const auto* b16 = static_cast<const uint16_t*>(b);
    if (lda != ca) a16 = packed(a16, trans_a ? k : m, ca, lda, dense_a);
    if (ldb != cb) b16 = packed(b16, trans_b ? n : k, cb, ldb, dense_b);
    float* c32 = c;
    if (ldc != n) {
      dense_c.resize(static_cast<size_t>(m * n));
      c32 = dense_c.data();
      if (beta != 0.0f) copy_rows(c, ldc, c32, n, m, n);
    }
    const bool small = serial_here || 2.0 * double(m) * double(n) * double(k) < kSerialFlops;
    const auto plan =
        plan_for({false, trans_a, trans_b, m, n, k, ca, cb, n, std::bit_cast<uint32_t>(alpha),
                  std::bit_cast<uint32_t>(beta), small ? 1 : gemm_threads()});
    if (plan->matmul) {
      run(*plan, a16, b16, c32, m, n, k);
      if (c32 != c) copy_rows(c32, n, c, ldc, m, n);
      return;
    }
  }
  // Each operand widened to fp32 (exact) into this thread's scratch, then sgemm.
  thread_local std::vector<float> wa, wb;
  const float* fa = widen(a, trans_a ? k : m, ca, lda, wa);
  const float* fb = widen(b, trans_b ? n : k, cb, ldb, wb);
  // The packed copies' leading dimensions: at least 1, as BLAS asks even of an empty matrix.
  const int64_t la = std::max<int64_t>(1, ca), lb = std::max<int64_t>(1, cb);
  // Under SerialGemms (attention's kv heads on oneTBB's threads) on this thread alone, as the
  // fp32 GEMMs there: OpenBLAS's threads inside each head's task would contend for the cores.
  if (serial_here)
    gemm_f32_serial(trans_a, trans_b, m, n, k, alpha, fa, la, fb, lb, beta, c, ldc);
  else
    gemm(trans_a, trans_b, m, n, k, alpha, fa, la, fb, lb, beta, c, ldc);
}

void gemm_f32_serial(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
                     const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
                     int64_t ldc) {
  if (m == 0 || n == 0) return;
  if (k > 0) {
    const auto plan = plan_for({true, trans_a, trans_b, m, n, k, lda, ldb, ldc,
                                std::bit_cast<uint32_t>(alpha), std::bit_cast<uint32_t>(beta), 1});
    if (plan->matmul) return run(*plan, a, b, c, m, n, k);
  }
  gemm(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

bool serial_gemms_here() { return serial_here; }

void set_bf16_gemm_threads(int threads) {
  chosen_threads.store(std::max(0, threads), std::memory_order_relaxed);
}

int bf16_gemm_threads() { return gemm_threads(); }

SerialGemms::SerialGemms() : previous_(serial_here) { serial_here = true; }
SerialGemms::~SerialGemms() { serial_here = previous_; }

std::string bf16_gemm_path() {
  const Plan p = make_plan({false, false, false, 1024, 1024, 1024, 1024, 1024, 1024,
                            std::bit_cast<uint32_t>(1.0f), 0, gemm_threads()});
  if (!p.matmul) return "widened to fp32, OpenBLAS sgemm";
  return "oneDNN " + p.implementation;
}

}  // namespace outcore::device::cpu
