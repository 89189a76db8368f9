// Where the trainer's model computes (TrainerOptions::device): training on the simulated
// discrete device (a GPU's data movement: the host never reads device memory, every transfer
// a stream copy) is bit-identical to training on the host-accessible simulated device, through
// validation and a checkpoint round trip; a GPU that is not there is refused by name.
#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "tests/trainer/trainer_test_util.hpp"

namespace outcore::train::testing {
namespace {

struct DeviceOutcome {
  std::vector<double> losses, norms;
  double val = 0;
  Weights weights;
  std::string device;
};

// `steps` steps (validating every 3) on the discrete or the host-accessible simulated device,
// saving into `save` / resuming from `resume` when not empty.
DeviceOutcome train_on(bool discrete, const nlohmann::json& patch, const DemoData& data,
                       int64_t steps = 6, const std::string& save = "",
                       const std::string& resume = "") {
  const model::LlamaConfig mc = tiny_model();
  const config::Config cfg = make_config(patch, mc);
  TrainerOptions o = quiet_options(data, steps);
  o.eval_every = 3;
  o.discrete = discrete;
  o.save_dir = save;
  o.resume_from = resume;
  DeviceOutcome out;
  o.on_step = [&](const StepMetrics& m) {
    out.losses.push_back(m.loss);
    out.norms.push_back(m.grad_norm.value_or(-1.0));
  };
  Trainer tr(cfg, mc, o);
  out.device = tr.device().name();
  const TrainResult r = tr.run();
  out.val = r.final_val_loss.value_or(-1.0);
  out.weights = weights_of(tr);
  return out;
}

TEST(TrainerDevice, DiscreteDeviceTrainsBitIdentically) {
  DemoData data;
  for (const bool bf16 : {false, true}) {
    SCOPED_TRACE(bf16 ? "bf16" : "fp32");
    nlohmann::json patch = nvme_patch(data.file(bf16 ? "swap_bf16" : "swap_fp32"));
    std::filesystem::create_directories(data.file(bf16 ? "swap_bf16" : "swap_fp32"));
    patch["bf16"] = {{"enabled", bf16}};
    patch["gradient_clipping"] = 0.05;
    const DeviceOutcome host = train_on(false, patch, data);
    const DeviceOutcome discrete = train_on(true, patch, data);
    EXPECT_EQ(host.device, "cpu");
    EXPECT_EQ(discrete.device, "cpu (discrete)");
    ASSERT_EQ(host.losses.size(), 6u);
    ASSERT_EQ(discrete.losses.size(), 6u);
    for (size_t i = 0; i < host.losses.size(); ++i) {
      EXPECT_EQ(std::memcmp(&host.losses[i], &discrete.losses[i], sizeof(double)), 0)
          << "loss of step " << i + 1;
      EXPECT_EQ(std::memcmp(&host.norms[i], &discrete.norms[i], sizeof(double)), 0)
          << "norm of step " << i + 1;
    }
    EXPECT_EQ(std::memcmp(&host.val, &discrete.val, sizeof(double)), 0);
    for (size_t u = 0; u < host.weights.master.size(); ++u) {
      EXPECT_TRUE(host.weights.master[u] == discrete.weights.master[u]) << "unit " << u;
      EXPECT_TRUE(host.weights.params[u] == discrete.weights.params[u]) << "unit " << u;
    }
  }
}

// A checkpoint saved on the discrete device after 3 steps and resumed there (state read back
// and published through stream copies only) continues exactly as the run that never stopped.
TEST(TrainerDevice, DiscreteDeviceCheckpointResumesExactly) {
  DemoData data;
  std::filesystem::create_directories(data.file("swap"));
  nlohmann::json patch = nvme_patch(data.file("swap"));
  patch["bf16"] = {{"enabled", true}};
  patch["activation_checkpointing"] = {{"cpu_checkpointing", true}};
  const DeviceOutcome whole = train_on(true, patch, data);
  train_on(true, patch, data, 3, data.file("ckpt"));
  const DeviceOutcome resumed = train_on(true, patch, data, 6, "", data.file("ckpt"));
  ASSERT_EQ(whole.losses.size(), 6u);
  ASSERT_EQ(resumed.losses.size(), 3u);
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(std::memcmp(&whole.losses[3 + i], &resumed.losses[i], sizeof(double)), 0)
        << "loss of step " << 4 + i;
    EXPECT_EQ(std::memcmp(&whole.norms[3 + i], &resumed.norms[i], sizeof(double)), 0)
        << "norm of step " << 4 + i;
  }
  for (size_t u = 0; u < whole.weights.master.size(); ++u) {
    EXPECT_TRUE(whole.weights.master[u] == resumed.weights.master[u]) << "unit " << u;
    EXPECT_TRUE(whole.weights.params[u] == resumed.weights.params[u]) << "unit " << u;
  }
}

// 6 steps of `patch` on the host-accessible and on the discrete device, and the discrete run
// saved after 3 steps and resumed on each device: every run is the discrete uninterrupted one
// (losses, master weights, parameters), which is the host-accessible one.
void expect_resumes_exactly_on_both_devices(const nlohmann::json& patch, const DemoData& data,
                                            const std::string& ckpt) {
  const DeviceOutcome host = train_on(false, patch, data);
  const DeviceOutcome whole = train_on(true, patch, data);
  train_on(true, patch, data, 3, ckpt);
  const DeviceOutcome resumed = train_on(true, patch, data, 6, "", ckpt);
  const DeviceOutcome on_host = train_on(false, patch, data, 6, "", ckpt);
  ASSERT_EQ(whole.losses.size(), 6u);
  ASSERT_EQ(host.losses.size(), 6u);
  ASSERT_EQ(resumed.losses.size(), 3u);
  ASSERT_EQ(on_host.losses.size(), 3u);
  for (size_t i = 0; i < 6; ++i)
    EXPECT_EQ(std::memcmp(&host.losses[i], &whole.losses[i], sizeof(double)), 0)
        << "loss of step " << i + 1;
  for (size_t i = 0; i < 3; ++i) {
    EXPECT_EQ(std::memcmp(&whole.losses[3 + i], &resumed.losses[i], sizeof(double)), 0)
        << "loss of step " << 4 + i;
    EXPECT_EQ(std::memcmp(&whole.losses[3 + i], &on_host.losses[i], sizeof(double)), 0)
        << "loss of step " << 4 + i << " (resumed on the host-accessible device)";
  }
  for (size_t u = 0; u < whole.weights.master.size(); ++u) {
    EXPECT_TRUE(host.weights.master[u] == whole.weights.master[u]) << "unit " << u;
    EXPECT_TRUE(whole.weights.master[u] == resumed.weights.master[u]) << "unit " << u;
    EXPECT_TRUE(whole.weights.params[u] == resumed.weights.params[u]) << "unit " << u;
    EXPECT_TRUE(whole.weights.master[u] == on_host.weights.master[u]) << "unit " << u;
    EXPECT_TRUE(whole.weights.params[u] == on_host.weights.params[u]) << "unit " << u;
  }
}

// offload_optimizer.ratio 0.5 on the discrete device: the last units' optimizer state on the
// device, stepped there by Adam on the device, read for a checkpoint and written back on
// resume through stream copies only. The run equals the host-accessible device's, and a
// checkpoint saved on the discrete device resumes exactly there and on the host-accessible one.
TEST(TrainerDevice, DiscreteDevicePartialOffloadTrainsAndResumesExactly) {
  DemoData data;
  for (const char* opt : {"nvme", "cpu"}) {
    SCOPED_TRACE(opt);
    const std::string o(opt);
    std::filesystem::create_directories(data.file("swap_" + o));
    nlohmann::json patch = nvme_patch(data.file("swap_" + o));
    patch["bf16"] = {{"enabled", true}};
    patch.merge_patch(
        {{"zero_optimization",
          {{"sub_group_size", 3000}, {"offload_optimizer", {{"device", o}, {"ratio", 0.5}}}}}});
    expect_resumes_exactly_on_both_devices(patch, data, data.file("ckpt_" + o));
  }
}

// All the optimizer state on the discrete device, parameters published in place by Adam on the
// device (stage 2, offload_optimizer none): a checkpoint's load writes them through a staging
// slot and the run continues exactly, also on the host-accessible device.
TEST(TrainerDevice, DiscreteDeviceOptimizerStateResumesExactly) {
  DemoData data;
  const nlohmann::json patch = {{"bf16", {{"enabled", true}}},
                                {"gradient_clipping", 0.05},
                                {"zero_optimization", {{"stage", 2}}}};
  expect_resumes_exactly_on_both_devices(patch, data, data.file("ckpt"));
}

TEST(TrainerDevice, AMissingGpuIsRefused) {
  if (device::probe().available) GTEST_SKIP() << "this machine has a GPU";
  DemoData data;
  const model::LlamaConfig mc = tiny_model();
  TrainerOptions o = quiet_options(data, 1);
  o.device = device::DeviceKind::Cuda;
  try {
    Trainer tr(make_config({}, mc), mc, o);
    ADD_FAILURE() << "a CUDA device was created";
  } catch (const InvalidArgument& e) {
    EXPECT_NE(std::string(e.what()).find("cannot create a CUDA device"), std::string::npos)
        << e.what();
  }
}

}  // namespace
}  // namespace outcore::train::testing
