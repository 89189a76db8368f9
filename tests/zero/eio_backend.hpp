// Test helpers for injected I/O faults (tests/zero/fault_test.cpp, gpu_test.cpp): an aio
// backend that fails one chosen request with EIO, and a run of engine steps until the first
// I/O error.
#pragma once

#include <gtest/gtest.h>

#include <atomic>
#include <cerrno>
#include <memory>
#include <string>
#include <vector>

#include "aio/aio.hpp"
#include "tests/zero/zero_test_util.hpp"

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

// Runs up to `steps` steps of one micro-batch on `dev` (the model's backend must compute on it)
// and returns the error message of the first IoError (checked to be EIO), "" if none; `where`
// names the call that threw. With `step_in_backward`, every step is expected first (clipping
// off, so each starts during the backward).
inline std::string run_until_error_on(device::Device& dev, const config::Config& cfg,
                                      const model::LlamaModel& model, EngineOptions options,
                                      int steps, const char** where, bool wait_each_step = true,
                                      bool step_in_backward = false) {
  comm::LocalComm comm;
  ZeroEngine engine(cfg, model, dev, comm, 5, std::move(options));
  const size_t n = static_cast<size_t>(model.tokens());
  try {
    for (int t = 1; t <= steps; ++t) {
      std::vector<int32_t> tok = make_tokens(n + 1, model.config().vocab_size, t, n + 1);
      StepParams sp = step_params(cfg, 1e-3, t, 1.0);
      if (step_in_backward) {
        sp.gradient_clipping = 0;
        engine.expect_step(sp);
      }
      *where = "forward_backward";
      engine.forward_backward(tok.data(), tok.data() + 1, 1.0f, true);
      *where = "step";
      engine.step(sp);
      if (wait_each_step) engine.wait_step();  // an overlapped step's error surfaces here
    }
  } catch (const IoError& e) {
    EXPECT_EQ(e.error_number(), EIO);
    return e.what();
  }
  return "";
}

}  // namespace outcore::zero::test
