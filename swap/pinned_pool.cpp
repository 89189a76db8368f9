// PinnedPool: one region allocated (and locked, and registered) at construction, carved into
// leases by first fit over a free-extent map that coalesces on release. Leases share the
// region's ownership, so memory is never freed under a live lease.
#include <fmt/format.h>
#include <sys/mman.h>

#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <map>
#include <mutex>

#include "common/log.hpp"
#include "swap/swap.hpp"

namespace outcore::swap {

struct PinnedBuffer::Owner {
  std::mutex mu;
  std::condition_variable freed;
  std::byte* base = nullptr;
  size_t budget = 0;
  bool locked = false;
  bool pool_alive = true;
  RegistrationHook hook;
  bool registered = false;
  std::map<size_t, size_t> free_extents;  // offset -> bytes; GUARDED_BY(mu)
  size_t in_use = 0;                      // GUARDED_BY(mu)
  size_t peak = 0;                        // GUARDED_BY(mu)
  size_t leases = 0;                      // GUARDED_BY(mu)

  ~Owner() {
    if (registered && hook.on_unregister) {
      try {
        hook.on_unregister({base, budget});
      } catch (const std::exception& e) {
        log::error("pinned pool: unregistration hook failed: {}", e.what());
      }
    }
    if (locked) munlock(base, budget);
    std::free(base);
  }

  // First fit. Returns the offset or SIZE_MAX. REQUIRES mu held.
  size_t take(size_t bytes) {
    for (auto it = free_extents.begin(); it != free_extents.end(); ++it) {
      if (it->second < bytes) continue;
      size_t off = it->first, len = it->second;
      free_extents.erase(it);
      if (len > bytes) free_extents.emplace(off + bytes, len - bytes);
      in_use += bytes;
      peak = std::max(peak, in_use);
      ++leases;
      return off;
    }
    return SIZE_MAX;
  }

  void give_back(size_t off, size_t bytes) {
    {
      std::lock_guard lock(mu);
      auto [it, inserted] = free_extents.emplace(off, bytes);
      auto next = std::next(it);
      if (next != free_extents.end() && off + bytes == next->first) {
        it->second += next->second;
        free_extents.erase(next);
      }
      if (it != free_extents.begin()) {
        auto prev = std::prev(it);
        if (prev->first + prev->second == it->first) {
          prev->second += it->second;
          free_extents.erase(it);
        }
      }
      in_use -= bytes;
      --leases;
    }
    freed.notify_all();
  }
};

// ---------------------------------------------------------------------------------------------

PinnedBuffer::PinnedBuffer(std::shared_ptr<Owner> owner, std::byte* data, size_t size)
    : owner_(std::move(owner)), data_(data), size_(size) {}

PinnedBuffer::PinnedBuffer(PinnedBuffer&& other) noexcept
    : owner_(std::move(other.owner_)), data_(other.data_), size_(other.size_) {
  other.data_ = nullptr;
  other.size_ = 0;
}

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& other) noexcept {
  if (this != &other) {
    reset();
    owner_ = std::move(other.owner_);
    data_ = other.data_;
    size_ = other.size_;
    other.data_ = nullptr;
    other.size_ = 0;
  }
  return *this;
}

PinnedBuffer::~PinnedBuffer() { reset(); }

void PinnedBuffer::reset() {
  if (data_ == nullptr) return;
  owner_->give_back(static_cast<size_t>(data_ - owner_->base), capacity());
  owner_.reset();
  data_ = nullptr;
  size_ = 0;
}

// ---------------------------------------------------------------------------------------------

namespace {

void warn_unlocked_once(size_t bytes, int err) {
  static std::atomic<bool> warned{false};
  if (!warned.exchange(true)) {
    log::warn(
        "pinned pool: mlock of {} bytes refused ({}); host buffers stay pageable (raise "
        "RLIMIT_MEMLOCK, e.g. `ulimit -l unlimited`, to lock them)",
        bytes, errno_string(err));
  }
}

}  // namespace

PinnedPool::PinnedPool(const PinnedPoolOptions& options) {
  if (options.budget_bytes == 0) throw InvalidArgument("pinned pool: budget_bytes must be > 0");
  auto owner = std::make_shared<PinnedBuffer::Owner>();
  owner->budget = align_up(options.budget_bytes, kIoAlignment);
  void* p = std::aligned_alloc(kIoAlignment, owner->budget);
  if (p == nullptr) {
    throw OutOfMemory(fmt::format(
        "pinned pool: cannot allocate its budget of {} bytes of host memory", owner->budget));
  }
  owner->base = static_cast<std::byte*>(p);
  if (options.lock) {
    if (mlock(owner->base, owner->budget) == 0) {
      owner->locked = true;
    } else {
      warn_unlocked_once(owner->budget, errno);
    }
  }
  owner->hook = options.hook;
  if (owner->hook.on_register) {
    owner->hook.on_register({owner->base, owner->budget});  // throws: ~Owner frees the region
    owner->registered = true;
  }
  owner->free_extents.emplace(0, owner->budget);
  owner_ = std::move(owner);
}

PinnedPool::~PinnedPool() {
  std::lock_guard lock(owner_->mu);
  owner_->pool_alive = false;
  if (owner_->leases != 0) {
    log::warn(
        "pinned pool destroyed with {} leases ({} bytes) outstanding; its memory is freed "
        "when the last one is released",
        owner_->leases, owner_->in_use);
  }
}

namespace {

size_t checked_request(size_t bytes, size_t budget) {
  if (bytes == 0) throw InvalidArgument("pinned pool: a request of 0 bytes");
  if (bytes > budget || align_up(bytes, kIoAlignment) > budget) {
    throw OutOfMemory(
        fmt::format("pinned pool: request of {} bytes exceeds the whole pool budget of {} bytes",
                    bytes, budget));
  }
  return align_up(bytes, kIoAlignment);
}

}  // namespace

PinnedBuffer PinnedPool::acquire(size_t bytes, std::chrono::milliseconds timeout) {
  PinnedBuffer::Owner& o = *owner_;
  const size_t need = checked_request(bytes, o.budget);
  std::unique_lock lock(o.mu);
  size_t off = SIZE_MAX;
  bool got = o.freed.wait_for(lock, timeout, [&] { return (off = o.take(need)) != SIZE_MAX; });
  if (!got) {
    throw OutOfMemory(fmt::format(
        "pinned pool: request of {} bytes not satisfied within {} ms (budget {} bytes, {} in "
        "use by {} leases)",
        bytes, timeout.count(), o.budget, o.in_use, o.leases));
  }
  return PinnedBuffer(owner_, o.base + off, bytes);
}

std::optional<PinnedBuffer> PinnedPool::try_acquire(size_t bytes) {
  PinnedBuffer::Owner& o = *owner_;
  const size_t need = checked_request(bytes, o.budget);
  std::lock_guard lock(o.mu);
  size_t off = o.take(need);
  if (off == SIZE_MAX) return std::nullopt;
  return PinnedBuffer(owner_, o.base + off, bytes);
}

size_t PinnedPool::budget_bytes() const { return owner_->budget; }

size_t PinnedPool::in_use_bytes() const {
  std::lock_guard lock(owner_->mu);
  return owner_->in_use;
}

size_t PinnedPool::peak_bytes() const {
  std::lock_guard lock(owner_->mu);
  return owner_->peak;
}

size_t PinnedPool::leases() const {
  std::lock_guard lock(owner_->mu);
  return owner_->leases;
}

bool PinnedPool::locked() const { return owner_->locked; }

std::span<std::byte> PinnedPool::region() const { return {owner_->base, owner_->budget}; }

}  // namespace outcore::swap
