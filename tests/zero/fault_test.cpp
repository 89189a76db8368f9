// Injected I/O faults while prefetching parameters or swapping optimizer state.
#include <gtest/gtest.h>

#include <atomic>

#include "aio/aio.hpp"
#include "tests/zero/eio_backend.hpp"
#include "tests/zero/zero_test_util.hpp"

namespace outcore::zero::test {
namespace {

using aio::Fault;

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
  return run_until_error_on(dev, cfg, model, rig.options(), steps, where, wait_each_step,
                            step_in_backward);
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

// The same on a device the host cannot read (a GPU's data path: the read lands in a pinned
// fetch buffer and a stream copy takes it up): the failed read fails the pass, naming the
// file, and no copy or compute goes on with the stale buffer unnoticed.
TEST(ZeroFault, EioWhilePrefetchingOnADiscreteDeviceStopsWithTheFile) {
  device::CpuDevice dev({.discrete = true, .copy_delay_us = 2000});
  const model::LlamaModel model(tiny_config(false), tiny_options(DType::BF16),
                                device::make_backend(dev));
  const std::string dir = swap_dir("fault_param_discrete").string();
  const config::Config cfg = make_config(config_json({3, "nvme", "cpu"}, DType::BF16, dir));
  auto eio = std::make_shared<EioOnNth>(4, false);
  const char* where = "";
  const std::string msg = run_until_error_on(dev, cfg, model, {.io_backend = eio}, 3, &where);
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
