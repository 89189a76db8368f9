// cuda::Gemm: row-major GEMMs over cuBLASLt (see cuda_kernels.hpp). A row-major C = op(A) op(B)
// is the column-major C^T = op(B)^T op(A)^T, so B is passed first and the shapes swap. Each
// shape's descriptors, layouts and algorithm are made once and kept (Plan), per alignment of the
// operands' addresses (gemm_alignment), which the heuristic is told. cuBLASLt is loaded when the
// first Gemm is made (lt()), not linked: a process that never computes on a GPU never maps it.
#include <cublasLt.h>
#include <cuda_runtime.h>

#include <array>
#include <map>
#include <memory>
#include <string>
#include <utility>

#include "common/error.hpp"
#include "common/shared_library.hpp"
#include "engine/device/cuda/cuda_check.hpp"
#include "engine/device/cuda/cuda_kernels.hpp"

namespace outcore::device::cuda {
namespace {

// cublasGetStatusString lives in libcublas, which this file does not link: name the code.
[[noreturn]] void throw_cublas(cublasStatus_t st, const char* stmt, const char* file, int line) {
  throw Error("cuBLASLt error " + std::to_string(static_cast<int>(st)) + " (cublasStatus_t) in `" +
              stmt + "` at " + file + ":" + std::to_string(line));
}

#define CUBLAS_CHECK(stmt)                                       \
  do {                                                           \
    cublasStatus_t cublas_check_st_ = (stmt);                    \
    if (cublas_check_st_ != CUBLAS_STATUS_SUCCESS)               \
      throw_cublas(cublas_check_st_, #stmt, __FILE__, __LINE__); \
  } while (0)

// The cuBLASLt functions this file calls, from the library of the toolkit's major version
// (libcublasLt.so.<major>): first beside the CUDA runtime this process linked, then wherever the
// loader finds it. Loaded once, on first use; throws naming the library when it cannot be.
// clang-format off
#define OUTCORE_CUBLASLT_FUNCTIONS(X) \
  X(cublasLtCreate) \
  X(cublasLtDestroy) \
  X(cublasLtMatrixLayoutCreate) \
  X(cublasLtMatrixLayoutDestroy) \
  X(cublasLtMatrixLayoutSetAttribute) \
  X(cublasLtMatmulDescCreate) \
  X(cublasLtMatmulDescDestroy) \
  X(cublasLtMatmulDescSetAttribute) \
  X(cublasLtMatmulPreferenceCreate) \
  X(cublasLtMatmulPreferenceDestroy) \
  X(cublasLtMatmulPreferenceSetAttribute) \
  X(cublasLtMatmulAlgoGetHeuristic) \
  X(cublasLtMatmul)
// clang-format on

struct CublasLt {
  std::string path;
#define OUTCORE_DECLARE(name) decltype(&::name) name = nullptr;
  OUTCORE_CUBLASLT_FUNCTIONS(OUTCORE_DECLARE)
#undef OUTCORE_DECLARE
};

const CublasLt& lt() {
  static const CublasLt table = [] {
    const std::string soname = "libcublasLt.so." + std::to_string(CUBLAS_VER_MAJOR);
    const std::string beside =
        SharedLibrary::directory_of(reinterpret_cast<const void*>(&cudaRuntimeGetVersion));
    const SharedLibrary lib = SharedLibrary::open(
        "cuBLASLt", {beside.empty() ? std::string() : beside + "/" + soname, soname});
    CublasLt t;
    t.path = lib.path();
#define OUTCORE_RESOLVE(name) t.name = lib.symbol<decltype(t.name)>(#name);
    OUTCORE_CUBLASLT_FUNCTIONS(OUTCORE_RESOLVE)
#undef OUTCORE_RESOLVE
    return t;
  }();
  return table;
}

cudaDataType_t cuda_type(DType t) {
  return t == DType::F32 ? CUDA_R_32F : t == DType::BF16 ? CUDA_R_16BF : CUDA_R_16F;
}

// RAII over the three descriptor kinds a matmul needs.
struct Layout {
  cublasLtMatrixLayout_t h = nullptr;
  Layout(cudaDataType_t t, int64_t rows, int64_t cols, int64_t ld, int64_t batch, int64_t stride) {
    CUBLAS_CHECK(lt().cublasLtMatrixLayoutCreate(&h, t, static_cast<uint64_t>(rows),
                                                 static_cast<uint64_t>(cols), ld));
    if (batch > 1) {
      const int32_t count = static_cast<int32_t>(batch);
      CUBLAS_CHECK(lt().cublasLtMatrixLayoutSetAttribute(h, CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                                                         &count, sizeof count));
      CUBLAS_CHECK(lt().cublasLtMatrixLayoutSetAttribute(
          h, CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET, &stride, sizeof stride));
    }
  }
  ~Layout() { lt().cublasLtMatrixLayoutDestroy(h); }
  Layout(const Layout&) = delete;
  Layout& operator=(const Layout&) = delete;
};

struct MatmulDesc {
  cublasLtMatmulDesc_t h = nullptr;
  MatmulDesc(bool trans_first, bool trans_second) {
    CUBLAS_CHECK(lt().cublasLtMatmulDescCreate(&h, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t ta = trans_first ? CUBLAS_OP_T : CUBLAS_OP_N;
    const cublasOperation_t tb = trans_second ? CUBLAS_OP_T : CUBLAS_OP_N;
    CUBLAS_CHECK(
        lt().cublasLtMatmulDescSetAttribute(h, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof ta));
    CUBLAS_CHECK(
        lt().cublasLtMatmulDescSetAttribute(h, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof tb));
  }
  ~MatmulDesc() { lt().cublasLtMatmulDescDestroy(h); }
  MatmulDesc(const MatmulDesc&) = delete;
  MatmulDesc& operator=(const MatmulDesc&) = delete;
};

// The workspace allowed, and the alignment of cuBLASLt's A, B and C (= D) pointers: the
// heuristic assumes 256 bytes unless told, and an algorithm chosen under that assumption fails
// on a less aligned pointer (a head's columns inside a row, a buffer's offset).
struct Preference {
  cublasLtMatmulPreference_t h = nullptr;
  Preference(uint64_t bytes, uint32_t align_a, uint32_t align_b, uint32_t align_c) {
    CUBLAS_CHECK(lt().cublasLtMatmulPreferenceCreate(&h));
    CUBLAS_CHECK(lt().cublasLtMatmulPreferenceSetAttribute(
        h, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &bytes, sizeof bytes));
    const std::array<std::pair<cublasLtMatmulPreferenceAttributes_t, uint32_t>, 4> aligns{{
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, align_a},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, align_b},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, align_c},
        {CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, align_c},
    }};
    for (const auto& [attr, value] : aligns)
      CUBLAS_CHECK(lt().cublasLtMatmulPreferenceSetAttribute(h, attr, &value, sizeof value));
  }
  ~Preference() { lt().cublasLtMatmulPreferenceDestroy(h); }
  Preference(const Preference&) = delete;
  Preference& operator=(const Preference&) = delete;
};

// The descriptors, layouts and algorithm of one GEMM shape. cuBLASLt's heuristic sees only
// these and the alignments it is told (never the pointers), so a plan serves every call with
// that shape and those alignments.
struct Plan {
  Layout first, second, out;
  MatmulDesc desc;
  cublasLtMatmulAlgo_t algo{};
  Plan(cudaDataType_t t, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, int64_t lda,
       int64_t ldb, int64_t ldc, int64_t batch, int64_t stride_a, int64_t stride_b,
       int64_t stride_c)
      // Column-major: C^T [n, m] = op(B)^T [n, k] x op(A)^T [k, m].
      : first(t, trans_b ? k : n, trans_b ? n : k, ldb, batch, stride_b),
        second(t, trans_a ? m : k, trans_a ? k : m, lda, batch, stride_a),
        out(CUDA_R_32F, n, m, ldc, batch, stride_c),
        desc(trans_b, trans_a) {}
};

// Everything a plan depends on: the shape, the dtype and the operands' alignments.
using PlanKey = std::array<int64_t, 16>;

// Plans kept at most; past it the cache starts over (shapes are few: a model has a handful per
// unit, attention one per query block).
constexpr size_t kMaxPlans = 4096;

}  // namespace

std::string cublaslt_library() { return lt().path; }

struct Gemm::Impl {
  cublasLtHandle_t handle = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
  bool owned = false;  // workspace cudaMalloc'ed here
  std::map<PlanKey, std::unique_ptr<Plan>> plans;
  Impl(void* ws, size_t bytes) : workspace(ws), workspace_bytes(bytes) {
    // The workspace first: a failed cudaMalloc then leaves no handle behind.
    if (workspace == nullptr && workspace_bytes > 0) {
      CUDA_CHECK(cudaMalloc(&workspace, workspace_bytes));
      owned = true;
    }
    try {
      CUBLAS_CHECK(lt().cublasLtCreate(&handle));
    } catch (...) {
      if (owned) cudaFree(workspace);
      throw;
    }
  }
  ~Impl() {
    plans.clear();
    if (owned) cudaFree(workspace);
    lt().cublasLtDestroy(handle);
  }
};

Gemm::Gemm(void* workspace, size_t workspace_bytes)
    : impl_(std::make_unique<Impl>(workspace, workspace_bytes)) {}
Gemm::~Gemm() = default;

void Gemm::run(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
               const void* a, int64_t lda, const void* b, int64_t ldb, DType ab_dtype, float beta,
               float* c, int64_t ldc, StreamHandle stream, int64_t batch, int64_t stride_a,
               int64_t stride_b, int64_t stride_c) {
  if (m == 0 || n == 0 || batch == 0) return;
  if (m < 0 || n < 0 || k <= 0 || batch < 0)
    throw InvalidArgument("gemm: dimensions must be positive (m=" + std::to_string(m) +
                          " n=" + std::to_string(n) + " k=" + std::to_string(k) + ")");
  // Row-major A and B are cuBLASLt's B and A (see the top of this file).
  const int64_t esize = static_cast<int64_t>(dtype_size(ab_dtype));
  const uint32_t align_a = gemm_alignment(b, batch, stride_b * esize),
                 align_b = gemm_alignment(a, batch, stride_a * esize),
                 align_c = gemm_alignment(c, batch, stride_c * int64_t{sizeof(float)});
  const PlanKey key{trans_a,  trans_b,  m,        n,       k,
                    lda,      ldb,      ldc,      batch,   static_cast<int64_t>(ab_dtype),
                    stride_a, stride_b, stride_c, align_a, align_b,
                    align_c};
  std::unique_ptr<Plan>& plan = impl_->plans[key];
  if (plan == nullptr) {
    if (impl_->plans.size() > kMaxPlans) {
      impl_->plans.clear();
      return run(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, ab_dtype, beta, c, ldc, stream,
                 batch, stride_a, stride_b, stride_c);
    }
    auto made = std::make_unique<Plan>(cuda_type(ab_dtype), trans_a, trans_b, m, n, k, lda, ldb,
                                       ldc, batch, stride_a, stride_b, stride_c);
    const Preference pref(impl_->workspace_bytes, align_a, align_b, align_c);
    cublasLtMatmulHeuristicResult_t result{};
    int found = 0;
    // No algorithm comes back as CUBLAS_STATUS_NOT_SUPPORTED as often as with none found.
    const cublasStatus_t status = lt().cublasLtMatmulAlgoGetHeuristic(
        impl_->handle, made->desc.h, made->first.h, made->second.h, made->out.h, made->out.h,
        pref.h, 1, &result, &found);
    if (status != CUBLAS_STATUS_SUCCESS || found == 0) {
      impl_->plans.erase(key);
      throw Error(
          "gemm: cuBLASLt has no algorithm for m=" + std::to_string(m) + " n=" + std::to_string(n) +
          " k=" + std::to_string(k) + " batch=" + std::to_string(batch) + " dtype " +
          std::string(dtype_name(ab_dtype)) + " (operands aligned to " + std::to_string(align_a) +
          ", " + std::to_string(align_b) + " and " + std::to_string(align_c) +
          " bytes; cuBLAS status " + std::to_string(static_cast<int>(status)) + ")");
    }
    made->algo = result.algo;
    plan = std::move(made);
  }
  CUBLAS_CHECK(lt().cublasLtMatmul(impl_->handle, plan->desc.h, &alpha, b, plan->first.h, a,
                                   plan->second.h, &beta, c, plan->out.h, c, plan->out.h,
                                   &plan->algo, impl_->workspace, impl_->workspace_bytes,
                                   static_cast<cudaStream_t>(stream)));
}

}  // namespace outcore::device::cuda
