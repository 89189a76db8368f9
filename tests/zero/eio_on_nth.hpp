// An aio backend that fails one chosen request with EIO (tests of injected I/O faults: the
// engine's, and dp_worker's ranks). No test framework: dp_worker is a plain program.
#pragma once

#include <atomic>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "aio/aio.hpp"

namespace outcore::zero::test {

// Fails the nth read (or write) with EIO after really performing it: the request goes to the
// inner backend and only its completion is replaced, so submission accounting is untouched.
class EioOnNth final : public aio::IoBackend {
 public:
  EioOnNth(uint64_t nth, bool write)
      : inner_(aio::make_default_backend()), nth_(nth), write_(write) {}
  std::unique_ptr<aio::IoQueue> make_queue(unsigned depth) override {
    return std::make_unique<Queue>(inner_->make_queue(depth), *this);
  }
  std::string name() const override { return "eio-on-nth"; }
  uint64_t fired() const { return fired_; }

 private:
  class Queue final : public aio::IoQueue {
   public:
    Queue(std::unique_ptr<aio::IoQueue> inner, EioOnNth& owner)
        : inner_(std::move(inner)), owner_(owner) {}
    bool prepare(const aio::IoRequest& r) override {
      if (!inner_->prepare(r)) return false;
      if (r.write == owner_.write_ && ++owner_.seen_ == owner_.nth_) doomed_.push_back(r.user_data);
      return true;
    }
    int submit() override { return inner_->submit(); }
    int reap(std::span<aio::IoCompletion> out, std::chrono::nanoseconds timeout) override {
      const int n = inner_->reap(out, timeout);
      for (int i = 0; i < n; ++i)
        for (size_t k = 0; k < doomed_.size(); ++k)
          if (doomed_[k] == out[i].user_data) {
            out[i].res = -EIO;
            doomed_.erase(doomed_.begin() + static_cast<std::ptrdiff_t>(k));
            ++owner_.fired_;
            break;
          }
      return n;
    }

   private:
    std::unique_ptr<aio::IoQueue> inner_;
    EioOnNth& owner_;
    std::vector<uint64_t> doomed_;
  };
  std::unique_ptr<aio::IoBackend> inner_;
  uint64_t nth_;
  bool write_;
  std::atomic<uint64_t> seen_{0}, fired_{0};
};

}  // namespace outcore::zero::test
