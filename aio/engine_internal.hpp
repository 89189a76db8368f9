// Internal to aio/: the structures shared by the Engine front end (engine.cpp: tickets,
// submit, wait) and its I/O threads (worker.cpp: one IoQueue each).
#pragma once

#include <array>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "aio/aio.hpp"

namespace outcore::aio::detail {

using Clock = std::chrono::steady_clock;

inline constexpr int kFileSlots = 64;

struct TicketSlot;

// A contiguous part of one ticket's span, handled by one I/O thread. Written by the
// submitting thread before it is queued, then only by the owning I/O thread until the
// slice is reported done (under the engine mutex), then read by the waiter.
struct Slice {
  TicketSlot* owner = nullptr;
  Slice* next = nullptr;  // link in the worker's queue, then in its active list
  int fd = -1;
  uint64_t file_serial = 0;
  std::shared_ptr<const std::string> path;
  bool write = false;
  std::byte* buf = nullptr;
  uint64_t offset = 0;  // file offset of buf[0]
  uint64_t length = 0;
  uint64_t issued = 0;    // bytes handed out as requests so far
  uint32_t inflight = 0;  // requests in flight
  int fixed_file = -1;
  int64_t trace_start_ns = -1;  // when its first request was issued, while tracing
  // The first failure: errno (0 = none), end of file, and the failing request's range.
  int err = 0;
  bool eof = false;
  uint64_t err_offset = 0;
  uint64_t err_length = 0;

  void fail(int e, bool at_eof, uint64_t off, uint64_t len) {
    if (err != 0) return;
    err = e;
    eof = at_eof;
    err_offset = off;
    err_length = len;
  }
};

// One ticket. Guarded by Engine::Impl::mu except the slices (see Slice).
struct TicketSlot {
  uint32_t generation = 1;
  bool in_use = false;
  bool waiting = false;  // a wait() is blocked on it
  bool write = false;
  uint32_t pending = 0;  // slices not yet done
  uint32_t nslices = 0;
  uint64_t seq = 0;  // submission order
  std::vector<Slice> slices;
};

struct DirectionCounters {
  DirectionStats read;
  DirectionStats write;
};

class EngineCore;

// One I/O thread and its queue.
class Worker {
 public:
  Worker(EngineCore& core, const Options& opt, IoBackend& backend);
  ~Worker();  // stops and joins
  Worker(const Worker&) = delete;
  Worker& operator=(const Worker&) = delete;

  // Starts the thread and waits until its queue exists; rethrows the queue's error.
  void start();
  // Queues a slice (any thread).
  void enqueue(Slice* s);
  // Runs `fn` on the I/O thread once it has nothing in flight; returns its result.
  int run_control(const std::function<int(IoQueue&)>& fn);
  // Adds this thread's counters to `out`; zeroes them if `reset`.
  void collect_stats(DirectionCounters& out, bool reset);

  // Tables mirrored from the engine, changed only through run_control.
  struct BufferRange {
    uintptr_t begin;
    uintptr_t end;
    int index;
  };
  std::vector<BufferRange> buffers;                 // sorted by begin
  std::array<uint64_t, kFileSlots> file_serials{};  // 0 = free
  // Lane pool of this thread's requests in a trace (set before start()).
  std::string trace_lanes = "aio";

 private:
  struct Piece {
    Slice* slice = nullptr;
    std::byte* buf = nullptr;
    uint64_t offset = 0;
    uint32_t len = 0;
    uint32_t done = 0;
    uint32_t retries = 0;
    Clock::time_point start;
  };

  void thread_main(std::exception_ptr* startup_error);
  void loop();
  bool wait_for_work();
  void take_queued();
  void fill();
  bool prepare_piece(uint32_t index);
  void submit_prepared();
  void reap();
  void complete(const IoCompletion& c, Clock::time_point now);
  void finish_piece(uint32_t index);
  void drop_front_if(Slice* s);
  bool idle() const { return active_[0].head == nullptr && active_[1].head == nullptr; }
  void trace_slice(const Slice& s) const;
  int buffer_index(const std::byte* p, uint32_t len) const;
  int fixed_slot(uint64_t serial) const;

  EngineCore& core_;
  const Options opt_;
  IoBackend& backend_;
  std::unique_ptr<IoQueue> queue_;
  std::thread thread_;

  std::mutex mu_;  // guards queue_head_/tail_, stop_, control_
  std::condition_variable cv_;
  Slice* queue_head_ = nullptr;
  Slice* queue_tail_ = nullptr;
  bool stop_ = false;
  const std::function<int(IoQueue&)>* control_ = nullptr;
  int control_result_ = 0;
  bool control_done_ = false;
  std::condition_variable control_cv_;

  // Owned by the I/O thread. Slices to issue, one list per direction (0 reads, 1 writes),
  // each in arrival order; only a list's front slice is ever partly issued.
  struct Active {
    Slice* head = nullptr;
    Slice* tail = nullptr;
    uint32_t inflight = 0;  // requests of this direction in flight
  };
  std::array<Active, 2> active_;
  std::vector<Piece> pieces_;
  std::vector<uint32_t> free_pieces_;
  std::vector<IoCompletion> cqes_;
  uint32_t inflight_ = 0;     // prepared and not yet completed
  uint32_t unsubmitted_ = 0;  // prepared and not yet submitted

  std::mutex stats_mu_;
  DirectionCounters stats_;
};

// What the workers need from the engine.
class EngineCore {
 public:
  virtual ~EngineCore() = default;
  // Called by a worker when every request of `s` has completed (successfully or not).
  virtual void slice_done(Slice* s) = 0;
};

}  // namespace outcore::aio::detail
