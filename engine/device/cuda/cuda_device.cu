// CudaDevice and probe(): the Device interface over the CUDA runtime. Compiled only where nvcc
// exists (OUTCORE_HAVE_CUDA).
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <exception>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "engine/device/cuda/cuda_check.hpp"
#include "engine/device/device.hpp"

namespace outcore::device {
namespace {

// Errors on a CUDA stream come from its host functions (cudaLaunchHostFunc). Each stream counts
// the host functions it has enqueued; its first error is kept with the count of the host
// function that raised it. A point in a stream (an event's record, a wait, a host function) is
// (state, count so far): the error is "before" it when failed_at <= count, and by the time the
// GPU reaches that point every earlier host function has run, so the check is exact.
struct StreamErrorState {
  std::mutex mu;
  std::exception_ptr error;           // GUARDED_BY(mu)
  uint64_t failed_at = UINT64_MAX;    // GUARDED_BY(mu): count of the failing host function
  std::atomic<uint64_t> enqueued{0};  // host functions enqueued (by the stream's one caller)
};

// A point of some stream, and the streams it waited on before it (transitively).
struct StreamPoint {
  std::shared_ptr<StreamErrorState> state;
  uint64_t count = 0;
};
using Upstream = std::vector<StreamPoint>;

// The first error before any of `points`, or null.
std::exception_ptr error_before(const Upstream& points) {
  for (const StreamPoint& p : points) {
    std::lock_guard lock(p.state->mu);
    if (p.state->error && p.state->failed_at <= p.count) return p.state->error;
  }
  return nullptr;
}

// Adds `p` to `points`, keeping one (the latest) point per stream.
void add_point(Upstream& points, const StreamPoint& p) {
  for (StreamPoint& q : points)
    if (q.state == p.state) {
      q.count = std::max(q.count, p.count);
      return;
    }
  points.push_back(p);
}

// A host function enqueued with cudaLaunchHostFunc: skipped when its stream, or a stream it
// waited on, failed before it; an exception it throws becomes its stream's error.
struct HostCall {
  std::function<void()> fn;
  std::string stream;  // its name, for the error of an exception other than an outcore::Error
  std::shared_ptr<StreamErrorState> state;
  uint64_t count;     // this call's number on its stream
  Upstream upstream;  // the points of other streams this one waited on before the call
};

void CUDART_CB run_host_call(void* arg) {
  std::unique_ptr<HostCall> call(static_cast<HostCall*>(arg));
  std::exception_ptr before = error_before(call->upstream);
  {
    std::lock_guard lock(call->state->mu);
    if (call->state->error) return;  // the stream already failed: skip
    if (before) {                    // a stream this one waited on failed: adopt its error
      call->state->error = before;
      call->state->failed_at = call->count;
      return;
    }
  }
  try {
    const HostFunctionMark mark;
    call->fn();
  } catch (...) {
    std::exception_ptr error = stream_error(call->stream);
    std::lock_guard lock(call->state->mu);
    call->state->error = std::move(error);
    call->state->failed_at = call->count;
  }
}

// Makes GPU `ordinal` current on the calling thread. Streams and events are used from the
// engine's own threads too (its lanes, the step worker): without it, the runtime's first call
// there would bind GPU 0 (a context and its memory on a GPU the run does not use).
void bind(int ordinal) { CUDA_CHECK(cudaSetDevice(ordinal)); }
// The same in a destructor, which must not throw (a failed context fails the next call anyway).
void bind_quietly(int ordinal) { (void)cudaSetDevice(ordinal); }

class CudaEvent final : public Event {
 public:
  explicit CudaEvent(int ordinal) : ordinal_(ordinal) {
    bind(ordinal);
    CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
  }
  ~CudaEvent() override {
    bind_quietly(ordinal_);
    cudaEventDestroy(event_);
  }
  // Rethrows an error raised before the record on the recording stream or the streams it
  // waited on (the CpuDevice contract: events recorded after a failure carry it).
  void synchronize() override {
    bind(ordinal_);
    CUDA_CHECK(cudaEventSynchronize(event_));
    rethrow_carried();
  }
  bool query() override {
    bind(ordinal_);
    cudaError_t err = cudaEventQuery(event_);
    if (err == cudaErrorNotReady) {
      (void)cudaGetLastError();  // not a failure: the next check on this thread must not see it
      return false;
    }
    CUDA_CHECK(err);
    return true;
  }
  cudaEvent_t handle() const { return event_; }
  // Set by the recording stream at record(); read by waits and synchronize().
  void set_points(Upstream points) {
    std::lock_guard lock(mu_);
    points_ = std::move(points);
  }
  Upstream points() const {
    std::lock_guard lock(mu_);
    return points_;
  }

 private:
  void rethrow_carried() const {
    if (std::exception_ptr e = error_before(points())) std::rethrow_exception(e);
  }

  int ordinal_;
  cudaEvent_t event_ = nullptr;
  mutable std::mutex mu_;
  Upstream points_;  // GUARDED_BY(mu_): the record's point and its stream's upstream points
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
    bind_quietly(ordinal_);
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
    bind(ordinal_);
    if (bytes != 0) CUDA_CHECK(cudaMemsetAsync(dst, value, bytes, stream_));
  }
  void enqueue(std::function<void()> fn) override {
    if (!fn) throw InvalidArgument("stream '" + name_ + "': enqueue of an empty function");
    std::lock_guard lock(order_mu_);  // numbers follow the launch order
    const uint64_t count = ++errors_->enqueued;
    auto call =
        std::make_unique<HostCall>(HostCall{std::move(fn), name_, errors_, count, upstream_});
    bind(ordinal_);
    CUDA_CHECK(cudaLaunchHostFunc(stream_, run_host_call, call.get()));
    call.release();  // owned by run_host_call from here
  }
  void record(Event& event) override {
    CudaEvent& e = as_cuda(event);
    std::lock_guard lock(order_mu_);
    Upstream points = upstream_;
    add_point(points, {errors_, errors_->enqueued.load()});
    e.set_points(std::move(points));
    bind(ordinal_);
    CUDA_CHECK(cudaEventRecord(e.handle(), stream_));
  }
  // Later work waits for the event on the GPU; an error the event carries becomes this
  // stream's error at its next host function, event or synchronize (GPU copies and kernels
  // enqueued after the wait still run, on whatever the failed work left).
  void wait(Event& event) override {
    CudaEvent& e = as_cuda(event);
    std::lock_guard lock(order_mu_);
    for (const StreamPoint& p : e.points()) add_point(upstream_, p);
    bind(ordinal_);
    CUDA_CHECK(cudaStreamWaitEvent(stream_, e.handle(), 0));
  }
  void* native_handle() const override { return stream_; }
  const std::shared_ptr<StreamErrorState>& error_state() const { return errors_; }
  void synchronize() override {
    bind(ordinal_);
    naming("synchronize", [&] { CUDA_CHECK(cudaStreamSynchronize(stream_)); });
    Upstream upstream;
    {
      std::lock_guard lock(order_mu_);
      upstream = upstream_;
    }
    // An upstream error is rethrown, not made this stream's: an event recorded here before the
    // wait that brought it carries no error (its later host functions and records adopt it).
    std::exception_ptr before = error_before(upstream);
    {
      std::lock_guard lock(errors_->mu);
      if (errors_->error) std::rethrow_exception(errors_->error);
    }
    if (before) std::rethrow_exception(before);
  }

 private:
  void copy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
    check_range(name_, dst, src, bytes);
    bind(ordinal_);
    if (bytes != 0)
      naming("copy of " + std::to_string(bytes) + " bytes",
             [&] { CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, kind, stream_)); });
  }
  // Runs `call`; a CUDA error it throws names this stream and `what` (a fault of work queued
  // earlier surfaces at the stream's next call).
  template <class F>
  void naming(const std::string& what, F&& call) {
    try {
      call();
    } catch (const Error& e) {
      throw Error("stream " + name_ + ": " + what + ": " + e.what());
    }
  }
  static CudaEvent& as_cuda(Event& e) {
    auto* ce = dynamic_cast<CudaEvent*>(&e);
    if (ce == nullptr) throw InvalidArgument("CUDA stream: event was not created by a CudaDevice");
    return *ce;
  }

  std::string name_;
  int ordinal_;
  cudaStream_t stream_ = nullptr;
  std::shared_ptr<StreamErrorState> errors_ = std::make_shared<StreamErrorState>();
  // Serializes enqueue, record and wait when several threads use the stream: host functions
  // are numbered in launch order.
  std::mutex order_mu_;
  Upstream upstream_;  // GUARDED_BY(order_mu_): the latest point of each stream waited on
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
    total_memory_ = prop.totalGlobalMem;
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
    bind_quietly(ordinal_);
    free_deferred(/*wait=*/true);
    cudaStreamSynchronize(alloc_stream_);
    cudaStreamDestroy(alloc_stream_);
  }

  DeviceKind kind() const override { return DeviceKind::Cuda; }
  std::string name() const override { return name_; }
  bool host_accessible() const override { return false; }
  std::unique_ptr<Stream> create_stream(std::string name) override {
    auto stream = std::make_unique<CudaStream>(std::move(name), ordinal_);
    std::lock_guard lock(streams_mu_);
    std::erase_if(stream_errors_, [](const auto& w) { return w.expired(); });
    stream_errors_.push_back(stream->error_state());
    return stream;
  }
  std::unique_ptr<Event> create_event() override { return std::make_unique<CudaEvent>(ordinal_); }
  void register_host(void* ptr, size_t bytes) override {
    CUDA_CHECK(cudaSetDevice(ordinal_));
    // A refusal (too much to pin) is an error the caller may take (GradientPath copies through
    // its own buffers then): cleared here, it never fails the next launch check.
    if (const cudaError_t err = cudaHostRegister(ptr, bytes, cudaHostRegisterPortable);
        err != cudaSuccess) {
      (void)cudaGetLastError();
      ::outcore::device::detail::throw_cuda_error(
          err, "cudaHostRegister(ptr, bytes, cudaHostRegisterPortable)", __FILE__, __LINE__);
    }
  }
  void unregister_host(void* ptr) noexcept override {
    cudaSetDevice(ordinal_);
    // A failure here (memory never registered) must not surface at the next launch check.
    if (cudaHostUnregister(ptr) != cudaSuccess) (void)cudaGetLastError();
  }
  uint64_t total_memory_bytes() const override { return total_memory_; }
  uint64_t free_memory_bytes() const override {
    CUDA_CHECK(cudaSetDevice(ordinal_));
    // Blocks the pool keeps for reuse count as free: hand them back to the GPU first.
    CUDA_CHECK(cudaStreamSynchronize(alloc_stream_));
    CUDA_CHECK(cudaMemPoolTrimTo(pool_, 0));
    size_t free = 0, total = 0;
    CUDA_CHECK(cudaMemGetInfo(&free, &total));
    return free;
  }
  // The GPU's work, then the first error a live stream of this device holds (a failed host
  // function: a read, an addition on the host), as the Device contract says.
  void synchronize() override {
    CUDA_CHECK(cudaSetDevice(ordinal_));
    CUDA_CHECK(cudaDeviceSynchronize());
    free_deferred(/*wait=*/false);  // their work has finished
    std::vector<std::shared_ptr<StreamErrorState>> live;
    {
      std::lock_guard lock(streams_mu_);
      for (const auto& w : stream_errors_)
        if (auto s = w.lock()) live.push_back(std::move(s));
    }
    for (const auto& s : live) {
      std::lock_guard lock(s->mu);
      if (s->error) std::rethrow_exception(s->error);
    }
  }

 protected:
  // Allocations and frees are ordered on a stream of their own that runs nothing else; the
  // allocation is complete (usable from every stream) when do_alloc returns. A buffer is freed
  // only once no stream uses it (the Device contract; release_after's event has completed), so
  // its block can be reused at once.
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
    if (const cudaError_t sync = cudaStreamSynchronize(alloc_stream_); sync != cudaSuccess) {
      cudaFreeAsync(ptr, alloc_stream_);  // not handed out: not left allocated either
      CUDA_CHECK(sync);
    }
    return ptr;
  }
  void do_free(void* ptr, size_t /*charged*/) noexcept override {
    cudaSetDevice(ordinal_);
    if (cudaFreeAsync(ptr, alloc_stream_) != cudaSuccess) (void)cudaGetLastError();
  }

 private:
  int ordinal_;
  std::string name_;
  uint64_t total_memory_ = 0;  // cudaDeviceProp::totalGlobalMem
  std::mutex streams_mu_;
  // The error state of each stream this device made (a stream gone leaves its entry expired).
  std::vector<std::weak_ptr<StreamErrorState>> stream_errors_;  // GUARDED_BY(streams_mu_)
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
    // A machine without NVIDIA's driver says "insufficient driver" (no libcuda.so to ask).
    result.reason =
        err == cudaErrorInsufficientDriver || err == cudaErrorNoDevice
            ? std::string("no NVIDIA GPU driver or device found (the CUDA runtime says: ") +
                  cudaGetErrorString(err) + ")"
            : std::string(cudaGetErrorString(err));
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
