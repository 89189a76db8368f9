// CudaDevice and probe(): the Device interface over the CUDA runtime. Compiled only where nvcc
// exists (OUTCORE_HAVE_CUDA).
#include <cuda_runtime.h>

#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <string>

#include "common/error.hpp"
#include "engine/device/cuda/cuda_check.hpp"
#include "engine/device/device.hpp"

namespace outcore::device {
namespace {

// A host function enqueued with cudaLaunchHostFunc, and the stream error it may set.
struct StreamErrorState {
  std::mutex mu;
  std::exception_ptr error;  // GUARDED_BY(mu)
};

struct HostCall {
  std::function<void()> fn;
  std::shared_ptr<StreamErrorState> state;
};

void CUDART_CB run_host_call(void* arg) {
  std::unique_ptr<HostCall> call(static_cast<HostCall*>(arg));
  {
    std::lock_guard lock(call->state->mu);
    if (call->state->error) return;  // the stream already failed: skip
  }
  try {
    call->fn();
  } catch (...) {
    std::lock_guard lock(call->state->mu);
    call->state->error = std::current_exception();
  }
}

class CudaEvent final : public Event {
 public:
  explicit CudaEvent(int ordinal) {
    CUDA_CHECK(cudaSetDevice(ordinal));
    CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
  }
  ~CudaEvent() override { cudaEventDestroy(event_); }
  void synchronize() override { CUDA_CHECK(cudaEventSynchronize(event_)); }
  bool query() override {
    cudaError_t err = cudaEventQuery(event_);
    if (err == cudaErrorNotReady) return false;
    CUDA_CHECK(err);
    return true;
  }
  cudaEvent_t handle() const { return event_; }

 private:
  cudaEvent_t event_ = nullptr;
};

void check_range(const std::string& stream, const void* a, const void* b, size_t bytes) {
  if (bytes != 0 && (a == nullptr || b == nullptr))
    throw InvalidArgument("stream '" + stream + "': " + std::to_string(bytes) +
                          "-byte operation with a null pointer");
}

class CudaStream final : public Stream {
 public:
  CudaStream(std::string name, int ordinal) : name_(std::move(name)), ordinal_(ordinal) {
    CUDA_CHECK(cudaSetDevice(ordinal));
    CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  }
  ~CudaStream() override {
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
  }
  const std::string& name() const override { return name_; }

  void copy_h2d(void* dst, const void* src, size_t bytes) override {
    copy(dst, src, bytes, cudaMemcpyHostToDevice);
  }
  void copy_d2h(void* dst, const void* src, size_t bytes) override {
    copy(dst, src, bytes, cudaMemcpyDeviceToHost);
  }
  void copy_d2d(void* dst, const void* src, size_t bytes) override {
    copy(dst, src, bytes, cudaMemcpyDeviceToDevice);
  }
  void memset(void* dst, int value, size_t bytes) override {
    check_range(name_, dst, dst, bytes);
    if (bytes != 0) CUDA_CHECK(cudaMemsetAsync(dst, value, bytes, stream_));
  }
  void enqueue(std::function<void()> fn) override {
    if (!fn) throw InvalidArgument("stream '" + name_ + "': enqueue of an empty function");
    auto call = std::make_unique<HostCall>(HostCall{std::move(fn), errors_});
    CUDA_CHECK(cudaLaunchHostFunc(stream_, run_host_call, call.get()));
    call.release();  // owned by run_host_call from here
  }
  void record(Event& event) override { CUDA_CHECK(cudaEventRecord(as_cuda(event), stream_)); }
  void wait(Event& event) override { CUDA_CHECK(cudaStreamWaitEvent(stream_, as_cuda(event), 0)); }
  void* native_handle() const override { return stream_; }
  void synchronize() override {
    CUDA_CHECK(cudaStreamSynchronize(stream_));
    std::lock_guard lock(errors_->mu);
    if (errors_->error) std::rethrow_exception(errors_->error);
  }

 private:
  void copy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
    check_range(name_, dst, src, bytes);
    if (bytes != 0) CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, kind, stream_));
  }
  static cudaEvent_t as_cuda(Event& e) {
    auto* ce = dynamic_cast<CudaEvent*>(&e);
    if (ce == nullptr) throw InvalidArgument("CUDA stream: event was not created by a CudaDevice");
    return ce->handle();
  }

  std::string name_;
  int ordinal_;
  cudaStream_t stream_ = nullptr;
  std::shared_ptr<StreamErrorState> errors_ = std::make_shared<StreamErrorState>();
};

class CudaDevice final : public Device {
 public:
  explicit CudaDevice(CudaDeviceOptions options) : ordinal_(options.ordinal) {
    int count = 0;
    CUDA_CHECK(cudaGetDeviceCount(&count));
    if (ordinal_ < 0 || ordinal_ >= count)
      throw InvalidArgument("cuda device " + std::to_string(ordinal_) + " does not exist (" +
                            std::to_string(count) + " GPUs)");
    cudaDeviceProp prop{};
    CUDA_CHECK(cudaGetDeviceProperties(&prop, ordinal_));
    name_ = "cuda:" + std::to_string(ordinal_) + " (" + prop.name + ")";
    set_budget(options.memory_budget_bytes);
    // Device memory comes from the GPU's stream-ordered pool, which keeps freed blocks for
    // reuse: cudaFree would wait for every stream of the device (host functions included, such
    // as a gradient's NVMe write), so a slab freed between two units would stall compute.
    CUDA_CHECK(cudaSetDevice(ordinal_));
    CUDA_CHECK(cudaDeviceGetDefaultMemPool(&pool_, ordinal_));
    uint64_t keep = UINT64_MAX;
    CUDA_CHECK(cudaMemPoolSetAttribute(pool_, cudaMemPoolAttrReleaseThreshold, &keep));
    CUDA_CHECK(cudaStreamCreateWithFlags(&alloc_stream_, cudaStreamNonBlocking));
  }
  ~CudaDevice() override {
    cudaStreamSynchronize(alloc_stream_);
    cudaStreamDestroy(alloc_stream_);
  }

  DeviceKind kind() const override { return DeviceKind::Cuda; }
  std::string name() const override { return name_; }
  bool host_accessible() const override { return false; }
  std::unique_ptr<Stream> create_stream(std::string name) override {
    return std::make_unique<CudaStream>(std::move(name), ordinal_);
  }
  std::unique_ptr<Event> create_event() override { return std::make_unique<CudaEvent>(ordinal_); }
  void register_host(void* ptr, size_t bytes) override {
    CUDA_CHECK(cudaSetDevice(ordinal_));
    CUDA_CHECK(cudaHostRegister(ptr, bytes, cudaHostRegisterPortable));
  }
  void unregister_host(void* ptr) noexcept override {
    cudaSetDevice(ordinal_);
    cudaHostUnregister(ptr);
  }
  uint64_t free_memory_bytes() const override {
    CUDA_CHECK(cudaSetDevice(ordinal_));
    // Blocks the pool keeps for reuse count as free: hand them back to the GPU first.
    CUDA_CHECK(cudaStreamSynchronize(alloc_stream_));
    CUDA_CHECK(cudaMemPoolTrimTo(pool_, 0));
    size_t free = 0, total = 0;
    CUDA_CHECK(cudaMemGetInfo(&free, &total));
    return free;
  }
  void synchronize() override {
    CUDA_CHECK(cudaSetDevice(ordinal_));
    CUDA_CHECK(cudaDeviceSynchronize());
  }

 protected:
  // Allocations and frees are ordered on a stream of their own that runs nothing else; the
  // allocation is complete (usable from every stream) when do_alloc returns. A buffer is freed
  // only once no stream uses it (the Device contract), so its block can be reused at once.
  void* do_alloc(size_t charged) override {
    CUDA_CHECK(cudaSetDevice(ordinal_));
    void* ptr = nullptr;
    cudaError_t err = cudaMallocAsync(&ptr, charged, alloc_stream_);
    if (err == cudaErrorMemoryAllocation) {
      // Blocks cached by the pool (other sizes, or other CudaDevice objects on this GPU) may
      // be what is missing: give them back and try once more.
      cudaGetLastError();
      CUDA_CHECK(cudaStreamSynchronize(alloc_stream_));
      CUDA_CHECK(cudaMemPoolTrimTo(pool_, 0));
      err = cudaMallocAsync(&ptr, charged, alloc_stream_);
    }
    if (err == cudaErrorMemoryAllocation) {
      cudaGetLastError();  // clear the error so later calls work
      return nullptr;
    }
    CUDA_CHECK(err);
    CUDA_CHECK(cudaStreamSynchronize(alloc_stream_));
    return ptr;
  }
  void do_free(void* ptr, size_t /*charged*/) noexcept override {
    cudaSetDevice(ordinal_);
    cudaFreeAsync(ptr, alloc_stream_);
  }

 private:
  int ordinal_;
  std::string name_;
  cudaMemPool_t pool_ = nullptr;         // the GPU's default pool (shared by its CudaDevices)
  cudaStream_t alloc_stream_ = nullptr;  // orders this device's allocations and frees
};

}  // namespace

bool cuda_compiled() { return true; }

ProbeResult probe() {
  ProbeResult result;
  int count = 0;
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    cudaGetLastError();
    result.reason = cudaGetErrorString(err);
    return result;
  }
  if (count == 0) {
    result.reason = "the CUDA runtime reports no device";
    return result;
  }
  for (int i = 0; i < count; ++i) {
    cudaDeviceProp prop{};
    if ((err = cudaGetDeviceProperties(&prop, i)) != cudaSuccess) {
      result.gpus.clear();
      result.reason = std::string("cudaGetDeviceProperties: ") + cudaGetErrorString(err);
      return result;
    }
    result.gpus.push_back(GpuInfo{i, prop.name, prop.totalGlobalMem, prop.major, prop.minor});
  }
  result.available = true;
  return result;
}

std::unique_ptr<Device> make_cuda_device(CudaDeviceOptions options) {
  ProbeResult p = probe();
  if (!p.available) throw InvalidArgument("cannot create a CUDA device: " + p.summary());
  return std::make_unique<CudaDevice>(options);
}

}  // namespace outcore::device
