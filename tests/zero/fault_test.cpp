// Injected I/O faults while prefetching parameters or swapping optimizer state.
#include <gtest/gtest.h>

#include <atomic>

#include "aio/aio.hpp"
#include "tests/zero/zero_test_util.hpp"

namespace outcore::zero::test {
namespace {

using aio::Fault;

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

struct Rig {
  std::shared_ptr<aio::FaultInjectingBackend> faults =
      std::make_shared<aio::FaultInjectingBackend>(aio::make_default_backend());
  std::shared_ptr<aio::IoBackend> backend = faults;
  EngineOptions options() const { return {.io_backend = backend}; }
};

// Runs up to `steps` steps; returns the error message of the first failure, "" if none.
std::string run_until_error(const config::Config& cfg, const model::LlamaModel& model,
                            const Rig& rig, int steps, const char** where,
                            bool wait_each_step = true, bool step_in_backward = false) {
  device::CpuDevice dev;
  comm::LocalComm comm;
  ZeroEngine engine(cfg, model, dev, comm, 5, rig.options());
  const size_t n = static_cast<size_t>(model.tokens());
  try {
    for (int t = 1; t <= steps; ++t) {
      std::vector<int32_t> tok = make_tokens(n + 1, model.config().vocab_size, t, n + 1);
      StepParams sp = step_params(cfg, 1e-3, t, 1.0);
      if (step_in_backward) {
        sp.gradient_clipping = 0;  // every step starts during the backward
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

TEST(ZeroFault, EioWhilePrefetchingParametersStopsWithTheFile) {
  const model::LlamaModel model(tiny_config(false), tiny_options(DType::BF16));
  const std::string dir = swap_dir("fault_param").string();
  const config::Config cfg = make_config(config_json({3, "nvme", "cpu"}, DType::BF16, dir));
  Rig rig;
  // Reads are parameter fetches only (the optimizer is in memory); fail one mid-pass.
  auto eio = std::make_shared<EioOnNth>(4, false);
  rig.backend = eio;
  const char* where = "";
  const std::string msg = run_until_error(cfg, model, rig, 3, &where);
  EXPECT_NE(msg, "") << "the injected read error was not reported";
  EXPECT_STREQ(where, "forward_backward");
  EXPECT_NE(msg.find(dir), std::string::npos) << msg;
  EXPECT_NE(msg.find("param"), std::string::npos) << msg;
  EXPECT_EQ(eio->fired(), 1u);
}

TEST(ZeroFault, EioWhileSwappingOptimizerStateStopsWithTheFile) {
  const model::LlamaModel model(tiny_config(true), tiny_options(DType::BF16));
  const std::string dir = swap_dir("fault_opt").string();
  const config::Config cfg = make_config(config_json({3, "cpu", "nvme"}, DType::BF16, dir));
  Rig rig;
  auto eio = std::make_shared<EioOnNth>(3, false);
  rig.backend = eio;
  const char* where = "";
  const std::string msg = run_until_error(cfg, model, rig, 2, &where);
  EXPECT_NE(msg, "");
  EXPECT_STREQ(where, "step");
  EXPECT_NE(msg.find("optimizer"), std::string::npos) << msg;
}

// Without wait_step, an overlapped step's I/O error surfaces from the next pass, which waits
// for the failed unit.
TEST(ZeroFault, OverlappedStepErrorSurfacesFromTheNextPass) {
  const model::LlamaModel model(tiny_config(true), tiny_options(DType::BF16));
  const std::string dir = swap_dir("fault_opt_overlap").string();
  const config::Config cfg = make_config(config_json({3, "cpu", "nvme"}, DType::BF16, dir));
  Rig rig;
  auto eio = std::make_shared<EioOnNth>(3, false);
  rig.backend = eio;
  const char* where = "";
  const std::string msg = run_until_error(cfg, model, rig, 2, &where, /*wait_each_step=*/false);
  EXPECT_NE(msg, "");
  EXPECT_STREQ(where, "forward_backward");
  EXPECT_NE(msg.find("optimizer"), std::string::npos) << msg;
}

// outcore.step_in_backward: a read error of a tentative step (during the backward) surfaces
// once the step is judged, naming the optimizer file, and the engine shuts down cleanly.
TEST(ZeroFault, EioDuringTheStepInBackwardSurfacesFromTheStep) {
  const model::LlamaModel model(tiny_config(true), tiny_options(DType::BF16));
  const std::string dir = swap_dir("fault_opt_in_backward").string();
  const config::Config cfg = make_config(config_json({3, "cpu", "nvme"}, DType::BF16, dir, "",
                                                     R"(, "outcore": {"step_in_backward": true})"));
  for (const bool wait : {true, false}) {
    SCOPED_TRACE(wait ? "wait_step after each step" : "the next pass");
    Rig rig;
    auto eio = std::make_shared<EioOnNth>(3, false);
    rig.backend = eio;
    const char* where = "";
    const std::string msg = run_until_error(cfg, model, rig, 3, &where, wait, true);
    EXPECT_NE(msg, "");
    EXPECT_STREQ(where, wait ? "step" : "forward_backward");
    EXPECT_NE(msg.find("optimizer"), std::string::npos) << msg;
    EXPECT_EQ(eio->fired(), 1u);
  }
}

TEST(ZeroFault, FailedWriteBackOfParametersStopsTheStep) {
  const model::LlamaModel model(tiny_config(false), tiny_options(DType::F32));
  const std::string dir = swap_dir("fault_write").string();
  const config::Config cfg = make_config(config_json({3, "nvme", "cpu"}, DType::F32, dir));
  Rig rig;
  // Initialisation writes one partition per unit; fail a write of the first step's write-back.
  rig.backend = std::make_shared<EioOnNth>(static_cast<uint64_t>(model.num_units()) + 2, true);
  const char* where = "";
  const std::string msg = run_until_error(cfg, model, rig, 2, &where);
  EXPECT_NE(msg, "");
  EXPECT_STREQ(where, "step");
  EXPECT_NE(msg.find("param"), std::string::npos) << msg;
}

TEST(ZeroFault, ShortAndDelayedTransfersChangeNothing) {
  // fp32: every request is a multiple of 8 KiB, so a short transfer moves at least 4 KiB.
  const model::LlamaModel model(tiny_config(true), tiny_options(DType::F32));
  const RunResult ref = train(make_config(config_json({0}, DType::F32, "")), model, 4);
  const std::string dir = swap_dir("fault_short").string();
  Rig rig;
  rig.faults->add_fault({.kind = Fault::Kind::kShort, .nth = 2, .every = 3});
  rig.faults->add_fault({.kind = Fault::Kind::kDelay, .nth = 1, .every = 4});
  const RunResult r = train(make_config(config_json({3, "nvme", "nvme"}, DType::F32, dir)), model,
                            4, 0, rig.options());
  EXPECT_GT(rig.faults->faults_fired(), 10u);
  expect_bit_identical(ref, r, "with short and delayed I/O");
}

}  // namespace
}  // namespace outcore::zero::test
