// CpuDevice: host memory under a byte budget, streams run by one worker thread each, events
// as generation counters.
#include <fmt/format.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <map>
#include <thread>
#include <unordered_map>

#include "common/error.hpp"
#include "common/log.hpp"
#include "common/trace.hpp"
#include "engine/device/device.hpp"

namespace outcore::device {
namespace {

// Completion state of a CpuEvent, shared with the markers its records enqueue.
struct EventState {
  std::mutex mu;
  std::condition_variable cv;
  uint64_t recorded = 0;     // generation of the latest record()
  uint64_t completed = 0;    // latest generation whose marker has run
  std::exception_ptr error;  // the recording stream's error when `completed` was reached

  void complete(uint64_t gen, std::exception_ptr err) {
    {
      std::lock_guard lock(mu);
      if (gen > completed) {
        completed = gen;
        error = std::move(err);
      }
    }
    cv.notify_all();
  }
  // Blocks until generation `gen` has completed; returns the error it carried.
  std::exception_ptr wait_for(uint64_t gen) {
    std::unique_lock lock(mu);
    cv.wait(lock, [&] { return completed >= gen; });
    return error;
  }
};

class CpuEvent final : public Event {
 public:
  std::shared_ptr<EventState> state = std::make_shared<EventState>();

  void synchronize() override {
    OUTCORE_TRACE_SPAN("event sync", "wait");
    uint64_t target;
    {
      std::lock_guard lock(state->mu);
      target = state->recorded;
    }
    if (auto err = state->wait_for(target)) std::rethrow_exception(err);
  }
  bool query() override {
    std::lock_guard lock(state->mu);
    return state->completed >= state->recorded;
  }
};

CpuEvent& as_cpu_event(Event& e) {
  auto* cpu = dynamic_cast<CpuEvent*>(&e);
  if (cpu == nullptr)
    throw InvalidArgument("CpuDevice stream: event was not created by a CpuDevice");
  return *cpu;
}

void check_range(const std::string& stream, const char* op, const void* a, const void* b,
                 size_t bytes) {
  if (bytes != 0 && (a == nullptr || b == nullptr))
    throw InvalidArgument(
        fmt::format("stream '{}': {} of {} bytes with a null pointer", stream, op, bytes));
}

class CpuStream final : public Stream {
 public:
  // An item runs only while the stream has no error, unless `always` (event markers, waits).
  struct Item {
    std::function<void(std::exception_ptr&)> fn;
  };

  CpuStream(std::string name, uint32_t copy_delay_us)
      : name_(std::move(name)), copy_delay_us_(copy_delay_us), worker_([this] { run(); }) {}

  ~CpuStream() override {
    try {
      synchronize();
    } catch (const std::exception& e) {
      log::error("stream '{}' destroyed with a failed item: {}", name_, e.what());
    }
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    worker_.join();
  }

  const std::string& name() const override { return name_; }

  void copy_h2d(void* dst, const void* src, size_t bytes) override {
    copy("copy_h2d", dst, src, bytes);
  }
  void copy_d2h(void* dst, const void* src, size_t bytes) override {
    copy("copy_d2h", dst, src, bytes);
  }
  void copy_d2d(void* dst, const void* src, size_t bytes) override {
    copy("copy_d2d", dst, src, bytes);
  }

  void memset(void* dst, int value, size_t bytes) override {
    check_range(name_, "memset", dst, dst, bytes);
    push_work([=] { std::memset(dst, value, bytes); });
  }

  void enqueue(std::function<void()> fn) override {
    if (!fn) throw InvalidArgument(fmt::format("stream '{}': enqueue of an empty function", name_));
    push_work([fn = std::move(fn)] {
      const HostFunctionMark mark;
      fn();
    });
  }

  void record(Event& event) override {
    std::shared_ptr<EventState> st = as_cpu_event(event).state;
    uint64_t gen;
    {
      std::lock_guard lock(st->mu);
      gen = ++st->recorded;
    }
    push({[st, gen](std::exception_ptr& err) { st->complete(gen, err); }});
  }

  void wait(Event& event) override {
    std::shared_ptr<EventState> st = as_cpu_event(event).state;
    uint64_t gen;
    {
      std::lock_guard lock(st->mu);
      gen = st->recorded;
    }
    // A failure upstream becomes this stream's failure, so work that depends on it is skipped.
    push({[st, gen](std::exception_ptr& err) {
      OUTCORE_TRACE_SPAN("event wait", "wait");
      if (auto upstream = st->wait_for(gen); upstream && !err) err = upstream;
    }});
  }

  void synchronize() override {
    OUTCORE_TRACE_SPAN("stream sync", "wait");
    std::unique_lock lock(mu_);
    const uint64_t target = pushed_;
    done_cv_.wait(lock, [&] { return done_ >= target; });
    if (error_) std::rethrow_exception(error_);
  }

 private:
  void copy(const char* op, void* dst, const void* src, size_t bytes) {
    check_range(name_, op, dst, src, bytes);
    push_work([=, delay = copy_delay_us_] {
      if (delay > 0) std::this_thread::sleep_for(std::chrono::microseconds(delay));
      OUTCORE_TRACE_SPAN(op, "copy", {.bytes = static_cast<int64_t>(bytes)});
      if (bytes > 0) std::memcpy(dst, src, bytes);  // an empty copy may name no buffer
    });
  }

  void push_work(std::function<void()> fn) {
    push({[fn = std::move(fn), this](std::exception_ptr& err) {
      if (err) return;
      try {
        fn();
      } catch (...) {
        err = stream_error(name_);
      }
    }});
  }

  void push(Item item) {
    {
      std::lock_guard lock(mu_);
      queue_.push_back(std::move(item));
      ++pushed_;
    }
    cv_.notify_one();
  }

  void run() {
    trace::name_thread(name_);
    std::unique_lock lock(mu_);
    for (;;) {
      cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stop_ with nothing left
      Item item = std::move(queue_.front());
      queue_.pop_front();
      std::exception_ptr err = error_;
      lock.unlock();
      item.fn(err);
      lock.lock();
      error_ = err;
      ++done_;
      done_cv_.notify_all();
    }
  }

  const std::string name_;
  const uint32_t copy_delay_us_;
  std::mutex mu_;
  std::condition_variable cv_, done_cv_;
  std::deque<Item> queue_;          // GUARDED_BY(mu_)
  uint64_t pushed_ = 0, done_ = 0;  // GUARDED_BY(mu_)
  std::exception_ptr error_;        // GUARDED_BY(mu_)
  bool stop_ = false;               // GUARDED_BY(mu_)
  std::thread worker_;              // last: starts after the members above exist
};

}  // namespace

struct CpuDevice::Registry {
  std::mutex mu;
  std::vector<Stream*> streams;  // GUARDED_BY(mu)

  // Discrete devices: device view address -> (bytes, read-write alias).
  struct Mapping {
    size_t bytes;
    std::byte* alias;
  };
  mutable std::mutex map_mu;
  std::map<uintptr_t, Mapping> mappings;  // GUARDED_BY(map_mu)

  // Other devices: freed blocks kept for reuse, by size.
  std::mutex cache_mu;
  std::unordered_multimap<size_t, void*> cached;  // GUARDED_BY(cache_mu)
  uint64_t cached_bytes = 0;                      // GUARDED_BY(cache_mu)
  uint64_t cache_limit = 0;

  void drop_cached() { trim_to(0); }  // REQUIRES(cache_mu)
  // Frees cached blocks (any order) until at most `bytes` stay cached. REQUIRES(cache_mu)
  void trim_to(uint64_t bytes) {
    while (cached_bytes > bytes && !cached.empty()) {
      auto victim = cached.begin();
      cached_bytes -= victim->first;
      std::free(victim->second);
      cached.erase(victim);
    }
  }
  ~Registry() {
    std::lock_guard lock(cache_mu);
    drop_cached();
  }

  void* view(const void* p) const {
    const auto a = reinterpret_cast<uintptr_t>(p);
    std::lock_guard lock(map_mu);
    auto it = mappings.upper_bound(a);
    if (it == mappings.begin()) return const_cast<void*>(p);
    --it;
    if (a - it->first >= it->second.bytes) return const_cast<void*>(p);
    return it->second.alias + (a - it->first);
  }
};

namespace {

// A CpuStream that registers itself with its device for Device::synchronize(). `Registry` is
// CpuDevice::Registry (private, hence the template parameter).
template <typename Registry>
class RegisteredStream final : public Stream {
 public:
  RegisteredStream(std::string name, std::shared_ptr<Registry> reg, uint32_t copy_delay_us)
      : inner_(std::move(name), copy_delay_us), reg_(std::move(reg)) {
    std::lock_guard lock(reg_->mu);
    reg_->streams.push_back(&inner_);
  }
  ~RegisteredStream() override {
    std::lock_guard lock(reg_->mu);
    std::erase(reg_->streams, &inner_);
  }
  const std::string& name() const override { return inner_.name(); }
  // Device-side pointers go through the registry's aliases (discrete devices); host sides
  // are used as given, so a device pointer passed as host memory faults.
  void copy_h2d(void* d, const void* s, size_t n) override { inner_.copy_h2d(reg_->view(d), s, n); }
  void copy_d2h(void* d, const void* s, size_t n) override { inner_.copy_d2h(d, reg_->view(s), n); }
  void copy_d2d(void* d, const void* s, size_t n) override {
    inner_.copy_d2d(reg_->view(d), reg_->view(s), n);
  }
  void memset(void* d, int v, size_t n) override { inner_.memset(reg_->view(d), v, n); }
  void enqueue(std::function<void()> fn) override { inner_.enqueue(std::move(fn)); }
  void record(Event& e) override { inner_.record(e); }
  void wait(Event& e) override { inner_.wait(e); }
  void synchronize() override { inner_.synchronize(); }

 private:
  CpuStream inner_;
  std::shared_ptr<Registry> reg_;
};

}  // namespace

CpuDevice::CpuDevice(CpuDeviceOptions options)
    : registry_(std::make_shared<Registry>()),
      discrete_(options.discrete),
      copy_delay_us_(options.copy_delay_us),
      compute_delay_us_(options.compute_delay_us) {
  set_budget(options.memory_budget_bytes);
  registry_->cache_limit = options.cache_bytes != 0           ? options.cache_bytes
                           : options.memory_budget_bytes != 0 ? options.memory_budget_bytes
                                                              : uint64_t{1} << 30;
}

CpuDevice::~CpuDevice() { free_deferred(/*wait=*/true); }

std::unique_ptr<Stream> CpuDevice::create_stream(std::string name) {
  return std::make_unique<RegisteredStream<Registry>>(std::move(name), registry_, copy_delay_us_);
}

std::unique_ptr<Event> CpuDevice::create_event() { return std::make_unique<CpuEvent>(); }

void CpuDevice::synchronize() {
  {
    std::lock_guard lock(registry_->mu);
    for (Stream* s : registry_->streams) s->synchronize();
  }
  free_deferred(/*wait=*/false);
}

void* CpuDevice::host_view(const void* p) const {
  return discrete_ ? registry_->view(p) : const_cast<void*>(p);
}

uint64_t CpuDevice::cached_bytes() const {
  std::lock_guard lock(registry_->cache_mu);
  return registry_->cached_bytes;
}

void* CpuDevice::do_alloc(size_t charged) {
  if (!discrete_) {
    Registry& r = *registry_;
    std::lock_guard lock(r.cache_mu);
    void* p = nullptr;
    if (auto it = r.cached.find(charged); it != r.cached.end()) {
      p = it->second;
      r.cached.erase(it);
      r.cached_bytes -= charged;
    } else {
      // A new block: first give back cached ones beyond what the peak allows beside it
      // (memory_stats already counts this allocation as in use).
      const MemoryStats s = memory_stats();
      r.trim_to(s.peak_bytes - s.in_use_bytes);
      p = std::aligned_alloc(kAllocGranularity, charged);
      if (p == nullptr && !r.cached.empty()) {  // give the cache back and try once more
        r.drop_cached();
        p = std::aligned_alloc(kAllocGranularity, charged);
      }
    }
    return p;
  }
  // The same pages twice: a read-write alias for the streams and the backend, and the
  // PROT_NONE view handed out as the device pointer.
  const int fd = memfd_create("outcore-discrete-device", MFD_CLOEXEC);
  if (fd < 0) throw Error(fmt::format("memfd_create: {}", std::strerror(errno)));
  void* alias = MAP_FAILED;
  void* view = MAP_FAILED;
  if (ftruncate(fd, static_cast<off_t>(charged)) == 0) {
    alias = mmap(nullptr, charged, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    view = mmap(nullptr, charged, PROT_NONE, MAP_SHARED, fd, 0);
  }
  close(fd);
  if (alias == MAP_FAILED || view == MAP_FAILED) {
    if (alias != MAP_FAILED) munmap(alias, charged);
    if (view != MAP_FAILED) munmap(view, charged);
    return nullptr;
  }
  std::lock_guard lock(registry_->map_mu);
  registry_->mappings[reinterpret_cast<uintptr_t>(view)] = {charged,
                                                            static_cast<std::byte*>(alias)};
  return view;
}

void CpuDevice::do_free(void* ptr, size_t bytes) noexcept {
  if (!discrete_) {
    Registry& r = *registry_;
    std::lock_guard lock(r.cache_mu);
    // Live plus cached blocks never exceed the device's peak of live bytes (so the process
    // holds no more than it did at that peak) nor the cache limit.
    const MemoryStats s = memory_stats();  // still counts this block as in use
    const uint64_t limit = std::min<uint64_t>(r.cache_limit, s.peak_bytes - s.in_use_bytes + bytes);
    if (bytes > limit) return std::free(ptr);
    r.trim_to(limit - bytes);  // make room: other blocks go first, then keep this one
    r.cached.emplace(bytes, ptr);
    r.cached_bytes += bytes;
    return;
  }
  Registry::Mapping m{};
  {
    std::lock_guard lock(registry_->map_mu);
    auto it = registry_->mappings.find(reinterpret_cast<uintptr_t>(ptr));
    if (it == registry_->mappings.end()) return;
    m = it->second;
    registry_->mappings.erase(it);
  }
  munmap(ptr, m.bytes);
  munmap(m.alias, m.bytes);
}

}  // namespace outcore::device
