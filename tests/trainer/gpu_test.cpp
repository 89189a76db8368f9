// The trainer on a device the host cannot read (label gpu: `ctest -L gpu`): the simulated
// discrete device everywhere, a GPU where one can be used (the case skips, saying why, where
// none can). ZeRO-3 with the parameters in host memory and the optimizer state in swap files,
// under a device budget below the model's training state, 10 steps of 2 micro-batches: the
// optimizer step during the backward (outcore.step_in_backward: CPU Adam and the NVMe optimizer
// I/O under the GPU's backward) trains bit-identically to the step after the backward, the
// units whose gradient sums fit stay on the device between micro-batches (decision 024), and
// the device's peak stays within the budget. Two ranks in one process (threads, ThreadComm) on
// the same device kind train bit-identically to one rank.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <string>
#include <string_view>
#include <thread>
#include <vector>

#include "engine/zero/plan.hpp"
#include "tests/comm/thread_comm.hpp"
#include "tests/trainer/trainer_test_util.hpp"

namespace outcore::train::testing {
namespace {

struct Outcome {
  std::vector<double> losses, norms;
  std::vector<std::string> in_backward;
  Weights weights;  // each unit's padded slabs; their padding depends on the world size
  std::vector<size_t> numel, param_bytes;  // per unit: elements, and bytes of its parameters
  zero::MemoryPeaks memory;
  std::vector<bool> device_grad_sums;
  size_t device_optimizer_from = 0;
};

// 4.3M parameters: 68 MiB of training state (16 B/param) against a 32 MiB device budget.
model::LlamaConfig small_model() {
  nlohmann::json j = tiny_model_json();
  j["hidden_size"] = 256;
  j["intermediate_size"] = 704;
  j["num_hidden_layers"] = 4;
  j["vocab_size"] = 2048;
  return model::LlamaConfig::from_json(j.dump(), "small");
}

constexpr int64_t kBudgetMb = 32;

// ZeRO-3, parameters in host memory, optimizer state in swap files under `swap`, bf16
// parameters (and by default bf16 compute), 2 micro-batches per step, under the kBudgetMb device
// budget.
config::Config device_config(bool step_in_backward, const std::string& swap,
                             const std::string& compute = "auto", double ratio = 1.0) {
  nlohmann::json p = {
      {"bf16", {{"enabled", true}}},
      {"gradient_accumulation_steps", 2},
      {"zero_optimization",
       {{"stage", 3},
        {"stage3_param_persistence_threshold", 0},
        {"offload_param", {{"device", "cpu"}}},
        {"offload_optimizer", {{"device", "nvme"}, {"nvme_path", swap}, {"ratio", ratio}}}}},
      {"outcore",
       {{"device_memory_mb", kBudgetMb},
        {"step_in_backward", step_in_backward},
        {"compute_dtype", compute}}}};
  return make_config(p, small_model());
}

// 10 steps of `cfg` on a GPU (`cuda`) or the simulated discrete device; as a rank of the
// engine and control Comms given (both null: a world of one).
Outcome run_on_device(bool cuda, const config::Config& cfg, const DemoData& data,
                      comm::Comm* engine_comm = nullptr, comm::Comm* control_comm = nullptr) {
  TrainerOptions o = quiet_options(data, 10);
  if (cuda)
    o.device = device::DeviceKind::Cuda;
  else
    o.discrete = true;
  o.comm = engine_comm;
  o.control_comm = control_comm;
  Outcome out;
  o.on_step = [&](const StepMetrics& m) {
    out.losses.push_back(m.loss);
    out.norms.push_back(m.grad_norm.value_or(-1.0));
    out.in_backward.push_back(m.in_backward);
  };
  const model::LlamaConfig mc = small_model();
  Trainer tr(cfg, mc, o);
  tr.run();
  out.weights = weights_of(tr);
  for (const model::UnitLayout& ul : tr.model().layout().units) {
    out.numel.push_back(ul.numel);
    out.param_bytes.push_back(ul.numel * dtype_size(tr.engine().param_dtype()));
  }
  out.memory = tr.engine().memory();
  out.device_grad_sums = tr.engine().plan().device_grad_sums;
  out.device_optimizer_from = tr.engine().plan().placement.device_optimizer_from;
  return out;
}

Outcome train(bool cuda, bool step_in_backward, const DemoData& data, const std::string& swap,
              const std::string& compute = "auto", double ratio = 1.0) {
  std::filesystem::create_directories(swap);
  return run_on_device(cuda, device_config(step_in_backward, swap, compute, ratio), data);
}

// `world` ranks of `patch` (merged into base_ds_json, resolved for that world) as threads of this
// process, each with its own device; rank 0's outcome. A rank that fails breaks both groups, so
// the others fail too instead of waiting for it; the error of the rank that failed first is
// rethrown. `fault`, when set,
// is called with the rank and the collective's name before each of the engine's collectives.
Outcome run_ranks(bool cuda, int world, const nlohmann::json& patch, const DemoData& data,
                  const std::function<void(int, std::string_view)>& fault = {}) {
  nlohmann::json j = base_ds_json();
  j.merge_patch(patch);
  config::Config cfg = config::parse_config(j.dump(), "ranks config").config;
  config::AutoContext ctx;
  ctx.hidden_size = small_model().hidden_size;
  ctx.total_steps = 100;
  ctx.world_size = world;
  config::resolve_auto(cfg, ctx);
  auto engine_group = std::make_shared<comm::testing::ThreadGroup>(world);
  auto control_group = std::make_shared<comm::testing::ThreadGroup>(world);
  std::vector<Outcome> outcomes(static_cast<size_t>(world));
  std::vector<std::exception_ptr> errors(static_cast<size_t>(world));
  std::atomic<int> first_failed{-1};
  std::vector<std::thread> ranks;
  for (int r = 0; r < world; ++r)
    ranks.emplace_back([&, r] {
      // The engine's collectives run on its comm lane, never as a host function of a stream.
      comm::testing::ThreadComm engine_comm(engine_group, r, [&, r](std::string_view what) {
        if (device::in_host_function())
          throw Error(fmt::format("{} ran as a host function of a device stream", what));
        if (fault) fault(r, what);
      });
      comm::testing::ThreadComm control_comm(control_group, r);
      try {
        outcomes[r] = run_on_device(cuda, cfg, data, &engine_comm, &control_comm);
        // Done: a rank still waiting in a collective this one never called fails, not hangs.
        engine_group->break_group();
        control_group->break_group();
      } catch (...) {
        errors[r] = std::current_exception();
        int none = -1;
        first_failed.compare_exchange_strong(none, r);
        engine_group->break_group();
        control_group->break_group();
      }
    });
  for (std::thread& t : ranks) t.join();
  if (first_failed >= 0) std::rethrow_exception(errors[first_failed]);
  return outcomes[0];
}

// `b` trained as `a`: every step's loss and norm, and every unit's master weights and
// parameters, the same bits.
void expect_same_run(const Outcome& a, const Outcome& b) {
  ASSERT_EQ(a.losses.size(), 10u);
  ASSERT_EQ(b.losses.size(), 10u);
  for (size_t i = 0; i < a.losses.size(); ++i) {
    EXPECT_EQ(std::memcmp(&a.losses[i], &b.losses[i], sizeof(double)), 0)
        << "loss of step " << i + 1;
    EXPECT_EQ(std::memcmp(&a.norms[i], &b.norms[i], sizeof(double)), 0) << "norm of step " << i + 1;
  }
  ASSERT_EQ(a.numel, b.numel);
  for (size_t u = 0; u < a.weights.master.size(); ++u) {
    EXPECT_TRUE(std::equal(a.weights.master[u].begin(), a.weights.master[u].begin() + a.numel[u],
                           b.weights.master[u].begin()))
        << "unit " << u;
    EXPECT_EQ(std::memcmp(a.weights.params[u].data(), b.weights.params[u].data(), a.param_bytes[u]),
              0)
        << "unit " << u;
  }
}

// The GPU cases skip, saying why, where no GPU can be used.
class TrainerOnADevice : public ::testing::TestWithParam<bool> {
 protected:
  void SetUp() override {
    if (!GetParam()) return;
    const device::ProbeResult p = device::probe();
    if (!p.available) GTEST_SKIP() << "no usable GPU: " << p.summary();
  }
};

TEST_P(TrainerOnADevice, StepDuringBackwardUnderABudgetBelowTheModelsState) {
  const bool cuda = GetParam();
  ASSERT_LT(uint64_t{kBudgetMb} << 20, 16 * small_model().num_parameters());
  const DemoData data;
  const Outcome after = train(cuda, false, data, data.file("after"));
  const Outcome during = train(cuda, true, data, data.file("during"));
  expect_same_run(after, during);
  // Without clipping every step's tentative updates stand.
  EXPECT_EQ(std::count(during.in_backward.begin(), during.in_backward.end(), "committed"), 10);
  for (const Outcome* o : {&after, &during}) {
    EXPECT_LE(o->memory.device_peak_bytes, uint64_t{kBudgetMb} << 20);
    int summed = 0;
    for (const bool b : o->device_grad_sums) summed += b;
    EXPECT_GT(summed, 0) << "no unit's gradient sum fits in the budget";
    EXPECT_LT(summed, static_cast<int>(o->device_grad_sums.size()))
        << "every unit's gradient sum fits: the budget does not test the host path";
  }
}

// offload_optimizer.ratio 0.9: the last units' optimizer state on the device, stepped there
// (Adam on the device: a CUDA kernel on a GPU) from gradients kept there where the budget allows
// (decision 037), else brought up from the host, the rest by CPU Adam from swap files.
// Bit-identical to ratio 1, within the same budget.
TEST_P(TrainerOnADevice, PartialOffloadStepsTheLastUnitsOnTheDeviceBitIdentically) {
  const bool cuda = GetParam();
  const DemoData data;
  const Outcome full = train(cuda, false, data, data.file("full"));
  const Outcome part = train(cuda, false, data, data.file("part"), "auto", 0.9);
  EXPECT_EQ(full.device_optimizer_from, SIZE_MAX);
  EXPECT_LT(part.device_optimizer_from, part.weights.master.size());
  expect_same_run(full, part);
  EXPECT_LE(part.memory.device_peak_bytes, uint64_t{kBudgetMb} << 20);
}

// Stage 2 with all the optimizer state on the device (offload_optimizer none: Adam on the device,
// a CUDA kernel on a GPU, from gradients summed there and normed by the block-sum kernel, with no
// budget to keep them from it) trains bit-identically to the same run with it offloaded to host
// memory (CPU Adam, norm on the host).
TEST_P(TrainerOnADevice, OptimizerStateOnTheDeviceTrainsAsOffloaded) {
  const bool cuda = GetParam();
  const DemoData data;
  std::vector<Outcome> runs;
  for (const char* opt : {"cpu", "none"}) {
    const nlohmann::json p = {
        {"bf16", {{"enabled", true}}},
        {"gradient_accumulation_steps", 2},
        {"gradient_clipping", 0.05},
        {"zero_optimization", {{"stage", 2}, {"offload_optimizer", {{"device", opt}}}}}};
    runs.push_back(run_on_device(cuda, make_config(p, small_model()), data));
  }
  expect_same_run(runs[0], runs[1]);
  EXPECT_EQ(runs[1].device_grad_sums, std::vector<bool>(runs[1].weights.master.size(), true))
      << "the gradients did not stay on the device";
}

// bf16 compute on the device trains as fp32 compute does on the same bf16 parameters: every
// step's loss within 2% of the fp32 run's (the band TrainerTest.ComputeDtypeBf16RoundsEvery-
// GemmOperand holds the host to), yet not the same computation, and the loss falls. On a GPU
// this is the bf16 path end to end (tensor-core GEMMs, the fused attention, the fused head).
TEST_P(TrainerOnADevice, Bf16ComputeTrainsWithinTheFp32ComputeLossBand) {
  const bool cuda = GetParam();
  const DemoData data;
  const Outcome bf16 = train(cuda, false, data, data.file("bf16"), "bf16");
  const Outcome fp32 = train(cuda, false, data, data.file("fp32"), "fp32");
  ASSERT_EQ(bf16.losses.size(), 10u);
  ASSERT_EQ(fp32.losses.size(), 10u);
  EXPECT_NE(bf16.losses.front(), fp32.losses.front()) << "bf16 compute computed in fp32";
  for (size_t i = 0; i < fp32.losses.size(); ++i)
    EXPECT_NEAR(bf16.losses[i], fp32.losses[i], 0.02 * fp32.losses[i]) << "step " << i + 1;
  EXPECT_LT(bf16.losses.back(), bf16.losses.front() - 0.5);
  EXPECT_LE(bf16.memory.device_peak_bytes, uint64_t{kBudgetMb} << 20);
}

// Two ranks, each with its own device (on a GPU: the same GPU), train bit-identically to one rank
// with the same global batch: the data path of several ranks on a device the host cannot read
// (parameters gathered in pinned memory and copied up whole, gradient slabs reduced there, every
// collective on the engine's comm lane). In one process the ranks share CUDA's one callback
// thread: a collective run there would wait for the other rank's, queued behind it, for good.
// ZeRO-3 (parameters in host memory, optimizer state in swap files, under the budget) and
// stage 2 with clipping (publications gathered in pinned memory).
TEST_P(TrainerOnADevice, TwoRanksInOneProcessTrainAsOne) {
  const bool cuda = GetParam();
  const DemoData data;
  const auto stage3 = [&](int gas, const std::string& swap) {
    std::filesystem::create_directories(swap);
    return nlohmann::json{{"bf16", {{"enabled", true}}},
                          {"gradient_accumulation_steps", gas},
                          {"zero_optimization",
                           {{"stage", 3},
                            {"stage3_param_persistence_threshold", 0},
                            {"offload_param", {{"device", "cpu"}}},
                            {"offload_optimizer", {{"device", "nvme"}, {"nvme_path", swap}}}}},
                          {"outcore", {{"device_memory_mb", kBudgetMb}}}};
  };
  expect_same_run(run_ranks(cuda, 1, stage3(2, data.file("s3_one")), data),
                  run_ranks(cuda, 2, stage3(1, data.file("s3_two")), data));
  const auto stage2 = [](int gas) {
    return nlohmann::json{
        {"bf16", {{"enabled", true}}},
        {"gradient_accumulation_steps", gas},
        {"gradient_clipping", 0.05},
        {"zero_optimization", {{"stage", 2}, {"offload_optimizer", {{"device", "cpu"}}}}}};
  };
  expect_same_run(run_ranks(cuda, 1, stage2(2), data), run_ranks(cuda, 2, stage2(1), data));
}

// A collective that fails on one rank in the middle of a backward (the transport's error): both
// ranks fail with an error, none waits for the other for good, and nothing computes into memory
// already freed while the engines unwind (before, the simulated device's queued compute wrote
// into released slabs: a crash).
TEST_P(TrainerOnADevice, TwoRanksInOneProcessFailTogetherWhenACollectiveFails) {
  const bool cuda = GetParam();
  const DemoData data;
  std::filesystem::create_directories(data.file("swap"));
  const nlohmann::json patch = {
      {"bf16", {{"enabled", true}}},
      {"zero_optimization",
       {{"stage", 3},
        {"stage3_param_persistence_threshold", 0},
        {"offload_param", {{"device", "cpu"}}},
        {"offload_optimizer", {{"device", "nvme"}, {"nvme_path", data.file("swap")}}}}},
      {"outcore", {{"device_memory_mb", kBudgetMb}}}};
  std::atomic<int> all_to_alls{0};
  try {
    run_ranks(cuda, 2, patch, data, [&](int rank, std::string_view what) {
      if (rank == 1 && what == "all_to_all" && ++all_to_alls == 7)
        throw Error("injected: the transport failed");
    });
    ADD_FAILURE() << "the run went on after a failed collective";
  } catch (const Error& e) {
    EXPECT_NE(std::string(e.what()).find("injected: the transport failed"), std::string::npos)
        << e.what();
  }
  EXPECT_GE(all_to_alls.load(), 7);
}

// The GPU case's premise, checked where there is no GPU: with the CUDA backend's workspaces
// charged to the budget (decision 027), the plan still sums some units' gradients on the device
// and not all of them.
TEST(TrainerOnADevicePlan, TheCudaCaseSumsSomeUnitsOnTheDeviceWithTheBackendsWorkspace) {
  const model::LlamaConfig mc = small_model();
  const config::Config cfg = device_config(false, "/tmp/outcore-unused-swap");
  const uint64_t budget = uint64_t{kBudgetMb} << 20;
  model::ModelOptions mo{.micro_batch = cfg.train_micro_batch_size_per_gpu.value(),
                         .seq_len = 32,  // quiet_options'
                         .param_dtype = DType::BF16,
                         .compute_dtype = config::compute_dtype(cfg)};
  mo.head_chunk_rows = model::head_rows_for_device(mc, mo, budget);  // as on a GPU
  const model::LlamaModel m(mc, mo);
  const uint64_t workspace =
      device::backend_workspace(device::DeviceKind::Cuda, m.workspace_shape()).total();
  EXPECT_GT(workspace, 0u);
  const zero::Plan plan = zero::make_plan(cfg, m,
                                          {.device_limit_bytes = budget,
                                           .device_host_accessible = false,
                                           .compute_workspace_bytes = workspace});
  int summed = 0;
  for (const bool b : plan.device_grad_sums) summed += b;
  EXPECT_GT(summed, 0) << zero::format_plan(plan);
  EXPECT_LT(summed, static_cast<int>(plan.device_grad_sums.size())) << zero::format_plan(plan);
  EXPECT_LE(plan.peak.device, budget) << zero::format_plan(plan);
}

INSTANTIATE_TEST_SUITE_P(Trainer, TrainerOnADevice, ::testing::Values(false, true),
                         [](const auto& info) {
                           return std::string(info.param ? "cuda" : "simulated_discrete");
                         });

}  // namespace
}  // namespace outcore::train::testing
