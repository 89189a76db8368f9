// Internal to engine/zero: a HostLane runs the host work the engine's device work leads to
// (adding gradients that came down, reading and writing their swap files, posting units to the
// step worker) on a thread of the engine's own, in order, instead of as host functions of a
// device stream. On a GPU those would all run on the CUDA runtime's one callback thread, shared
// by every stream: a long gradient addition there would hold up every other stream's host
// work. A task that needs device work done first waits for its event on the lane's thread
// (Event::synchronize), which also brings that work's error along.
//
// Errors: the first exception a task throws is kept; later tasks are skipped; wait() and
// wait_for() rethrow it (the same exception object, so its type is kept).
//
// Threading: post(), wait() and wait_for() may be called from any thread. The destructor waits
// for the tasks already posted (an error is dropped: call wait() first to see it).
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

namespace outcore::zero::detail {

class HostLane {
 public:
  // Starts the lane's thread; `name` names it in traces.
  explicit HostLane(std::string name);
  ~HostLane();
  HostLane(const HostLane&) = delete;
  HostLane& operator=(const HostLane&) = delete;

  // Queues `fn`; returns its number (1, 2, ...), for wait_for().
  uint64_t post(std::function<void()> fn);
  // Blocks until task `n` and every task before it have run (or been skipped after an error);
  // rethrows the lane's error.
  void wait_for(uint64_t n);
  // wait_for() of the last task posted.
  void wait();

 private:
  void run();

  const std::string name_;
  std::mutex m_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> queue_;  // GUARDED_BY(m_)
  uint64_t posted_ = 0;                      // GUARDED_BY(m_)
  uint64_t done_ = 0;                        // GUARDED_BY(m_)
  std::exception_ptr error_;                 // GUARDED_BY(m_)
  bool stop_ = false;                        // GUARDED_BY(m_)
  std::thread thread_;                       // last: started once the fields exist
};

}  // namespace outcore::zero::detail
