// HostLane: one thread running the engine's host work in order.
#include "engine/zero/host_lane.hpp"

#include "common/trace.hpp"

namespace outcore::zero::detail {

HostLane::HostLane(std::string name) : name_(std::move(name)), thread_([this] { run(); }) {}

HostLane::~HostLane() {
  {
    std::lock_guard lock(m_);
    stop_ = true;
  }
  cv_.notify_all();
  thread_.join();
}

uint64_t HostLane::post(std::function<void()> fn) {
  uint64_t n = 0;
  {
    std::lock_guard lock(m_);
    queue_.push_back(std::move(fn));
    n = ++posted_;
  }
  cv_.notify_all();
  return n;
}

void HostLane::wait_for(uint64_t n) {
  std::unique_lock lock(m_);
  cv_.wait(lock, [&] { return done_ >= n; });
  if (error_) std::rethrow_exception(error_);
}

void HostLane::wait() {
  uint64_t n = 0;
  {
    std::lock_guard lock(m_);
    n = posted_;
  }
  wait_for(n);
}

void HostLane::run() {
  trace::name_thread(name_);
  std::unique_lock lock(m_);
  for (;;) {
    cv_.wait(lock, [&] { return stop_ || !queue_.empty(); });
    if (queue_.empty()) return;  // stopping, and every task posted has run
    std::function<void()> fn = std::move(queue_.front());
    queue_.pop_front();
    const bool skip = error_ != nullptr;
    lock.unlock();
    std::exception_ptr failed;
    if (!skip) {
      try {
        fn();
      } catch (...) {
        failed = std::current_exception();
      }
    }
    fn = nullptr;  // what it holds goes before the task counts as done
    lock.lock();
    if (failed && !error_) error_ = failed;
    ++done_;
    cv_.notify_all();
  }
}

}  // namespace outcore::zero::detail
