// Device: the accelerator the model computes on, behind one small interface (in the style of
// ggml-backend). A Device owns a budgeted allocator, ordered asynchronous streams and events.
//
//   CpuDevice   a simulated accelerator: memory is host memory charged against a byte budget
//               (`outcore.device_memory_mb`), streams are queues run by one worker thread each,
//               so copies on one stream overlap compute on another as they would on a GPU.
//   CudaDevice  a real GPU (built only where nvcc exists): memory from the GPU's stream-ordered
//               pool (cudaMallocAsync) under the same budget, cudaStream_t / cudaEvent_t behind
//               the same Stream / Event surface.
// The implementations live one folder per backend: engine/device/cpu/cpu_device.cpp and
// engine/device/cuda/cuda_device.cu.
//
// Where compute runs. The model computes through its device's ComputeBackend
// (compute_backend.hpp, make_backend). The CPU backend (engine/device/cpu) runs host kernels on
// the calling thread, on memory the host may dereference (`host_accessible()`), or on a
// discrete CpuDevice through CpuDevice::host_view; the CUDA backend (engine/device/cuda) queues
// CUDA kernels on its own compute stream of a CudaDevice. On a CpuDevice, an engine that wants
// compute ordered against copies may enqueue the model call on a "compute" stream with
// Stream::enqueue and order it against copy streams with events; one that prefers to compute
// on its own thread waits on an event (Event::synchronize) and calls the model directly.
// Either way copies run on their own streams and overlap the compute. Typical ZeRO-3 use:
//
//   auto copy = dev.create_stream("param-h2d");
//   auto compute = dev.create_stream("compute");
//   auto ready = dev.create_event();
//   copy->copy_h2d(unit_params.data(), host_slab, bytes);   // prefetch unit i+1 ...
//   copy->record(*ready);
//   compute->wait(*ready);                                   // ... while unit i computes
//   compute->enqueue([&] { model.forward(...); });
//
// Threading: every Device, Stream and Event member may be called from any thread unless a
// comment says otherwise. Lifetimes: every DeviceBuffer, Stream and Event must be destroyed
// before the Device that created it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

namespace outcore::device {

class Device;

// Every allocation is charged in multiples of this many bytes and its data pointer is aligned to
// it (CpuDevice: so O_DIRECT can read straight into device buffers).
inline constexpr size_t kAllocGranularity = 4096;

// Bytes an allocation of `bytes` is charged against the budget: `bytes` rounded up to
// kAllocGranularity (0 for 0). Planners use this to predict the allocator's peak exactly.
constexpr size_t charged_bytes(size_t bytes) {
  return (bytes + kAllocGranularity - 1) / kAllocGranularity * kAllocGranularity;
}

// A move-only handle to device memory; returns its bytes to the allocator when destroyed.
// An empty (default-constructed or moved-from) buffer has data() == nullptr and size() == 0.
// REQUIRES: no enqueued stream work still uses the memory when the buffer is destroyed or
// reset (synchronize the stream or an event first, or hand it to Device::release_after), and
// the Device outlives the buffer.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(DeviceBuffer&& other) noexcept;
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { reset(); }

  // Frees the memory now (no-op when empty).
  void reset() noexcept;

  void* data() const { return ptr_; }
  template <typename T>
  T* as() const {
    return static_cast<T*>(ptr_);
  }
  size_t size() const { return bytes_; }  // bytes requested
  explicit operator bool() const { return ptr_ != nullptr; }
  Device* device() const { return device_; }

 private:
  friend class Device;
  DeviceBuffer(Device* device, void* ptr, size_t bytes)
      : device_(device), ptr_(ptr), bytes_(bytes) {}
  Device* device_ = nullptr;
  void* ptr_ = nullptr;
  size_t bytes_ = 0;
};

// The allocator's counters, all in charged bytes (see charged_bytes).
struct MemoryStats {
  uint64_t in_use_bytes = 0;  // currently allocated
  uint64_t peak_bytes = 0;    // highest in_use_bytes since creation or reset_peak()
  uint64_t budget_bytes = 0;  // 0 = unlimited
  uint64_t live_allocations = 0;
  uint64_t total_allocations = 0;  // successful alloc calls since creation
  // Released by release_after, their memory not yet free: the work before their event may
  // still use it. Not in in_use_bytes; alloc keeps in_use_bytes + this within the budget.
  uint64_t deferred_bytes = 0;
};

// A marker in a stream's work. record() on a stream makes the event complete when all work
// enqueued on that stream before the record has finished. An event never recorded is complete.
// Recording again re-arms it (as cudaEventRecord).
class Event {
 public:
  virtual ~Event() = default;
  // Blocks the calling thread until the most recent record() has completed. If work on the
  // recording stream failed before the marker, rethrows that error (an outcore::Error).
  virtual void synchronize() = 0;
  // True when the most recent record() has completed (never blocks).
  virtual bool query() = 0;
};

// An ordered asynchronous queue of work on one device. Work enqueued on one stream runs in
// order, one item at a time; work on different streams runs concurrently unless ordered by
// events. Enqueue calls return at once.
//
// Errors: the first error raised by work on a stream (a failing copy, a throwing enqueue()
// function) is kept; later work on that stream is skipped, and synchronize() and events
// recorded after it rethrow it. Enqueue calls themselves throw InvalidArgument for a null
// pointer with a non-zero size. On CudaDevice only host functions are skipped: GPU copies and
// kernels already queued behind a failure run (on what the failed work left), and the error
// still reaches every synchronize() and event that depends on it.
//
// The destructor waits for the stream's queued work to finish (errors are logged, not thrown).
class Stream {
 public:
  virtual ~Stream() = default;
  virtual const std::string& name() const = 0;

  // Copies `bytes` bytes. REQUIRES: both ranges stay valid (and the source unchanged) until
  // the copy completes, and they do not overlap. `host` memory is ordinary host memory (on
  // CudaDevice, pinned memory makes the copy truly asynchronous).
  virtual void copy_h2d(void* dst_device, const void* src_host, size_t bytes) = 0;
  virtual void copy_d2h(void* dst_host, const void* src_device, size_t bytes) = 0;
  virtual void copy_d2d(void* dst_device, const void* src_device, size_t bytes) = 0;
  // Sets `bytes` bytes of device memory to `value`.
  virtual void memset(void* dst_device, int value, size_t bytes) = 0;

  // Runs `fn` on a host thread in stream order. On CpuDevice this is how compute may be
  // launched (fn may run the CPU backend on device memory); on CudaDevice it is
  // cudaLaunchHostFunc and fn must not call CUDA. An exception thrown by fn becomes the
  // stream's error (see above).
  virtual void enqueue(std::function<void()> fn) = 0;

  // Records `event` at the current end of this stream.
  virtual void record(Event& event) = 0;
  // Makes work enqueued on this stream after this call wait until `event`'s most recent
  // record (at the time of this call) has completed. The host does not block. An error carried
  // by that record becomes this stream's error too (dependent work is skipped, as above).
  virtual void wait(Event& event) = 0;
  // Blocks until every item enqueued so far has finished; rethrows the stream's error.
  virtual void synchronize() = 0;

  // The backend's own stream handle (a cudaStream_t on CudaDevice, for the kernels of
  // engine/device/cuda/cuda_kernels.hpp); nullptr on CpuDevice.
  virtual void* native_handle() const { return nullptr; }
};

// In a catch block: the exception being handled as an outcore::Error (kept as it is when it is
// one, else an Error naming `stream` and its message), for a stream's error state.
std::exception_ptr stream_error(const std::string& stream);

// True on the thread running a function given to Stream::enqueue, while it runs (on a GPU:
// CUDA's one callback thread, shared by every stream; tests check that the engine's host work
// and collectives never run there). Stream implementations mark the call with HostFunctionMark.
bool in_host_function();
class HostFunctionMark {
 public:
  HostFunctionMark();
  ~HostFunctionMark();
  HostFunctionMark(const HostFunctionMark&) = delete;
  HostFunctionMark& operator=(const HostFunctionMark&) = delete;
};

enum class DeviceKind : uint8_t { Cpu, Cuda };

class Device {
 public:
  virtual ~Device() = default;
  Device() = default;
  Device(const Device&) = delete;
  Device& operator=(const Device&) = delete;

  virtual DeviceKind kind() const = 0;
  // "cpu" or "cuda:0 (NVIDIA H100 80GB HBM3)".
  virtual std::string name() const = 0;
  // True when host code may dereference device pointers (the CPU backend's host kernels need
  // this, or CpuDevice::host_view on a discrete CpuDevice).
  virtual bool host_accessible() const = 0;

  // Allocates `bytes` bytes (contents unspecified), aligned to kAllocGranularity, charging
  // charged_bytes(bytes) against the budget. `what` names the request in errors and logs.
  // bytes == 0 returns an empty buffer. Throws OutOfMemory naming `what`, the request, the
  // bytes in use and the budget when the budget (or the hardware) cannot satisfy it.
  // Memory released by release_after whose work is still running counts against the budget
  // too: alloc first frees what has finished, then waits for the oldest such work (on the
  // calling thread) until the request fits; where the hardware is out of memory, it waits for
  // all of it and tries once more.
  DeviceBuffer alloc(size_t bytes, std::string_view what);

  // Releases `buffer` now and frees its memory once `done` has completed (the work recorded
  // before it may still read or write the buffer), so that the host need not wait for that
  // work: a stream-ordered free. Its bytes leave in_use_bytes at once (what planners count)
  // and stay in deferred_bytes until freed; the memory is freed at a later alloc,
  // synchronize() or the device's end. An empty buffer is a no-op. REQUIRES: `buffer` is this
  // device's; `done` was recorded after the last work that uses the buffer, and no work
  // enqueued later uses it. Throws InvalidArgument (the buffer kept) for another device's
  // buffer or a null event.
  void release_after(DeviceBuffer&& buffer, std::unique_ptr<Event> done);

  MemoryStats memory_stats() const;
  // Sets peak_bytes to the current in_use_bytes.
  void reset_peak();
  // Bytes the hardware itself can still allocate (a GPU: cudaMemGetInfo's free bytes), or 0
  // when only the budget limits allocations (the simulated device).
  virtual uint64_t free_memory_bytes() const { return 0; }
  // The hardware's memory size (a GPU: its global memory), or 0 on the simulated device. Unlike
  // free_memory_bytes it does not change with what else the device holds.
  virtual uint64_t total_memory_bytes() const { return 0; }
  // Registers host memory for this device's copies (a GPU: cudaHostRegister, so copies from
  // and to it run asynchronously at full speed) / undoes it. No-ops on the simulated device.
  // unregister_host never throws.
  virtual void register_host(void* /*ptr*/, size_t /*bytes*/) {}
  virtual void unregister_host(void* /*ptr*/) noexcept {}

  // A new stream / event, owned by the caller.
  virtual std::unique_ptr<Stream> create_stream(std::string name) = 0;
  virtual std::unique_ptr<Event> create_event() = 0;

  // Blocks until all work on every live stream of this device has finished; rethrows the
  // first stream error found.
  virtual void synchronize() = 0;

 protected:
  // Backend hooks: allocate / free raw memory of `charged` bytes (a multiple of
  // kAllocGranularity). do_alloc returns nullptr when the hardware itself is out of memory (the
  // base class turns that into OutOfMemory); it is never asked for more than the budget allows.
  // Budget accounting, counters and locking belong to the base class.
  virtual void* do_alloc(size_t charged) = 0;
  virtual void do_free(void* ptr, size_t charged) noexcept = 0;  // charged: as do_alloc's
  // Set once by the subclass constructor. 0 = unlimited.
  void set_budget(uint64_t budget_bytes) { stats_.budget_bytes = budget_bytes; }
  // Frees the memory of every release_after whose event has completed; with `wait`, of every
  // one, waiting for their events. Subclasses call it with `wait` from their destructor (the
  // base class cannot call do_free there) and from synchronize().
  void free_deferred(bool wait) noexcept;

 private:
  friend class DeviceBuffer;
  void release(void* ptr, size_t bytes) noexcept;
  // Frees deferred memory: what has finished, then, waiting oldest first, until `need` more
  // bytes fit in the budget beside in_use_bytes and what stays deferred (UINT64_MAX: all).
  // Returns whether it freed any.
  bool free_deferred_until(uint64_t need) noexcept;

  struct Deferred {
    void* ptr = nullptr;
    uint64_t charged = 0;
    std::unique_ptr<Event> done;
  };

  mutable std::mutex mu_;
  MemoryStats stats_;              // GUARDED_BY(mu_)
  std::deque<Deferred> deferred_;  // GUARDED_BY(mu_): oldest first
};

// Options of the simulated accelerator.
struct CpuDeviceOptions {
  // Allocator budget in bytes; 0 = unlimited. The trainer sets it from
  // `outcore.device_memory_mb` * 2^20.
  uint64_t memory_budget_bytes = 0;
  // Simulates a discrete GPU: host_accessible() is false, and host code cannot dereference
  // device memory. Each allocation is mapped twice: the pointer handed out is a PROT_NONE view
  // (a host access faults at once), and a read-write alias of the same pages is used only by
  // the device's streams and its compute backend (host_view). What runs on such a device is
  // what would run on a GPU: every transfer an explicit stream copy.
  bool discrete = false;
  // Freed blocks kept for reuse by an allocation of the same size, up to this many bytes
  // (0: the budget, or 1 GiB without one) and never more than live plus cached = the peak of
  // live bytes so far, as a GPU's stream-ordered pool keeps them: the engine frees and
  // allocates the same unit slabs every pass, and fresh pages from the kernel cost a page
  // fault and a zeroing each. Not charged to the budget. Discrete devices keep none.
  uint64_t cache_bytes = 0;
  // Simulates a slow link: every stream copy waits this many microseconds before it copies
  // (0: none). Work that reads a buffer another stream is still copying then sees the wrong
  // bytes, so tests of stream ordering fail when a wait is missing.
  uint32_t copy_delay_us = 0;
  // Simulates a slow compute unit: on a discrete device every operation of its CPU backend
  // waits this many microseconds before it runs (0: none), so that what reads a unit's results
  // without waiting for its event sees the wrong bytes.
  uint32_t compute_delay_us = 0;
};

// The simulated accelerator (see the file comment). host_accessible() is true unless
// `discrete`.
class CpuDevice final : public Device {
 public:
  explicit CpuDevice(CpuDeviceOptions options = {});
  ~CpuDevice() override;

  DeviceKind kind() const override { return DeviceKind::Cpu; }
  std::string name() const override { return discrete_ ? "cpu (discrete)" : "cpu"; }
  bool host_accessible() const override { return !discrete_; }
  // The read-write alias of device pointer `p` on a discrete device (any address inside a live
  // allocation); `p` itself for any other pointer (host memory, or a non-discrete device).
  void* host_view(const void* p) const;
  // Bytes of freed blocks kept for reuse (CpuDeviceOptions::cache_bytes).
  uint64_t cached_bytes() const;
  // CpuDeviceOptions::compute_delay_us.
  uint32_t compute_delay_us() const { return compute_delay_us_; }
  std::unique_ptr<Stream> create_stream(std::string name) override;
  std::unique_ptr<Event> create_event() override;
  void synchronize() override;

 protected:
  void* do_alloc(size_t charged) override;
  void do_free(void* ptr, size_t charged) noexcept override;

 private:
  struct Registry;  // the live streams, for synchronize(); the discrete mappings; the cache
  std::shared_ptr<Registry> registry_;
  bool discrete_ = false;
  uint32_t copy_delay_us_ = 0;
  uint32_t compute_delay_us_ = 0;
};

// One GPU as the CUDA runtime reports it.
struct GpuInfo {
  int ordinal = 0;
  std::string name;
  uint64_t total_memory_bytes = 0;
  int compute_capability_major = 0;
  int compute_capability_minor = 0;
};

// What the machine offers. `gpus` is empty when `available` is false, and `reason` then says
// why ("built without CUDA", "CUDA driver version is insufficient for CUDA runtime version").
struct ProbeResult {
  bool available = false;
  std::string reason;
  std::vector<GpuInfo> gpus;
  // One line: "2 GPUs: cuda:0 NVIDIA H100 ... (79.1 GiB, sm_90), ..." or "no GPU: <reason>".
  std::string summary() const;
};

// Asks the CUDA runtime which GPUs exist. Never throws for a missing GPU or driver; works in
// builds without CUDA. Thread-safe.
ProbeResult probe();

// True when this build contains the CUDA device (nvcc was found at configure time).
bool cuda_compiled();

// Options of a CUDA device.
struct CudaDeviceOptions {
  int ordinal = 0;
  uint64_t memory_budget_bytes = 0;  // 0 = unlimited (the GPU's own memory still limits)
};

// A CudaDevice on GPU `options.ordinal`: memory from the GPU's stream-ordered pool under the
// byte budget, cudaStream_t / cudaEvent_t streams and events, cudaMemcpyAsync copies.
// host_accessible() is false. Throws InvalidArgument when the build has no CUDA or the ordinal
// does not exist, and Error naming the CUDA call, file and line when the runtime fails.
std::unique_ptr<Device> make_cuda_device(CudaDeviceOptions options = {});

}  // namespace outcore::device
