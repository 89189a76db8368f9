// The CUDA compute backend (see compute_backend.hpp): every operation is a kernel of
// cuda_kernels.hpp, a cuBLASLt GEMM or an async copy, queued on the backend's own compute
// stream of a CudaDevice; finish() synchronizes that stream. Compiled only where nvcc exists.
//
// The backend's own small buffers (staged token / target ids, constant tables) and cuBLASLt's
// workspace are allocated outside the device's byte budget: they are a few MiB at most,
// independent of the model's size.
#include <cuda_runtime.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "common/error.hpp"
#include "engine/device/compute_backend.hpp"
#include "engine/device/cuda_check.hpp"
#include "engine/device/cuda_kernels.hpp"
#include "engine/device/device.hpp"

namespace outcore::device {
namespace {

class CudaBackend final : public ComputeBackend {
 public:
  explicit CudaBackend(Device& device) : name_(device.name()) {
    stream_ = device.create_stream("compute");  // makes the device current on this thread
    CUDA_CHECK(cudaGetDevice(&ordinal_));
    handle_ = stream_->native_handle();
    gemm_ = std::make_unique<cuda::Gemm>();
  }
  ~CudaBackend() override {
    cudaStreamSynchronize(native());
    for (void* p : constants_) cudaFree(p);
    for (IdSlot& s : ids_) {
      cudaFree(s.device);
      cudaFreeHost(s.host);
    }
  }

  std::string name() const override { return name_; }

  void copy(void* dst, const void* src, size_t bytes) override {
    if (bytes == 0 || dst == src) return;
    CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, native()));
  }
  void zero(void* dst, size_t bytes) override {
    if (bytes != 0) CUDA_CHECK(cudaMemsetAsync(dst, 0, bytes, native()));
  }
  void upload(void* dst, const void* host, size_t bytes) override {
    // From pageable memory the call returns once `host` has been staged by the driver.
    if (bytes != 0) CUDA_CHECK(cudaMemcpyAsync(dst, host, bytes, cudaMemcpyHostToDevice, native()));
  }
  void download(void* host, const void* src, size_t bytes) override {
    if (bytes == 0) return;
    CUDA_CHECK(cudaMemcpyAsync(host, src, bytes, cudaMemcpyDeviceToHost, native()));
    CUDA_CHECK(cudaStreamSynchronize(native()));
  }
  const float* constant(std::span<const float> host) override {
    current();
    void* p = nullptr;
    CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(host.size_bytes(), 1)));
    constants_.push_back(p);
    CUDA_CHECK(cudaMemcpy(p, host.data(), host.size_bytes(), cudaMemcpyHostToDevice));
    return static_cast<const float*>(p);
  }
  const int32_t* stage_ids(const int32_t* host, int64_t n, int slot) override {
    if (slot < 0 || slot > 1) throw InvalidArgument("stage_ids: slot must be 0 or 1");
    IdSlot& s = ids_[slot];
    const size_t bytes = static_cast<size_t>(n) * sizeof(int32_t);
    if (bytes > s.capacity) {
      CUDA_CHECK(cudaStreamSynchronize(native()));  // the old buffers may still be read
      cudaFree(s.device);
      cudaFreeHost(s.host);
      s = {};
      current();
      CUDA_CHECK(cudaMalloc(&s.device, bytes));
      CUDA_CHECK(cudaMallocHost(&s.host, bytes));
      s.capacity = bytes;
    } else {
      // The pinned staging copy of this slot's previous ids may still be in flight.
      CUDA_CHECK(cudaStreamSynchronize(native()));
    }
    std::memcpy(s.host, host, bytes);
    CUDA_CHECK(cudaMemcpyAsync(s.device, s.host, bytes, cudaMemcpyHostToDevice, native()));
    return static_cast<const int32_t*>(s.device);
  }
  void finish() override {
    CUDA_CHECK(cudaStreamSynchronize(native()));
    CUDA_CHECK(cudaGetLastError());
  }

  void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, float alpha,
            const float* a, int64_t lda, const float* b, int64_t ldb, float beta, float* c,
            int64_t ldc) override {
    if (m == 0 || n == 0) return;
    current();
    gemm_->run(trans_a, trans_b, m, n, k, alpha, a, lda, b, ldb, DType::F32, beta, c, ldc, handle_);
  }
  void to_fp32(const void* src, DType dtype, float* dst, int64_t n) override {
    cuda::to_fp32(src, dtype, dst, n, handle_);
  }
  void add_inplace(float* y, const float* x, int64_t n) override {
    cuda::add_inplace(y, x, n, handle_);
  }
  void rmsnorm_forward(const float* x, const float* w, float eps, int64_t rows, int64_t dim,
                       float* y, float* rstd) override {
    cuda::rmsnorm_forward(x, w, eps, rows, dim, y, rstd, handle_);
  }
  void rmsnorm_backward(const float* dy, const float* x, const float* w, const float* rstd,
                        int64_t rows, int64_t dim, float* dx, float* dw) override {
    cuda::rmsnorm_backward(dy, x, w, rstd, rows, dim, dx, dw, handle_);
  }
  void rope(float* x, int64_t rows, int64_t seq, int64_t heads, int64_t head_dim, const float* cos,
            const float* sin, bool inverse) override {
    cuda::rope(x, rows, seq, heads, head_dim, cos, sin, inverse, handle_);
  }
  void swiglu_forward(const float* g, const float* u, float* a, int64_t n) override {
    cuda::swiglu_forward(g, u, a, n, handle_);
  }
  void swiglu_backward(const float* da, const float* g, const float* u, float* dg, float* du,
                       int64_t n) override {
    cuda::swiglu_backward(da, g, u, dg, du, n, handle_);
  }
  void causal_softmax_forward(float* scores, float* lse, int64_t rows, int64_t keys,
                              int64_t first_query) override {
    cuda::causal_softmax_forward(scores, lse, 1, rows, keys, first_query, handle_);
  }
  void causal_softmax_backward(float* scores, float* dp, const float* lse, int64_t rows,
                               int64_t keys, int64_t first_query) override {
    cuda::causal_softmax_backward(scores, dp, lse, 1, rows, keys, first_query, handle_);
  }
  void cross_entropy(float* logits, const int32_t* targets, int64_t rows, int64_t vocab, float coef,
                     bool grad, float* row_loss) override {
    cuda::cross_entropy(logits, targets, rows, vocab, coef, grad, row_loss, handle_);
  }
  void embedding_forward(const void* table, DType dtype, const int32_t* ids, int64_t n,
                         int64_t hidden, float* out) override {
    cuda::embedding_forward(table, dtype, ids, n, hidden, out, handle_);
  }
  void embedding_backward(const int32_t* ids, const float* dy, int64_t n, int64_t hidden,
                          float* grad) override {
    cuda::embedding_backward(ids, dy, n, hidden, grad, handle_);
  }

 private:
  struct IdSlot {
    void* device = nullptr;
    void* host = nullptr;  // pinned staging
    size_t capacity = 0;
  };

  cudaStream_t native() const { return static_cast<cudaStream_t>(handle_); }
  void current() const { CUDA_CHECK(cudaSetDevice(ordinal_)); }

  std::string name_;
  int ordinal_ = 0;
  std::unique_ptr<Stream> stream_;
  void* handle_ = nullptr;  // stream_'s cudaStream_t
  std::unique_ptr<cuda::Gemm> gemm_;
  std::vector<void*> constants_;
  IdSlot ids_[2];
};

}  // namespace

std::unique_ptr<ComputeBackend> make_cuda_backend(Device& device) {
  if (device.kind() != DeviceKind::Cuda)
    throw InvalidArgument("make_cuda_backend: device " + device.name() + " is not a CUDA device");
  return std::make_unique<CudaBackend>(device);
}

}  // namespace outcore::device
