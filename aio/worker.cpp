// aio I/O thread: takes slices from its queue, cuts them into block_size requests, keeps up to
// queue_depth in flight on its own IoQueue, resubmits short transfers and records failures.
// Reads and writes are issued from two lists, each in arrival order: when both have work, the
// next request comes from the direction with fewer requests in flight, so a read queued behind
// a long write (a parameter fetch behind a gradient write-back) shares the queue with it
// instead of waiting for its end, and the drive sees both at once, as in its mixed rate.
// Nothing is allocated here after start().
#include <algorithm>
#include <cerrno>
#include <future>

#include "aio/engine_internal.hpp"
#include "common/log.hpp"
#include "common/trace.hpp"

namespace outcore::aio::detail {
namespace {

constexpr uint32_t kMaxRetries = 8;  // for -EAGAIN / -EINTR completions

uint64_t micros_between(Clock::time_point a, Clock::time_point b) {
  return b > a ? std::chrono::duration_cast<std::chrono::microseconds>(b - a).count() : 0;
}

}  // namespace

Worker::Worker(EngineCore& core, const Options& opt, IoBackend& backend)
    : core_(core), opt_(opt), backend_(backend) {
  pieces_.resize(opt.queue_depth);
  free_pieces_.reserve(opt.queue_depth);
  for (uint32_t i = opt.queue_depth; i > 0; --i) free_pieces_.push_back(i - 1);
  cqes_.resize(opt.queue_depth);
}

Worker::~Worker() {
  {
    std::lock_guard lock(mu_);
    stop_ = true;
  }
  cv_.notify_one();
  if (thread_.joinable()) thread_.join();
}

void Worker::start() {
  std::exception_ptr error;
  std::promise<void> ready;
  auto started = ready.get_future();
  thread_ = std::thread([this, &error, &ready] {
    try {
      queue_ = backend_.make_queue(opt_.queue_depth);
    } catch (...) {
      error = std::current_exception();
    }
    bool ok = error == nullptr;
    ready.set_value();
    if (ok) loop();
  });
  started.wait();
  if (error) {
    thread_.join();
    std::rethrow_exception(error);
  }
}

void Worker::enqueue(Slice* s) {
  s->next = nullptr;
  {
    std::lock_guard lock(mu_);
    if (queue_tail_ != nullptr) {
      queue_tail_->next = s;
    } else {
      queue_head_ = s;
    }
    queue_tail_ = s;
  }
  cv_.notify_one();
}

int Worker::run_control(const std::function<int(IoQueue&)>& fn) {
  std::unique_lock lock(mu_);
  control_ = &fn;
  control_done_ = false;
  cv_.notify_one();
  control_cv_.wait(lock, [&] { return control_done_; });
  return control_result_;
}

void Worker::collect_stats(DirectionCounters& out, bool reset) {
  std::lock_guard lock(stats_mu_);
  for (int d = 0; d < 2; ++d) {
    const DirectionStats& s = d ? stats_.write : stats_.read;
    DirectionStats& o = d ? out.write : out.read;
    o.bytes += s.bytes;
    o.requests += s.requests;
    o.resubmits += s.resubmits;
    o.errors += s.errors;
    o.latency.merge(s.latency);
  }
  if (reset) stats_ = {};
}

void Worker::loop() {
  while (true) {
    if (inflight_ == 0 && idle() && !wait_for_work()) return;
    take_queued();
    // overlap_events: refill as soon as a slot frees; otherwise one batch at a time.
    if (opt_.overlap_events || inflight_ == 0) fill();
    submit_prepared();
    if (inflight_ > 0) reap();
  }
}

// Blocks until work, a control request or stop. Returns false to stop.
bool Worker::wait_for_work() {
  std::unique_lock lock(mu_);
  while (true) {
    if (control_ != nullptr) {
      control_result_ = (*control_)(*queue_);
      control_ = nullptr;
      control_done_ = true;
      control_cv_.notify_all();
      continue;
    }
    if (queue_head_ != nullptr) return true;
    if (stop_) return false;
    cv_.wait(lock);
  }
}

void Worker::take_queued() {
  Slice* head;
  {
    std::lock_guard lock(mu_);
    head = std::exchange(queue_head_, nullptr);
    queue_tail_ = nullptr;
  }
  for (Slice* s = head; s != nullptr;) {
    Slice* next = s->next;
    s->fixed_file = fixed_slot(s->file_serial);
    s->next = nullptr;
    Active& a = active_[s->write ? 1 : 0];
    if (a.tail != nullptr) {
      a.tail->next = s;
    } else {
      a.head = s;
    }
    a.tail = s;
    s = next;
  }
}

void Worker::fill() {
  while (!idle() && !free_pieces_.empty()) {
    int d = active_[0].head != nullptr ? 0 : 1;
    if (active_[0].head != nullptr && active_[1].head != nullptr &&
        active_[1].inflight < active_[0].inflight)
      d = 1;
    Slice* s = active_[d].head;
    uint64_t len = std::min<uint64_t>(opt_.block_size, s->length - s->issued);
    uint32_t index = free_pieces_.back();
    Piece& p = pieces_[index];
    p = Piece{s, s->buf + s->issued, s->offset + s->issued, static_cast<uint32_t>(len), 0, 0, {}};
    if (!prepare_piece(index)) break;
    if (s->issued == 0) s->trace_start_ns = trace::enabled() ? trace::now_ns() : -1;
    free_pieces_.pop_back();
    s->issued += len;
    ++s->inflight;
    ++active_[d].inflight;
    if (s->issued == s->length) drop_front_if(s);
  }
}

// Hands piece `index` (from its `done` byte on) to the queue. false if the queue is full.
bool Worker::prepare_piece(uint32_t index) {
  Piece& p = pieces_[index];
  IoRequest r;
  r.fd = p.slice->fd;
  r.fixed_file = p.slice->fixed_file;
  r.write = p.slice->write;
  r.buf = p.buf + p.done;
  r.len = p.len - p.done;
  r.offset = p.offset + p.done;
  r.buf_index = buffer_index(p.buf + p.done, r.len);
  r.user_data = index;
  p.start = Clock::now();
  if (!queue_->prepare(r)) return false;
  ++inflight_;
  ++unsubmitted_;
  if (opt_.single_submit) submit_prepared();
  return true;
}

void Worker::submit_prepared() {
  bool warned = false;
  while (unsubmitted_ > 0) {
    int rc = queue_->submit();
    if (rc > 0) {
      unsubmitted_ -= std::min<uint32_t>(static_cast<uint32_t>(rc), unsubmitted_);
      continue;
    }
    if (rc == -EINTR) continue;
    // Out of kernel resources: completions free them, so reap first if any are in flight.
    if (inflight_ > unsubmitted_ && (rc == 0 || rc == -EAGAIN || rc == -EBUSY)) return;
    if (!warned) {
      log::warn("aio: submitting I/O failed ({}); retrying", errno_string(rc < 0 ? -rc : EAGAIN));
      warned = true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

void Worker::reap() {
  int n = queue_->reap(cqes_, std::chrono::nanoseconds(-1));
  if (n < 0) {
    if (n != -EINTR) log::warn("aio: waiting for completions failed: {}", errno_string(-n));
    return;
  }
  Clock::time_point now = Clock::now();
  std::lock_guard lock(stats_mu_);
  for (int i = 0; i < n; ++i) complete(cqes_[i], now);
}

// Called with stats_mu_ held.
void Worker::complete(const IoCompletion& c, Clock::time_point now) {
  if (c.user_data >= pieces_.size()) {
    log::error("aio: completion for unknown request {} ignored", c.user_data);
    return;
  }
  uint32_t index = static_cast<uint32_t>(c.user_data);
  Piece& p = pieces_[index];
  Slice* s = p.slice;
  DirectionStats& st = s->write ? stats_.write : stats_.read;
  --inflight_;
  ++st.requests;
  st.latency.record(micros_between(p.start, now));
  uint32_t want = p.len - p.done;
  if (c.res < 0) {
    if ((c.res == -EAGAIN || c.res == -EINTR) && p.retries < kMaxRetries) {
      ++p.retries;
      if (prepare_piece(index)) return;
    }
    ++st.errors;
    s->fail(-c.res, false, p.offset + p.done, want);
  } else if (c.res == 0 || static_cast<uint32_t>(c.res) > want) {
    ++st.errors;
    s->fail(EIO, c.res == 0 && !s->write, p.offset + p.done, want);
  } else {
    st.bytes += static_cast<uint64_t>(c.res);
    p.done += static_cast<uint32_t>(c.res);
    if (p.done < p.len) {
      ++st.resubmits;
      p.retries = 0;
      if (prepare_piece(index)) return;
      ++st.errors;
      s->fail(EBUSY, false, p.offset + p.done, p.len - p.done);
    }
  }
  finish_piece(index);
}

void Worker::finish_piece(uint32_t index) {
  Slice* s = pieces_[index].slice;
  pieces_[index].slice = nullptr;
  free_pieces_.push_back(index);
  --s->inflight;
  --active_[s->write ? 1 : 0].inflight;
  if (s->err != 0) drop_front_if(s);  // issue nothing more for a failed slice
  if (s->inflight == 0 && (s->err != 0 || s->issued == s->length)) {
    if (s->trace_start_ns >= 0) trace_slice(*s);
    core_.slice_done(s);  // takes the engine mutex (lock order: stats_mu_, then engine)
  }
}

// Only a list's front slice is ever partly issued, so a slice to drop is at the front of its
// list or gone.
void Worker::drop_front_if(Slice* s) {
  Active& a = active_[s->write ? 1 : 0];
  if (a.head != s) return;
  a.head = s->next;
  if (a.head == nullptr) a.tail = nullptr;
  s->next = nullptr;
}

// A slice is one span from its first request's issue to its last completion; slices overlap
// on one thread (queue depth), so they go to this thread's lane pool.
void Worker::trace_slice(const Slice& s) const {
  trace::complete(s.write ? "write" : "read", "io", s.trace_start_ns,
                  {.bytes = s.err == 0 ? static_cast<int64_t>(s.length) : -1,
                   .file = s.path ? std::string_view(*s.path) : std::string_view(),
                   .lanes = trace_lanes.c_str()});
}

int Worker::buffer_index(const std::byte* p, uint32_t len) const {
  if (buffers.empty()) return -1;
  auto addr = reinterpret_cast<uintptr_t>(p);
  auto it = std::upper_bound(buffers.begin(), buffers.end(), addr,
                             [](uintptr_t a, const BufferRange& r) { return a < r.begin; });
  if (it == buffers.begin()) return -1;
  --it;
  return addr + len <= it->end ? it->index : -1;
}

int Worker::fixed_slot(uint64_t serial) const {
  if (serial == 0) return -1;
  for (int i = 0; i < kFileSlots; ++i) {
    if (file_serials[i] == serial) return i;
  }
  return -1;
}

}  // namespace outcore::aio::detail
