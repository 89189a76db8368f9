// Device base: budgeted allocation and counters shared by every backend.
#include "engine/device/device.hpp"

#include <fmt/format.h>

#include "common/error.hpp"

namespace outcore::device {
namespace {

std::string format_bytes(uint64_t bytes) {
  const double mib = static_cast<double>(bytes) / (1024.0 * 1024.0);
  return fmt::format("{:.1f} MiB ({} bytes)", mib, bytes);
}

}  // namespace

DeviceBuffer::DeviceBuffer(DeviceBuffer&& other) noexcept
    : device_(other.device_), ptr_(other.ptr_), bytes_(other.bytes_) {
  other.device_ = nullptr;
  other.ptr_ = nullptr;
  other.bytes_ = 0;
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    reset();
    device_ = other.device_;
    ptr_ = other.ptr_;
    bytes_ = other.bytes_;
    other.device_ = nullptr;
    other.ptr_ = nullptr;
    other.bytes_ = 0;
  }
  return *this;
}

void DeviceBuffer::reset() noexcept {
  if (ptr_ != nullptr) device_->release(ptr_, bytes_);
  device_ = nullptr;
  ptr_ = nullptr;
  bytes_ = 0;
}

DeviceBuffer Device::alloc(size_t bytes, std::string_view what) {
  if (bytes == 0) return {};
  const uint64_t charged = charged_bytes(bytes);
  free_deferred_until(charged);
  {
    std::lock_guard lock(mu_);
    if (stats_.budget_bytes != 0 && stats_.in_use_bytes + charged > stats_.budget_bytes) {
      throw OutOfMemory(
          fmt::format("device {}: cannot allocate {} for '{}': {} already in use of a {} budget "
                      "(outcore.device_memory_mb)",
                      name(), format_bytes(charged), what, format_bytes(stats_.in_use_bytes),
                      format_bytes(stats_.budget_bytes)));
    }
    stats_.in_use_bytes += charged;  // reserved before the backend call, released on failure
    stats_.peak_bytes = std::max(stats_.peak_bytes, stats_.in_use_bytes);
  }
  void* ptr = nullptr;
  try {
    ptr = do_alloc(charged);
    // Memory still held by released buffers' work: freed, then tried once more.
    if (ptr == nullptr && free_deferred_until(UINT64_MAX)) ptr = do_alloc(charged);
  } catch (...) {  // a failed context, say: the reservation goes back
    std::lock_guard lock(mu_);
    stats_.in_use_bytes -= charged;
    throw;
  }
  std::lock_guard lock(mu_);
  if (ptr == nullptr) {
    stats_.in_use_bytes -= charged;
    throw OutOfMemory(
        fmt::format("device {}: cannot allocate {} for '{}': the device is out of "
                    "memory with {} allocated through outcore",
                    name(), format_bytes(charged), what, format_bytes(stats_.in_use_bytes)));
  }
  ++stats_.live_allocations;
  ++stats_.total_allocations;
  return DeviceBuffer(this, ptr, bytes);
}

void Device::release(void* ptr, size_t bytes) noexcept {
  do_free(ptr, charged_bytes(bytes));
  std::lock_guard lock(mu_);
  stats_.in_use_bytes -= charged_bytes(bytes);
  --stats_.live_allocations;
}

void Device::release_after(DeviceBuffer&& buffer, std::unique_ptr<Event> done) {
  if (!buffer) return;
  if (buffer.device_ != this)
    throw InvalidArgument(
        fmt::format("device {}: release_after of another device's buffer", name()));
  if (done == nullptr)
    throw InvalidArgument(fmt::format("device {}: release_after without an event", name()));
  const uint64_t charged = charged_bytes(buffer.bytes_);
  {
    std::lock_guard lock(mu_);
    deferred_.push_back({buffer.ptr_, charged, std::move(done)});  // may throw: buffer still owns
    stats_.in_use_bytes -= charged;
    stats_.deferred_bytes += charged;
    --stats_.live_allocations;
  }
  buffer.device_ = nullptr;
  buffer.ptr_ = nullptr;
  buffer.bytes_ = 0;
  free_deferred_until(0);
}

void Device::free_deferred(bool wait) noexcept { free_deferred_until(wait ? UINT64_MAX : 0); }

bool Device::free_deferred_until(uint64_t need) noexcept {
  for (bool freed = false;; freed = true) {
    Deferred d;
    bool must_wait = false;
    {
      std::lock_guard lock(mu_);
      if (deferred_.empty()) return freed;
      must_wait = need == UINT64_MAX ||
                  (stats_.budget_bytes != 0 &&
                   stats_.in_use_bytes + stats_.deferred_bytes + need > stats_.budget_bytes);
      d = std::move(deferred_.front());
      deferred_.pop_front();
    }
    // The work before the event is done, or has failed (its error is the stream's to report):
    // either way nothing of it touches the memory any more.
    bool done = true;
    try {
      if (must_wait)
        d.done->synchronize();
      else
        done = d.done->query();
    } catch (...) {
    }
    if (!done) {
      std::lock_guard lock(mu_);
      deferred_.push_front(std::move(d));  // not yet: the ones after it are later work too
      return freed;
    }
    do_free(d.ptr, d.charged);
    d.done.reset();
    std::lock_guard lock(mu_);
    stats_.deferred_bytes -= d.charged;
  }
}

MemoryStats Device::memory_stats() const {
  std::lock_guard lock(mu_);
  return stats_;
}

void Device::reset_peak() {
  std::lock_guard lock(mu_);
  stats_.peak_bytes = stats_.in_use_bytes;
}

std::string ProbeResult::summary() const {
  if (!available) return "no GPU: " + reason;
  std::string out = fmt::format("{} GPU{}:", gpus.size(), gpus.size() == 1 ? "" : "s");
  for (size_t i = 0; i < gpus.size(); ++i) {
    const GpuInfo& g = gpus[i];
    out += fmt::format("{} cuda:{} {} ({:.1f} GiB, sm_{}{})", i == 0 ? "" : ",", g.ordinal, g.name,
                       static_cast<double>(g.total_memory_bytes) / (1 << 30),
                       g.compute_capability_major, g.compute_capability_minor);
  }
  return out;
}

namespace {
thread_local bool t_in_host_function = false;
}  // namespace

std::exception_ptr stream_error(const std::string& stream) {
  try {
    throw;
  } catch (const Error&) {
    return std::current_exception();
  } catch (const std::exception& e) {
    return std::make_exception_ptr(Error(fmt::format("stream '{}': {}", stream, e.what())));
  } catch (...) {
    return std::make_exception_ptr(Error(fmt::format("stream '{}': unknown exception", stream)));
  }
}

bool in_host_function() { return t_in_host_function; }
HostFunctionMark::HostFunctionMark() { t_in_host_function = true; }
HostFunctionMark::~HostFunctionMark() { t_in_host_function = false; }

}  // namespace outcore::device
