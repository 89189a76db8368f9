// ZeroEngine on a device the host cannot read (CpuDeviceOptions::discrete, a simulated GPU whose
// memory faults on any direct host access): the model computes through the device's backend,
// parameters arrive and gradients leave by stream copies only, and training is bit-identical
// to the same run on the host-accessible simulated device, with the plan still exact.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <map>
#include <mutex>
#include <new>

#include "engine/device/profiling_backend.hpp"
#include "tests/zero/zero_test_util.hpp"

namespace outcore::zero::test {
namespace {

struct DiscreteCase {
  Placing placing;
  DType dtype;
  bool nvme_gradients = false;
  bool cpu_checkpointing = false;  // unit inputs in host memory, staged through the device
  // CpuDeviceOptions::copy_delay_us: copies slow enough that a missing wait reads stale bytes.
  uint32_t copy_delay_us = 0;
  // CpuDeviceOptions::compute_delay_us: compute slow enough that what reads a unit's results
  // without waiting for its event reads stale bytes (or memory already freed).
  uint32_t compute_delay_us = 0;
  // The model's head size: 16 (tiny_config), or one long enough that two GEMM libraries would
  // sum attention's products in different orders.
  int64_t head_dim = 16;
  std::string name() const {
    return placing.name() + (dtype == DType::BF16 ? "_bf16" : "_fp32") +
           (head_dim != 16 ? "_head" + std::to_string(head_dim) : "") +
           (nvme_gradients ? "_nvme_grads" : "") + (cpu_checkpointing ? "_cpu_ckpt" : "") +
           (copy_delay_us > 0 ? "_slow_copies" : "") +
           (compute_delay_us > 0 ? "_slow_compute" : "");
  }
};

class DiscreteDevice : public ::testing::TestWithParam<DiscreteCase> {};

TEST_P(DiscreteDevice, TrainsBitIdenticalToTheHostAccessibleDevice) {
  const DiscreteCase c = GetParam();
  const std::string dir = swap_dir("discrete_" + c.name()).string();
  const config::Config cfg = make_config(config_json(
      c.placing, c.dtype, dir,
      ", \"stage3_max_reuse_distance\": 0, \"stage3_param_persistence_threshold\": 0, "
      "\"sub_group_size\": 8192",
      c.cpu_checkpointing ? ", \"activation_checkpointing\": {\"cpu_checkpointing\": true}" : ""));
  const EngineOptions eo = c.nvme_gradients ? nvme_gradients() : EngineOptions{};

  model::LlamaConfig mc = tiny_config(true);
  mc.head_dim = c.head_dim;
  const model::LlamaModel host_model(mc, tiny_options(c.dtype));
  device::CpuDevice host_dev;
  const RunResult want = train_on(host_dev, cfg, host_model, 3, eo);

  device::CpuDevice dev(
      {.discrete = true, .copy_delay_us = c.copy_delay_us, .compute_delay_us = c.compute_delay_us});
  ASSERT_FALSE(dev.host_accessible());
  const model::LlamaModel model(mc, tiny_options(c.dtype), device::make_backend(dev));
  const RunResult got = train_on(dev, cfg, model, 3, eo);
  expect_bit_identical(want, got, c.name());

  // The gradient slabs come back through one more pinned buffer; staged checkpoints take two
  // unit inputs on the device; with an unlimited budget every unit's gradients are summed on
  // the device over the step's micro-batches and come back once per step instead of once per
  // micro-batch (to host memory, or read, added and written back in a swap file); nothing else
  // changes.
  const uint64_t staging =
      c.cpu_checkpointing ? 2 * device::charged_bytes(host_model.hidden_bytes()) : 0;
  uint64_t sums = 0, once = 0;  // the sums' device bytes, one copy of every gradient
  for (const model::UnitLayout& u : host_model.layout().units) {
    sums += device::charged_bytes(u.padded_numel * sizeof(float));
    once += u.padded_numel * sizeof(float);
  }
  const uint64_t gas = static_cast<uint64_t>(cfg.gradient_accumulation_steps.value());
  ASSERT_GT(gas, 1u);
  EXPECT_EQ(got.plan.device_grad_sums, std::vector<bool>(host_model.num_units(), true));
  EXPECT_EQ(got.plan.device_grad_sum_bytes, sums);
  EXPECT_TRUE(want.plan.device_grad_sums == std::vector<bool>(host_model.num_units(), false));
  EXPECT_NE(format_plan(got.plan).find("fp32 gradient sums of units 0.."), std::string::npos)
      << format_plan(got.plan);
  EXPECT_EQ(got.plan.peak.device, want.plan.peak.device + staging + sums) << format_plan(got.plan);
  EXPECT_LE(got.memory.device_peak_bytes, got.plan.peak.device) << format_plan(got.plan);
  EXPECT_EQ(got.plan.per_step.h2d, want.plan.per_step.h2d);
  EXPECT_EQ(got.plan.per_step.d2h, want.plan.per_step.d2h - (gas - 1) * once);
  const uint64_t nvme_saved = c.nvme_gradients ? (gas - 1) * once : 0;
  EXPECT_EQ(got.plan.per_step.nvme_read, want.plan.per_step.nvme_read - nvme_saved);
  EXPECT_EQ(got.plan.per_step.nvme_write, want.plan.per_step.nvme_write - nvme_saved);
  size_t largest = 0;
  for (const model::UnitLayout& u : host_model.layout().units)
    largest = std::max(largest, u.padded_numel);
  const uint64_t copy_back = 2 * ((largest * sizeof(float) + 4095) / 4096 * 4096);
  EXPECT_EQ(got.plan.peak.pinned, want.plan.peak.pinned + copy_back) << format_plan(got.plan);
  EXPECT_EQ(got.traffic.d2h_bytes, want.traffic.d2h_bytes - 3 * (gas - 1) * once);
  EXPECT_EQ(got.traffic.h2d_bytes, want.traffic.h2d_bytes);
}

INSTANTIATE_TEST_SUITE_P(
    Zero, DiscreteDevice,
    ::testing::Values(DiscreteCase{{3, "nvme", "nvme"}, DType::BF16},
                      DiscreteCase{{3, "nvme", "nvme"}, DType::F32, true},
                      DiscreteCase{{3, "cpu", "cpu"}, DType::F32},
                      DiscreteCase{{3, "none", "cpu"}, DType::BF16},
                      DiscreteCase{{2, "none", "cpu"}, DType::BF16},
                      DiscreteCase{{1, "none", "nvme"}, DType::F32},
                      DiscreteCase{{1, "none", "cpu"}, DType::BF16},
                      DiscreteCase{{3, "nvme", "nvme"}, DType::BF16, false, true},
                      DiscreteCase{{2, "none", "cpu"}, DType::F32, false, true},
                      // the checkpoint copies run under the compute: slow ones must be waited for
                      DiscreteCase{{2, "none", "cpu"}, DType::F32, false, true, 20000},
                      // so do the gradient copies down, and the parameter copies up
                      DiscreteCase{{3, "cpu", "cpu"}, DType::F32, false, false, 20000},
                      // the units are queued without waiting for them: with slow compute, the
                      // checkpoint copies, the gradient copies and additions and the slab frees
                      // must wait for it
                      DiscreteCase{{2, "none", "cpu"}, DType::F32, false, true, 0, 300},
                      DiscreteCase{{3, "cpu", "cpu"}, DType::BF16, false, false, 0, 300},
                      DiscreteCase{{3, "nvme", "nvme"}, DType::F32, true, true, 0, 300},
                      // attention's sums at a realistic head size (fp32 compute)
                      DiscreteCase{{3, "cpu", "cpu"}, DType::F32, false, false, 0, 0, 128},
                      DiscreteCase{{3, "cpu", "cpu"}, DType::BF16, false, false, 0, 0, 128}),
    [](const auto& info) { return info.param.name(); });

// Gradient sums on the device within a budget: the units whose sums fit in what the budget
// leaves (head first) sum there, the others come back every micro-batch; bit-identical to the
// host-accessible device either way, and to it again when a step has fewer micro-batches than
// gradient_accumulation_steps (the sums still held go down at the step) or more (the later
// ones are added on the host).
TEST(DiscreteDeviceGradientSums, PartlyOnTheDeviceWithinTheBudgetAndAnyMicroBatchCount) {
  const std::string dir = swap_dir("discrete_grad_sums").string();
  for (const bool nvme_grads : {false, true}) {
    SCOPED_TRACE(nvme_grads ? "gradients in swap files" : "gradients in host memory");
    const config::Config cfg = make_config(
        config_json({3, "nvme", "nvme"}, DType::F32, dir, ", \"stage3_max_reuse_distance\": 0"));
    const EngineOptions eo = nvme_grads ? nvme_gradients() : EngineOptions{};
    const model::LlamaModel host_model(tiny_config(false), tiny_options(DType::F32));
    const int units = host_model.num_units();
    // The plan with every sum on the device, less the sums of all but the head and the last
    // decoder layer: a budget with room for those two only.
    const Plan all =
        make_plan(cfg, host_model, {.gradients = eo.gradients, .device_host_accessible = false});
    ASSERT_EQ(all.device_grad_sums, std::vector<bool>(units, true));
    uint64_t others = 0;
    for (int u = 0; u + 2 < units; ++u)
      others += device::charged_bytes(host_model.layout().units[u].padded_numel * sizeof(float));
    const uint64_t budget = all.peak.device - others;

    for (const int64_t micro_batches : {int64_t{2}, int64_t{1}, int64_t{3}}) {
      SCOPED_TRACE(fmt::format("{} micro-batches per step", micro_batches));
      device::CpuDevice host_dev;
      const RunResult want = train_on(host_dev, cfg, host_model, 2, eo, micro_batches);
      device::CpuDevice dev({.memory_budget_bytes = budget, .discrete = true});
      const model::LlamaModel model(tiny_config(false), tiny_options(DType::F32),
                                    device::make_backend(dev));
      const RunResult got = train_on(dev, cfg, model, 2, eo, micro_batches);
      expect_bit_identical(want, got, "grad_sums");
      std::vector<bool> expected(units, false);
      expected[units - 1] = expected[units - 2] = true;
      EXPECT_EQ(got.plan.device_grad_sums, expected) << format_plan(got.plan);
      EXPECT_NE(format_plan(got.plan).find(
                    fmt::format("gradient sums of units {}..{}", units - 2, units - 1)),
                std::string::npos)
          << format_plan(got.plan);
      EXPECT_LE(got.memory.device_peak_bytes, budget);
      EXPECT_LE(got.memory.device_peak_bytes, got.plan.peak.device);
    }
  }
}

// Where a GPU's free memory is the limit (no budget, or a larger one), the sums leave a
// sixteenth of it (at least 1 GiB) for what the plan does not count; a budget is taken at its
// word; the simulated device needs no reserve.
TEST(DiscreteDeviceGradientSums, LeaveTheReserveFree) {
  constexpr uint64_t GiB = uint64_t{1} << 30;
  EXPECT_EQ(device_reserve_bytes(0, 0), 0u);
  EXPECT_EQ(device_reserve_bytes(64 << 20, 0), 0u);
  EXPECT_EQ(device_reserve_bytes(GiB, 80 * GiB), 0u);
  EXPECT_EQ(device_reserve_bytes(0, 80 * GiB), 5 * GiB);
  EXPECT_EQ(device_reserve_bytes(100 * GiB, 80 * GiB), 5 * GiB);
  EXPECT_EQ(device_reserve_bytes(0, 8 * GiB), GiB);

  const std::string dir = swap_dir("discrete_grad_sums_reserve").string();
  const config::Config cfg = make_config(config_json({3, "cpu", "cpu"}, DType::F32, dir));
  const model::LlamaModel model(tiny_config(false), tiny_options(DType::F32));
  const Plan all = make_plan(cfg, model, {.device_host_accessible = false});
  ASSERT_GT(all.device_grad_sum_bytes, 0u);
  const uint64_t limit = all.peak.device;  // every sum fits, nothing more
  const uint64_t reserve = all.device_grad_sum_bytes / 2;
  EXPECT_EQ(make_plan(cfg, model, {.device_limit_bytes = limit, .device_host_accessible = false})
                .device_grad_sum_bytes,
            all.device_grad_sum_bytes);
  const Plan reserved = make_plan(cfg, model,
                                  {.device_limit_bytes = limit,
                                   .device_host_accessible = false,
                                   .device_reserve_bytes = reserve});
  EXPECT_GT(reserved.device_grad_sum_bytes, 0u) << format_plan(reserved);
  EXPECT_LE(reserved.device_grad_sum_bytes, all.device_grad_sum_bytes - reserve);
  EXPECT_LE(reserved.peak.device + reserve, limit);
}

// A backend that keeps device memory as the CUDA backend does, `bytes` in all: half from its
// construction (cuBLASLt's workspace, the constant tables), half from its first attention (the
// attention workspace). Computes as the CPU backend on the discrete device.
class ChargingBackend final : public device::ProfilingBackend {
 public:
  ChargingBackend(device::CpuDevice& dev, uint64_t bytes)
      : ProfilingBackend(device::make_cpu_backend(dev)),
        dev_(dev),
        bytes_(bytes),
        early_(dev_.alloc(bytes / 2, "workspace at construction")) {}
  uint64_t device_bytes() const override {
    return device::charged_bytes(early_.size()) + device::charged_bytes(late_.size());
  }
  uint64_t workspace_bytes(const device::WorkspaceShape& /*shape*/) const override {
    return bytes_;
  }
  const device::Device* device() const override { return &dev_; }
  void attention_forward(const Attention& a, const void* q, const void* k, const void* v,
                         float* lse, float* attn, float* scores, void* lowp,
                         void* attn_bf16) override {
    if (!late_) late_ = dev_.alloc(bytes_ - bytes_ / 2, "workspace at the first attention");
    ProfilingBackend::attention_forward(a, q, k, v, lse, attn, scores, lowp, attn_bf16);
  }

 private:
  device::CpuDevice& dev_;
  uint64_t bytes_;
  device::DeviceBuffer early_, late_;
};

// What the compute backend keeps on the device (a GPU's workspaces) is planned and charged to
// the budget: the plan shows it, the engine counts what the backend already holds as its own
// (under a budget that fits everything exactly, every gradient sum still fits), and the device's
// peak stays within the budget and the plan.
TEST(DiscreteDevicePlan, TheComputeBackendsWorkspaceIsPlannedAndCharged) {
  const std::string dir = swap_dir("discrete_workspace").string();
  const config::Config cfg = make_config(
      config_json({3, "cpu", "cpu"}, DType::BF16, dir, ", \"stage3_max_reuse_distance\": 0"));
  const model::LlamaModel plain(tiny_config(true), tiny_options(DType::BF16));
  const Plan all = make_plan(cfg, plain, {.device_host_accessible = false});
  ASSERT_GT(all.device_grad_sum_bytes, 0u);
  constexpr uint64_t kWorkspace = 64 * device::kAllocGranularity;
  const uint64_t budget = all.peak.device + kWorkspace;

  device::CpuDevice dev({.memory_budget_bytes = budget, .discrete = true});
  auto backend = std::make_shared<ChargingBackend>(dev, kWorkspace);
  const model::LlamaModel model(tiny_config(true), tiny_options(DType::BF16), backend);
  ASSERT_EQ(dev.memory_stats().in_use_bytes, kWorkspace / 2);
  const RunResult got = train_on(dev, cfg, model, 2);
  EXPECT_EQ(backend->device_bytes(), kWorkspace);
  EXPECT_EQ(got.plan.device_grad_sums, std::vector<bool>(model.num_units(), true))
      << format_plan(got.plan);
  EXPECT_EQ(got.plan.peak.device, all.peak.device + kWorkspace) << format_plan(got.plan);
  EXPECT_NE(format_plan(got.plan).find("compute backend"), std::string::npos)
      << format_plan(got.plan);
  EXPECT_LE(got.memory.device_peak_bytes, budget);
  EXPECT_LE(got.memory.device_peak_bytes, got.plan.peak.device) << format_plan(got.plan);

  device::CpuDevice plain_dev({.discrete = true});
  const model::LlamaModel plain_model(tiny_config(true), tiny_options(DType::BF16),
                                      device::make_backend(plain_dev));
  expect_bit_identical(train_on(plain_dev, cfg, plain_model, 2), got, "with a workspace");
}

// Plan and measurement agree on the discrete device as they do on the host-accessible one.
TEST(DiscreteDevicePlan, PeaksAndTrafficMatchThePlan) {
  const model::LlamaModel host_model(tiny_config(false), tiny_options(DType::BF16));
  device::CpuDevice dev({.discrete = true});
  const model::LlamaModel model(tiny_config(false), tiny_options(DType::BF16),
                                device::make_backend(dev));
  const std::string dir = swap_dir("discrete_plan").string();
  const config::Config cfg = make_config(
      config_json({3, "cpu", "cpu"}, DType::BF16, dir, ", \"stage3_max_reuse_distance\": 0"));
  const Measured m = measure_on(dev, cfg, model, 2);
  const Plan& p = m.plan;
  EXPECT_LE(m.memory.device_peak_bytes, p.peak.device) << format_plan(p);
  EXPECT_EQ(m.memory.pinned_peak_bytes, p.peak.pinned) << format_plan(p);
  EXPECT_EQ(m.after_steps.h2d_bytes - m.after_init.h2d_bytes, 2 * p.per_step.h2d);
  EXPECT_EQ(m.after_steps.d2h_bytes - m.after_init.d2h_bytes, 2 * p.per_step.d2h);
  EXPECT_NE(format_plan(p).find("gradient copy-back buffer"), std::string::npos) << format_plan(p);
}

// Gathered parameters kept on the device through the micro-batches of each step (decision 028):
// with slow copies, a slab reused after the step had changed the parameters, or kept without
// its fetch having landed, would show in the losses or the weights. Each unit crosses once per
// step, as planned, and the run is bit-identical to the host-accessible device's.
TEST(DiscreteDevicePlan, KeptParametersTrainBitIdenticallyAndCrossOncePerStep) {
  const model::LlamaModel host_model(tiny_config(true), tiny_options(DType::BF16));
  const std::string dir = swap_dir("discrete_kept").string();
  const config::Config cfg = make_config(config_json(
      {3, "nvme", "nvme"}, DType::BF16, dir,
      ", \"stage3_param_persistence_threshold\": 0, \"stage3_max_live_parameters\": 1000000000000, "
      "\"stage3_max_reuse_distance\": 1000000000000, \"sub_group_size\": 8192"));
  ASSERT_GT(cfg.gradient_accumulation_steps.value(), 1);
  device::CpuDevice host_dev;
  const RunResult want = train_on(host_dev, cfg, host_model, 3);
  device::CpuDevice dev({.discrete = true, .copy_delay_us = 200});
  const model::LlamaModel model(tiny_config(true), tiny_options(DType::BF16),
                                device::make_backend(dev));
  const RunResult got = train_on(dev, cfg, model, 3);
  expect_bit_identical(want, got, "kept parameters");
  // Every parameter goes up once per step, and nothing else does.
  const Measured m = measure_on(dev, cfg, model, 2);
  expect_traffic_as_planned(m, 2);
  EXPECT_EQ(m.plan.per_step.h2d, bf16_param_bytes(host_model)) << format_plan(m.plan);
  EXPECT_LE(m.memory.device_peak_bytes, m.plan.peak.device) << format_plan(m.plan);
}

// All the optimizer state on such a device (stage 0, offload_optimizer none): stepped there by
// Adam on the device (decision 036) from gradients that stay there, summed over the micro-batches,
// normed there with the host's bits (decision 037). Bit-identical to the host-accessible device,
// with the plan's peaks and per-step traffic the engine's: no gradient crosses, only the norm's
// block sums come down (and new parameters bound for host memory).
struct AllOnDeviceCase {
  Placing placing;
  DType dtype;
  bool bf16_moments = false;
  uint32_t copy_delay_us = 0;
  uint32_t compute_delay_us = 0;
  std::string name() const {
    return placing.name() + (dtype == DType::BF16 ? "_bf16" : "_fp32") +
           (bf16_moments ? "_bf16_moments" : "") + (copy_delay_us > 0 ? "_slow_copies" : "") +
           (compute_delay_us > 0 ? "_slow_compute" : "");
  }
};

// The norm's block sums of every unit (one double per kPartitionAlignElems elements).
uint64_t norm_blocks(const model::LlamaModel& model) {
  uint64_t blocks = 0;
  for (const model::UnitLayout& u : model.layout().units)
    blocks += u.partition_numel(1) / model::kPartitionAlignElems;
  return blocks;
}

class OptimizerStateOnADiscreteDevice : public ::testing::TestWithParam<AllOnDeviceCase> {};

TEST_P(OptimizerStateOnADiscreteDevice, TrainsBitIdenticalToTheHostAccessibleDevice) {
  const AllOnDeviceCase c = GetParam();
  std::string json = config_json(c.placing, c.dtype, swap_dir("all_on_" + c.name()).string());
  if (c.bf16_moments) json = with_bf16_moments(json);
  const config::Config cfg = make_config(json);
  const model::LlamaModel host_model(tiny_config(true), tiny_options(c.dtype));
  device::CpuDevice host_dev;
  const RunResult want = train_on(host_dev, cfg, host_model, 3);
  ASSERT_EQ(want.plan.placement.gradients, Tier::kDevice);

  device::CpuDevice dev(
      {.discrete = true, .copy_delay_us = c.copy_delay_us, .compute_delay_us = c.compute_delay_us});
  const model::LlamaModel model(tiny_config(true), tiny_options(c.dtype),
                                device::make_backend(dev));
  const RunResult got = train_on(dev, cfg, model, 3);
  expect_bit_identical(want, got, c.name());
  EXPECT_EQ(got.plan.placement.optimizer, Tier::kDevice);
  EXPECT_EQ(got.plan.placement.gradients, Tier::kHost);
  const std::string text = format_plan(got.plan);
  const int units = model.num_units();
  EXPECT_EQ(got.plan.device_grad_sums, std::vector<bool>(units, true)) << text;
  EXPECT_NE(text.find(fmt::format("fp32 gradients of units 0..{}, summed and kept on the device",
                                  units - 1)),
            std::string::npos)
      << text;
  EXPECT_EQ(text.find("device Adam step"), std::string::npos) << text;
  EXPECT_EQ(text.find("copy-back"), std::string::npos) << text;
  EXPECT_NE(text.find("gradient accumulators device (kept there for Adam on the device)"),
            std::string::npos)
      << text;
  EXPECT_LE(got.memory.device_peak_bytes, got.plan.peak.device) << text;
  // No gradient crosses: what goes up is what goes up on the host-accessible device (the
  // parameters' fetches); what comes down is the norm's block sums, and new parameters bound
  // for host memory.
  uint64_t down = 0;
  for (size_t u = 0; u < static_cast<size_t>(units); ++u)
    if (c.placing.stage == 3 && c.placing.offload_param != "none")
      down += model.layout().units[u].partition_numel(1) * dtype_size(c.dtype);
  EXPECT_EQ(got.plan.per_step.h2d, want.plan.per_step.h2d) << text;
  EXPECT_EQ(got.plan.per_step.d2h, want.plan.per_step.d2h + down + norm_blocks(model) * 8) << text;
  const Measured m = measure_on(dev, cfg, model, 2);
  expect_traffic_as_planned(m, 2);
  EXPECT_LE(m.memory.device_peak_bytes, m.plan.peak.device) << text;
}

INSTANTIATE_TEST_SUITE_P(
    Zero, OptimizerStateOnADiscreteDevice,
    ::testing::Values(AllOnDeviceCase{{0}, DType::BF16}, AllOnDeviceCase{{0}, DType::F32},
                      AllOnDeviceCase{{1, "none", "none"}, DType::BF16},
                      AllOnDeviceCase{{2, "none", "none"}, DType::F32, true},
                      AllOnDeviceCase{{3, "none", "none"}, DType::BF16},
                      AllOnDeviceCase{{3, "cpu", "none"}, DType::BF16, true},
                      AllOnDeviceCase{{3, "nvme", "none"}, DType::F32},
                      // slow copies: a norm's block sums copy not waited for shows
                      AllOnDeviceCase{{2, "none", "none"}, DType::BF16, false, 20000},
                      AllOnDeviceCase{{3, "none", "none"}, DType::F32, false, 20000},
                      // slow compute: a slab freed before its addition into the sum kept on
                      // the device has run shows
                      AllOnDeviceCase{{0}, DType::F32, false, 0, 300},
                      AllOnDeviceCase{{3, "cpu", "none"}, DType::BF16, false, 0, 300}),
    [](const auto& info) { return info.param.name(); });

// A budget of exactly what every unit's gradients kept on the device need is enough: the device
// Adam step's gradient scratch, needed while some unit's gradients still come up, shrinks as
// units are kept, and the last unit kept frees what the scratch held for it. One byte less
// keeps only some, with the scratch for the others, within the limit.
TEST(OptimizerStateOnADiscreteDeviceBudget, TheLastUnitKeptPaysWithTheScratchItFrees) {
  const config::Config cfg =
      make_config(config_json({0}, DType::BF16, swap_dir("all_on_exact").string()));
  const model::LlamaModel model(tiny_config(true), tiny_options(DType::BF16));
  const int units = model.num_units();
  const Plan all = make_plan(cfg, model, {.device_host_accessible = false});
  ASSERT_EQ(all.device_grad_sums, std::vector<bool>(units, true)) << format_plan(all);
  const Plan exact = make_plan(
      cfg, model, {.device_limit_bytes = all.peak.device, .device_host_accessible = false});
  EXPECT_EQ(exact.device_grad_sums, all.device_grad_sums) << format_plan(exact);
  EXPECT_EQ(exact.peak.device, all.peak.device) << format_plan(exact);
  const Plan less = make_plan(
      cfg, model, {.device_limit_bytes = all.peak.device - 1, .device_host_accessible = false});
  int kept = 0;
  for (const bool b : less.device_grad_sums) kept += b;
  EXPECT_GT(kept, 0) << format_plan(less);
  EXPECT_LT(kept, units) << format_plan(less);
  EXPECT_NE(format_plan(less).find("device Adam step"), std::string::npos) << format_plan(less);
  EXPECT_LE(less.peak.device, all.peak.device - 1) << format_plan(less);
}

// Under a budget too small for every unit's gradients beside the optimizer state: those of the
// units that fit (head first) stay on the device, the others come down to host accumulators and
// go up again for their Adam step through the device scratch the plan now needs; both paths in
// one run, bit-identical to the host-accessible device, with every micro-batch count, the device
// within the budget and the traffic as planned.
TEST(OptimizerStateOnADiscreteDeviceBudget, GradientsOfTheUnitsThatFitStayOnTheDevice) {
  const config::Config cfg =
      make_config(config_json({0}, DType::BF16, swap_dir("all_on_budget").string()));
  const model::LlamaModel host_model(tiny_config(false), tiny_options(DType::BF16));
  const int units = host_model.num_units();
  const Plan all = make_plan(cfg, host_model, {.device_host_accessible = false});
  ASSERT_EQ(all.device_grad_sums, std::vector<bool>(units, true)) << format_plan(all);
  // Room for about half of the gradients.
  const uint64_t budget = all.peak.device - all.device_grad_sum_bytes / 2;
  for (const int64_t micro_batches : {int64_t{1}, int64_t{2}, int64_t{3}}) {
    SCOPED_TRACE(fmt::format("{} micro-batches per step", micro_batches));
    device::CpuDevice host_dev;
    const RunResult want = train_on(host_dev, cfg, host_model, 2, {}, micro_batches);
    device::CpuDevice dev({.memory_budget_bytes = budget, .discrete = true});
    const model::LlamaModel model(tiny_config(false), tiny_options(DType::BF16),
                                  device::make_backend(dev));
    const RunResult got = train_on(dev, cfg, model, 2, {}, micro_batches);
    expect_bit_identical(want, got, "part of the gradients on the device");
    const std::string text = format_plan(got.plan);
    int kept = 0;
    for (const bool b : got.plan.device_grad_sums) kept += b;
    EXPECT_GT(kept, 0) << text;
    EXPECT_LT(kept, units) << text;
    EXPECT_TRUE(got.plan.device_grad_sums[units - 1]) << text;  // head first
    EXPECT_NE(text.find("summed and kept on the device"), std::string::npos) << text;
    EXPECT_NE(text.find("device Adam step"), std::string::npos) << text;
    EXPECT_NE(text.find(fmt::format("gradient accumulators host, device for {} unit", kept)),
              std::string::npos)
        << text;
    EXPECT_LE(got.memory.device_peak_bytes, budget) << text;
    EXPECT_LE(got.memory.device_peak_bytes, got.plan.peak.device) << text;
  }
  device::CpuDevice dev({.memory_budget_bytes = budget, .discrete = true});
  const model::LlamaModel model(tiny_config(false), tiny_options(DType::BF16),
                                device::make_backend(dev));
  const Measured m = measure_on(dev, cfg, model, 2);
  expect_traffic_as_planned(m, 2);
  EXPECT_LE(m.memory.device_peak_bytes, budget) << format_plan(m.plan);
}

// A device that counts host registrations (a GPU's cudaHostRegister): host memory, streams and
// events of an inner CpuDevice.
class RegisteringDevice final : public device::Device {
 public:
  explicit RegisteringDevice(bool host_accessible, uint64_t budget_bytes = 0)
      : host_accessible_(host_accessible) {
    set_budget(budget_bytes);
  }
  device::DeviceKind kind() const override { return device::DeviceKind::Cpu; }
  std::string name() const override { return "registering"; }
  bool host_accessible() const override { return host_accessible_; }
  std::unique_ptr<device::Stream> create_stream(std::string n) override {
    return inner_.create_stream(std::move(n));
  }
  std::unique_ptr<device::Event> create_event() override { return inner_.create_event(); }
  void synchronize() override { inner_.synchronize(); }
  void register_host(void* p, size_t bytes) override {
    std::lock_guard lock(mu_);
    registered_[p] = bytes;
    ++registrations_;
  }
  void unregister_host(void* p) noexcept override {
    std::lock_guard lock(mu_);
    registered_.erase(p);
  }
  size_t live() {
    std::lock_guard lock(mu_);
    return registered_.size();
  }
  uint64_t live_bytes() {
    std::lock_guard lock(mu_);
    uint64_t b = 0;
    for (const auto& [p, n] : registered_) b += n;
    return b;
  }
  int registrations() {
    std::lock_guard lock(mu_);
    return registrations_;
  }

 protected:
  void* do_alloc(size_t charged) override {
    return std::aligned_alloc(device::kAllocGranularity, charged);
  }
  void do_free(void* p, size_t /*charged*/) noexcept override { std::free(p); }

 private:
  bool host_accessible_;
  device::CpuDevice inner_;
  std::mutex mu_;
  std::map<void*, size_t> registered_;
  int registrations_ = 0;
};

// The engine registers its pinned pool with the device (so a GPU copies from it
// asynchronously) and unregisters it when destroyed; staged cpu_checkpointing registers its
// host checkpoints too.
TEST(DeviceRegistration, PinnedPoolAndHostCheckpointsAreRegisteredAndReleased) {
  for (const bool cpu_ckpt : {false, true}) {
    SCOPED_TRACE(cpu_ckpt ? "cpu_checkpointing" : "device checkpoints");
    RegisteringDevice dev(/*host_accessible=*/!cpu_ckpt);
    const model::LlamaModel model(tiny_config(true), tiny_options(DType::BF16));
    const std::string dir = swap_dir("registration").string();
    const config::Config cfg = make_config(config_json(
        {3, "nvme", "nvme"}, DType::BF16, dir, "",
        cpu_ckpt ? ", \"activation_checkpointing\": {\"cpu_checkpointing\": true}" : ""));
    comm::LocalComm comm;
    {
      ZeroEngine engine(cfg, model, dev, comm, 1);
      const size_t checkpoints = cpu_ckpt ? model.layout().units.size() - 1 : 0;
      EXPECT_EQ(dev.live(), 1 + checkpoints);  // the pool's one region (+ the checkpoints)
      EXPECT_EQ(dev.live_bytes(),
                engine.memory().pinned_budget_bytes + checkpoints * model.hidden_bytes());
    }
    EXPECT_EQ(dev.live(), 0u);
    EXPECT_GE(dev.registrations(), 1);
  }
}

// Adam on such a device reads the host accumulators of the units it steps every step when
// their gradients cannot stay on the device (a budget with no room for them here): they are
// registered (offload_optimizer.ratio 0.5 here: the last two units), and released with the
// engine.
TEST(DeviceRegistration, HostAccumulatorsOfUnitsSteppedOnTheDeviceAreRegistered) {
  const model::LlamaModel model(tiny_config(true), tiny_options(DType::BF16));
  const config::Config cfg =
      make_config(config_json({3, "none", "cpu"}, DType::BF16,
                              swap_dir("registration_ratio").string(), "", "", ", \"ratio\": 0.5"));
  // Everything but the gradients' sums, with the scratch their Adam steps then need.
  const Plan all = make_plan(cfg, model, {.device_host_accessible = false});
  uint64_t scratch = 0;
  for (size_t u = all.placement.device_optimizer_from; u < model.layout().units.size(); ++u)
    scratch = std::max<uint64_t>(scratch, model.layout().units[u].padded_numel * sizeof(float));
  const uint64_t budget = all.peak.device - all.device_grad_sum_bytes -
                          device::charged_bytes(all.device_grad_norm_blocks * sizeof(double)) +
                          device::charged_bytes(scratch);
  RegisteringDevice dev(/*host_accessible=*/false, budget);
  comm::LocalComm comm;
  {
    ZeroEngine engine(cfg, model, dev, comm, 1);
    const size_t from = engine.plan().placement.device_optimizer_from;
    ASSERT_LT(from, model.layout().units.size());
    uint64_t accum = 0;
    for (size_t u = from; u < model.layout().units.size(); ++u)
      accum += model.layout().units[u].padded_numel * sizeof(float);
    ASSERT_EQ(engine.plan().device_grad_sums, std::vector<bool>(model.layout().units.size(), false))
        << format_plan(engine.plan());
    EXPECT_EQ(dev.live(), 1 + model.layout().units.size() - from);  // the pool + accumulators
    EXPECT_EQ(dev.live_bytes(), engine.memory().pinned_budget_bytes + accum);
  }
  EXPECT_EQ(dev.live(), 0u);
}

// A device the engine copies gradients down from (not host accessible; its memory is the host's,
// so the host backend computes in it) whose copies take 20 ms, and whose next event after its
// first copy down cannot be created (bad_alloc): the failure between queuing a gradient copy and
// recording its event. It counts the buffers freed while a copy still reads them.
class FailingAfterCopyDevice final : public device::Device {
 public:
  FailingAfterCopyDevice() : inner_({.copy_delay_us = 20000}) {}
  device::DeviceKind kind() const override { return device::DeviceKind::Cpu; }
  std::string name() const override { return "failing after a copy"; }
  bool host_accessible() const override { return false; }
  std::unique_ptr<device::Stream> create_stream(std::string n) override {
    return std::make_unique<CountingStream>(*this, inner_.create_stream(std::move(n)));
  }
  std::unique_ptr<device::Event> create_event() override {
    if (fail_next_event_.exchange(false)) throw std::bad_alloc();
    return inner_.create_event();
  }
  void synchronize() override { inner_.synchronize(); }
  int freed_under_a_copy() const { return freed_under_copy_.load(); }
  int copies_down() const { return copies_down_.load(); }

 protected:
  void* do_alloc(size_t charged) override {
    return std::aligned_alloc(device::kAllocGranularity, charged);
  }
  void do_free(void* p, size_t charged) noexcept override {
    {
      std::lock_guard lock(mu_);
      for (const auto& [src, n] : reading_)
        if (n > 0 && src >= static_cast<const std::byte*>(p) &&
            src < static_cast<const std::byte*>(p) + charged)
          ++freed_under_copy_;
    }
    std::free(p);
  }

 private:
  class CountingStream final : public device::Stream {
   public:
    CountingStream(FailingAfterCopyDevice& dev, std::unique_ptr<device::Stream> inner)
        : dev_(dev), inner_(std::move(inner)) {}
    const std::string& name() const override { return inner_->name(); }
    void copy_h2d(void* dst, const void* src, size_t bytes) override {
      inner_->copy_h2d(dst, src, bytes);
    }
    void copy_d2h(void* dst, const void* src, size_t bytes) override {
      const auto* from = static_cast<const std::byte*>(src);
      dev_.reading(from, +1);
      inner_->copy_d2h(dst, src, bytes);
      FailingAfterCopyDevice* dev = &dev_;
      inner_->enqueue([dev, from] { dev->reading(from, -1); });
      if (dev_.copies_down_.fetch_add(1) == 0) dev_.fail_next_event_ = true;
    }
    void copy_d2d(void* dst, const void* src, size_t bytes) override {
      inner_->copy_d2d(dst, src, bytes);
    }
    void memset(void* dst, int value, size_t bytes) override { inner_->memset(dst, value, bytes); }
    void enqueue(std::function<void()> fn) override { inner_->enqueue(std::move(fn)); }
    void record(device::Event& e) override { inner_->record(e); }
    void wait(device::Event& e) override { inner_->wait(e); }
    void synchronize() override { inner_->synchronize(); }

   private:
    FailingAfterCopyDevice& dev_;
    std::unique_ptr<device::Stream> inner_;
  };

  void reading(const std::byte* src, int d) {
    std::lock_guard lock(mu_);
    reading_[src] += d;
  }

  device::CpuDevice inner_;
  std::mutex mu_;
  std::map<const std::byte*, int> reading_;  // GUARDED_BY(mu_)
  std::atomic<bool> fail_next_event_{false};
  std::atomic<int> freed_under_copy_{0};
  std::atomic<int> copies_down_{0};
};

// A pass failing right after a gradient slab's copy down was queued frees the slab only once
// the copy has read it (the copy-back stream finished on the unwinding), and the error is the
// one that stopped the pass.
TEST(DiscreteDeviceUnwinding, AFailedPassFreesNoSlabAQueuedCopyStillReads) {
  FailingAfterCopyDevice dev;
  const model::LlamaModel model(tiny_config(true), tiny_options(DType::F32));
  const config::Config cfg =
      make_config(config_json({3, "cpu", "cpu"}, DType::F32, swap_dir("unwinding").string()));
  comm::LocalComm comm;
  {
    ZeroEngine engine(cfg, model, dev, comm, /*seed=*/7);
    const size_t n = static_cast<size_t>(model.tokens());
    const std::vector<int32_t> tok = make_tokens(n + 1, model.config().vocab_size, 3, n + 1);
    // Every micro-batch of the step: the gradients summed on the device come down at its last.
    const int64_t gas = cfg.gradient_accumulation_steps.value();
    EXPECT_THROW(
        {
          for (int64_t k = 0; k < gas; ++k)
            engine.forward_backward(tok.data(), tok.data() + 1, 1.0f, k == 0);
        },
        std::bad_alloc);
    EXPECT_EQ(dev.copies_down(), 1);
  }
  EXPECT_EQ(dev.freed_under_a_copy(), 0);
}

// The guard the tests above rely on: host code touching the discrete device's memory faults.
TEST(DiscreteDeviceDeathTest, HostAccessToDeviceMemoryFaults) {
  GTEST_FLAG_SET(death_test_style, "threadsafe");
  device::CpuDevice dev({.discrete = true});
  device::DeviceBuffer b = dev.alloc(4096, "probe");
  volatile float* p = b.as<float>();
  EXPECT_DEATH({ p[0] = 1.0f; }, "");
  // Through the streams (and the backend's view), the same memory works.
  auto s = dev.create_stream("s");
  const float one = 1.0f;
  float back = 0.0f;
  s->copy_h2d(b.data(), &one, sizeof one);
  s->copy_d2h(&back, b.data(), sizeof back);
  s->synchronize();
  EXPECT_EQ(back, 1.0f);
  EXPECT_EQ(*static_cast<float*>(dev.host_view(b.data())), 1.0f);
}

}  // namespace
}  // namespace outcore::zero::test
