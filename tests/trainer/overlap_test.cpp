// The optimizer step overlapped with the next pass (EngineOptions::overlap_step, the default)
// gives bit-identical training to the sequential step: losses, grad norms, skipped steps,
// validation loss, master weights and parameters over 20 steps, for stage 3 with parameters
// and optimizer in swap files, stage 2 with the optimizer in host memory, bf16, fp16 with
// overflow steps, clipping on and off. The optimizer step during backward
// (outcore.step_in_backward) gives bit-identical training to the step after backward, whether
// its tentative updates stand, are redone after clipping or undone after an overflow.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <map>
#include <string>
#include <vector>

#include "tests/trainer/trainer_test_util.hpp"

namespace outcore::train::testing {
namespace {

struct OverlapOutcome {
  std::vector<double> losses, norms;
  std::vector<bool> skipped;
  double val = 0;
  Weights weights;
  std::vector<std::string> in_backward;  // per step: StepMetrics::in_backward
  size_t device_grad_sums = 0;           // units whose gradients the plan sums on the device
  uint64_t host_checkpoint_bytes = 0;    // the plan's activation checkpoints in host memory
};

OverlapOutcome train_with(const nlohmann::json& patch, bool overlap, const DemoData& data,
                          const std::string& swap_name, bool step_in_backward = false) {
  const model::LlamaConfig mc = tiny_model();
  nlohmann::json p = patch;
  if (p.contains("zero_optimization")) {
    const std::string swap = data.file(swap_name + (overlap ? "_overlap" : "_sequential") +
                                       (step_in_backward ? "_in_backward" : ""));
    std::filesystem::create_directories(swap);
    for (const char* k : {"offload_param", "offload_optimizer"})
      if (p["zero_optimization"].contains(k) &&
          p["zero_optimization"][k].value("device", "") == "nvme")
        p["zero_optimization"][k]["nvme_path"] = swap;
  }
  p["outcore"]["step_in_backward"] = step_in_backward;
  const config::Config cfg = make_config(p, mc);
  TrainerOptions o = quiet_options(data, 20);
  o.eval_every = 7;  // validations between steps wait for the step in flight
  o.engine.overlap_step = overlap;
  if (swap_name.find("nvme_grads") != std::string::npos)
    o.engine.gradients = zero::GradientPlacement::kNvme;
  // A device the host cannot read (a GPU's data movement): publications are staged copies.
  if (swap_name.find("discrete") != std::string::npos) o.discrete = true;
  OverlapOutcome out;
  o.on_step = [&](const StepMetrics& m) {
    out.losses.push_back(m.loss);
    out.norms.push_back(m.grad_norm.value_or(-1.0));
    out.skipped.push_back(m.skipped);
    out.in_backward.push_back(m.in_backward);
  };
  Trainer tr(cfg, mc, o);
  if (cfg.fp16.enabled.value()) {
    // A scale beyond fp32's range: the first steps overflow and are skipped, halving it.
    LossScalerState s = tr.loss_scaler().state();
    s.cur_scale = std::ldexp(1.0, 132);
    tr.loss_scaler().load_state(s);
  }
  const TrainResult r = tr.run();
  out.val = r.final_val_loss.value_or(-1.0);
  out.weights = weights_of(tr);
  for (const bool on : tr.engine().plan().device_grad_sums) out.device_grad_sums += on;
  for (const zero::PlanItem& item : tr.engine().plan().items)
    if (item.what.find("cpu_checkpointing") != std::string::npos)
      out.host_checkpoint_bytes += item.bytes;
  return out;
}

void expect_same(const OverlapOutcome& a, const OverlapOutcome& b) {
  ASSERT_EQ(a.losses.size(), b.losses.size());
  for (size_t i = 0; i < a.losses.size(); ++i) {
    EXPECT_EQ(std::memcmp(&a.losses[i], &b.losses[i], sizeof(double)), 0)
        << "loss of step " << i + 1;
    EXPECT_EQ(std::memcmp(&a.norms[i], &b.norms[i], sizeof(double)), 0) << "norm of step " << i + 1;
    EXPECT_EQ(a.skipped[i], b.skipped[i]) << "step " << i + 1;
  }
  EXPECT_EQ(std::memcmp(&a.val, &b.val, sizeof(double)), 0);
  ASSERT_EQ(a.weights.master.size(), b.weights.master.size());
  for (size_t u = 0; u < a.weights.master.size(); ++u) {
    EXPECT_TRUE(a.weights.master[u] == b.weights.master[u]) << "master weights of unit " << u;
    EXPECT_TRUE(a.weights.params[u] == b.weights.params[u]) << "parameters of unit " << u;
  }
}

class OverlapTest : public ::testing::TestWithParam<const char*> {};

nlohmann::json case_patch(const std::string& name) {
  if (name == "stage3_nvme_fp32_clip")
    return {{"gradient_clipping", 0.05},
            {"zero_optimization",
             {{"stage", 3},
              {"stage3_param_persistence_threshold", 0},
              {"stage3_max_live_parameters", 20000},
              {"stage3_prefetch_bucket_size", 20000},
              {"offload_param", {{"device", "nvme"}, {"max_in_cpu", 0}}},
              {"offload_optimizer", {{"device", "nvme"}}}}}};
  if (name == "stage3_nvme_bf16_noclip")
    return {{"bf16", {{"enabled", true}}},
            {"zero_optimization",
             {{"stage", 3},
              {"offload_param", {{"device", "nvme"}, {"max_in_cpu", 0}}},
              {"offload_optimizer", {{"device", "nvme"}}}}}};
  if (name == "stage2_cpu_bf16_clip")
    return {{"bf16", {{"enabled", true}}},
            {"gradient_clipping", 0.05},
            {"gradient_accumulation_steps", 2},
            {"zero_optimization", {{"stage", 2}, {"offload_optimizer", {{"device", "cpu"}}}}}};
  // fp16 (train_with starts it from a loss scale of 2^132: the first steps overflow).
  return {{"fp16", {{"enabled", true}}},
          {"zero_optimization", {{"stage", 1}, {"offload_optimizer", {{"device", "cpu"}}}}}};
}

TEST_P(OverlapTest, BitIdenticalToTheSequentialStep) {
  const DemoData data;
  const std::string name = GetParam();
  const OverlapOutcome seq = train_with(case_patch(name), false, data, name);
  const OverlapOutcome ovl = train_with(case_patch(name), true, data, name);
  if (name == "stage1_cpu_fp16_overflow") {
    ASSERT_TRUE(seq.skipped.front()) << "the case should start with overflow steps";
    ASSERT_FALSE(seq.skipped.back()) << "and train once the scale is small enough";
  }
  expect_same(seq, ovl);
}

INSTANTIATE_TEST_SUITE_P(Trainer, OverlapTest,
                         ::testing::Values("stage3_nvme_fp32_clip", "stage3_nvme_bf16_noclip",
                                           "stage2_cpu_bf16_clip", "stage1_cpu_fp16_overflow"),
                         [](const auto& info) { return std::string(info.param); });

// ---- the step during backward ----------------------------------------------------------------

class StepInBackwardTest : public ::testing::TestWithParam<const char*> {};

nlohmann::json in_backward_patch(const std::string& name) {
  const nlohmann::json stage3_nvme = {{"stage", 3},
                                      {"stage3_param_persistence_threshold", 0},
                                      {"stage3_max_live_parameters", 20000},
                                      {"stage3_prefetch_bucket_size", 20000},
                                      {"offload_param", {{"device", "nvme"}, {"max_in_cpu", 0}}},
                                      {"offload_optimizer", {{"device", "nvme"}}}};
  if (name == "stage3_nvme_fp32_noclip")
    return {{"gradient_clipping", 0.0}, {"zero_optimization", stage3_nvme}};
  if (name == "stage3_nvme_fp32_clip_sometimes")  // norms cross the threshold both ways
    return {{"gradient_clipping", 1.8}, {"zero_optimization", stage3_nvme}};
  if (name == "stage3_nvme_bf16_gas2_partial") {  // half the units' state stays on the device
    nlohmann::json z = stage3_nvme;
    z["offload_optimizer"]["ratio"] = 0.5;
    return {{"bf16", {{"enabled", true}}},
            {"gradient_clipping", 0.0},
            {"gradient_accumulation_steps", 2},
            {"zero_optimization", z}};
  }
  if (name == "stage3_nvme_discrete_bf16")
    return {{"bf16", {{"enabled", true}}},
            {"gradient_clipping", 0.0},
            {"zero_optimization",
             {{"stage", 3},
              {"stage3_param_persistence_threshold", 20000},  // some units resident on it
              {"offload_param", {{"device", "cpu"}}},
              {"offload_optimizer", {{"device", "nvme"}}}}}};
  if (name == "stage3_nvme_fp16_overflow")
    return {{"fp16", {{"enabled", true}}},
            {"gradient_clipping", 0.0},
            {"zero_optimization", stage3_nvme}};
  // Gradient accumulators in swap files too (train_with: EngineOptions::gradients): a
  // tentative step reads them beside the accumulation of the pass.
  return {{"bf16", {{"enabled", true}}},
          {"gradient_clipping", 0.0},
          {"gradient_accumulation_steps", 2},
          {"zero_optimization", stage3_nvme}};
}

TEST_P(StepInBackwardTest, BitIdenticalToTheStepAfterBackward) {
  const DemoData data;
  const std::string name = GetParam();
  const OverlapOutcome after = train_with(in_backward_patch(name), true, data, name);
  const OverlapOutcome during = train_with(in_backward_patch(name), true, data, name, true);
  std::map<std::string, int> count;
  for (const std::string& s : during.in_backward) ++count[s];
  for (const std::string& s : after.in_backward) EXPECT_EQ(s, "");
  // The subject must be exercised: tentative steps that stood, and the paths that undo them.
  EXPECT_GT(count["committed"], 0) << "grad norms " << ::testing::PrintToString(during.norms);
  if (name == "stage3_nvme_fp32_clip_sometimes") {
    EXPECT_GT(count["redone"], 0) << "grad norms " << ::testing::PrintToString(during.norms);
  }
  if (name == "stage3_nvme_fp16_overflow") {
    ASSERT_TRUE(after.skipped.front()) << "the case should start with overflow steps";
    EXPECT_GT(count["restored"], 0);
  }
  if (name == "stage3_nvme_fp32_noclip" || name == "stage3_nvme_grads_bf16_gas2" ||
      name == "stage3_nvme_discrete_bf16") {
    EXPECT_EQ(count["committed"], 20);
  }
  expect_same(after, during);
}

INSTANTIATE_TEST_SUITE_P(
    Trainer, StepInBackwardTest,
    ::testing::Values("stage3_nvme_fp32_noclip", "stage3_nvme_fp32_clip_sometimes",
                      "stage3_nvme_bf16_gas2_partial", "stage3_nvme_fp16_overflow",
                      "stage3_nvme_grads_bf16_gas2", "stage3_nvme_discrete_bf16"),
    [](const auto& info) { return std::string(info.param); });

// On a device the host cannot read (a GPU's data movement), in fp32 compute, the step during
// backward with gradient sums held on the device over two micro-batches and unit inputs
// checkpointed in host memory trains bit for bit as the host-accessible device does with the
// step after backward: every tentative step stands, and nothing it reads was stale.
TEST(StepInBackwardOnADiscreteDevice, BitIdenticalToTheHostAccessibleDeviceInFp32) {
  const DemoData data;
  const nlohmann::json patch = {{"gradient_clipping", 0.0},
                                {"gradient_accumulation_steps", 2},
                                {"activation_checkpointing", {{"cpu_checkpointing", true}}},
                                {"zero_optimization",
                                 {{"stage", 3},
                                  {"stage3_param_persistence_threshold", 0},
                                  {"offload_param", {{"device", "cpu"}}},
                                  {"offload_optimizer", {{"device", "nvme"}}}}}};
  const OverlapOutcome want = train_with(patch, true, data, "stage3_fp32_host_accessible");
  const OverlapOutcome got = train_with(patch, true, data, "stage3_fp32_discrete", true);
  std::map<std::string, int> count;
  for (const std::string& s : got.in_backward) ++count[s];
  EXPECT_EQ(count["committed"], 20);
  for (const std::string& s : want.in_backward) EXPECT_EQ(s, "");
  EXPECT_GT(got.host_checkpoint_bytes, 0u) << "unit inputs should be checkpointed in host memory";
  EXPECT_EQ(want.device_grad_sums, 0u);
  EXPECT_GT(got.device_grad_sums, 0u) << "the gradient sums should be held on the device";
  expect_same(want, got);
}

}  // namespace
}  // namespace outcore::train::testing
