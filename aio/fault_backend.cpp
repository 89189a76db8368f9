// FaultInjectingBackend: wraps a real backend and makes chosen requests fail, come back
// short or late, so the engine's error paths can be tested on any machine.
#include <algorithm>
#include <cerrno>
#include <mutex>
#include <optional>
#include <thread>
#include <utility>
#include <vector>

#include "aio/aio.hpp"

namespace outcore::aio {

struct FaultInjectingBackend::State {
  std::mutex mu;
  std::vector<Fault> faults;
  uint64_t seen_all = 0;
  uint64_t seen_read = 0;
  uint64_t seen_write = 0;
  uint64_t fired = 0;

  // The fault to apply to the next request (counted here), if any.
  std::optional<Fault> next(bool write) {
    std::lock_guard lock(mu);
    ++seen_all;
    ++(write ? seen_write : seen_read);
    for (const Fault& f : faults) {
      if (f.direction == 0 && write) continue;
      if (f.direction == 1 && !write) continue;
      uint64_t n = f.direction < 0 ? seen_all : (write ? seen_write : seen_read);
      bool hit = n == f.nth || (f.every > 0 && n > f.nth && (n - f.nth) % f.every == 0);
      if (hit) {
        ++fired;
        return f;
      }
    }
    return std::nullopt;
  }
};

namespace {

using Clock = std::chrono::steady_clock;

class FaultQueue final : public IoQueue {
 public:
  FaultQueue(std::unique_ptr<IoQueue> inner, std::shared_ptr<FaultInjectingBackend::State> st,
             unsigned depth)
      : inner_(std::move(inner)), state_(std::move(st)) {
    held_.reserve(depth);
    delayed_.reserve(depth);
    scratch_.resize(depth);
  }

  bool prepare(const IoRequest& r) override {
    std::optional<Fault> f = state_->next(r.write);
    if (!f) return prepare_inner(r);
    switch (f->kind) {
      case Fault::Kind::kEio:
        return synthesize(r, -EIO);
      case Fault::Kind::kEnospc:
        return synthesize(r, -ENOSPC);
      case Fault::Kind::kZero:
        return synthesize(r, 0);
      case Fault::Kind::kShort: {
        IoRequest s = r;
        s.len = short_length(r, f->short_bytes);
        return prepare_inner(s);
      }
      case Fault::Kind::kDelay:
        if (!prepare_inner(r)) return false;
        delayed_.push_back({r.user_data, f->delay});
        return true;
    }
    return prepare_inner(r);
  }

  // Synthesized completions count as submitted, as the IoQueue contract requires.
  int submit() override {
    int rc = inner_->submit();
    if (rc < 0) return rc;
    return rc + static_cast<int>(std::exchange(synthesized_, 0));
  }

  int reap(std::span<IoCompletion> out, std::chrono::nanoseconds timeout) override {
    const Clock::time_point deadline =
        timeout.count() < 0 ? Clock::time_point::max() : Clock::now() + timeout;
    for (;;) {
      size_t n = take_ready(out);
      if (inner_inflight_ > 0) {
        int rc =
            pull_inner(out.subspan(n), n > 0 ? std::chrono::nanoseconds(0) : wait_budget(deadline));
        if (rc < 0) return rc;
        n += static_cast<size_t>(rc);
      } else if (n == 0 && !held_.empty()) {
        std::this_thread::sleep_until(std::min(deadline, earliest_held()));
      }
      n += take_ready(out.subspan(n));
      if (n > 0 || Clock::now() >= deadline) return static_cast<int>(n);
      if (inner_inflight_ == 0 && held_.empty()) return 0;
    }
  }

  int register_buffers(std::span<const std::span<std::byte>> bufs) override {
    return inner_->register_buffers(bufs);
  }
  int unregister_buffers() override { return inner_->unregister_buffers(); }
  int register_file(int slot, int fd) override { return inner_->register_file(slot, fd); }

 private:
  struct Held {
    IoCompletion c;
    Clock::time_point ready;
  };
  struct Delayed {
    uint64_t user_data;
    std::chrono::microseconds delay;
  };

  bool synthesize(const IoRequest& r, int32_t res) {
    held_.push_back({{r.user_data, res}, Clock::now()});
    ++synthesized_;
    return true;
  }

  // A length in (0, len); len itself when the request cannot be shortened (one byte, or
  // one aligned 4 KiB page that O_DIRECT cannot split).
  static uint32_t short_length(const IoRequest& r, uint32_t want) {
    if (want != 0 && want < r.len) return want;
    uint32_t half = r.len / 2;
    if (r.len % 4096 == 0 && r.offset % 4096 == 0) half = half / 4096 * 4096;
    return half == 0 ? r.len : half;
  }

  bool prepare_inner(const IoRequest& r) {
    if (!inner_->prepare(r)) return false;
    ++inner_inflight_;
    return true;
  }

  Clock::time_point earliest_held() const {
    Clock::time_point t = Clock::time_point::max();
    for (const Held& h : held_) t = std::min(t, h.ready);
    return t;
  }

  std::chrono::nanoseconds wait_budget(Clock::time_point deadline) const {
    Clock::time_point until = std::min(deadline, earliest_held());
    if (until == Clock::time_point::max()) return std::chrono::nanoseconds(-1);
    return std::max(std::chrono::nanoseconds(1), until - Clock::now());
  }

  // Moves held completions whose time has come into `out`.
  size_t take_ready(std::span<IoCompletion> out) {
    size_t n = 0;
    Clock::time_point now = Clock::now();
    for (size_t i = 0; i < held_.size() && n < out.size();) {
      if (held_[i].ready <= now) {
        out[n++] = held_[i].c;
        held_.erase(held_.begin() + static_cast<std::ptrdiff_t>(i));
      } else {
        ++i;
      }
    }
    return n;
  }

  // Reaps from the inner queue; completions of delayed requests are held back.
  int pull_inner(std::span<IoCompletion> out, std::chrono::nanoseconds timeout) {
    if (out.empty()) return 0;
    size_t cap = std::min(out.size(), scratch_.size());
    int rc = inner_->reap(std::span(scratch_.data(), cap), timeout);
    if (rc <= 0) return rc;
    inner_inflight_ -= static_cast<unsigned>(rc);
    size_t n = 0;
    for (int i = 0; i < rc; ++i) {
      const IoCompletion& c = scratch_[i];
      auto d = std::find_if(delayed_.begin(), delayed_.end(),
                            [&](const Delayed& x) { return x.user_data == c.user_data; });
      if (d != delayed_.end()) {
        held_.push_back({c, Clock::now() + d->delay});
        delayed_.erase(d);
      } else {
        out[n++] = c;
      }
    }
    return static_cast<int>(n);
  }

  std::unique_ptr<IoQueue> inner_;
  std::shared_ptr<FaultInjectingBackend::State> state_;
  unsigned inner_inflight_ = 0;
  unsigned synthesized_ = 0;  // since the last submit()
  std::vector<Held> held_;
  std::vector<Delayed> delayed_;
  std::vector<IoCompletion> scratch_;
};

}  // namespace

FaultInjectingBackend::FaultInjectingBackend(std::unique_ptr<IoBackend> inner)
    : inner_(std::move(inner)), state_(std::make_shared<State>()) {}

FaultInjectingBackend::~FaultInjectingBackend() = default;

void FaultInjectingBackend::add_fault(const Fault& f) {
  std::lock_guard lock(state_->mu);
  state_->faults.push_back(f);
}

void FaultInjectingBackend::clear_faults() {
  std::lock_guard lock(state_->mu);
  state_->faults.clear();
}

uint64_t FaultInjectingBackend::requests_seen() const {
  std::lock_guard lock(state_->mu);
  return state_->seen_all;
}

uint64_t FaultInjectingBackend::faults_fired() const {
  std::lock_guard lock(state_->mu);
  return state_->fired;
}

std::unique_ptr<IoQueue> FaultInjectingBackend::make_queue(unsigned depth) {
  return std::make_unique<FaultQueue>(inner_->make_queue(depth), state_, depth);
}

std::string FaultInjectingBackend::name() const { return "faults(" + inner_->name() + ")"; }

}  // namespace outcore::aio
