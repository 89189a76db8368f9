// zero_optimization.offload_optimizer.ratio (DeepSpeed's partial offload, ZeRO-Offload++): at
// stage 3 with the optimizer offloaded to host memory or NVMe, the units after the first
// ~ratio of the optimizer's elements keep their fp32 state on the device and are stepped
// there. Training is bit-identical to ratio 1; the plan moves exactly those bytes from the
// host / NVMe tiers to the device and drops their NVMe traffic; a device budget that cannot
// hold the device-resident part is refused at start naming the device tier.
#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <string>
#include <vector>

#include "common/aligned_buffer.hpp"
#include "common/error.hpp"
#include "swap/swap.hpp"
#include "tests/zero/zero_test_util.hpp"

namespace outcore::zero::test {
namespace {

constexpr int kPartialSteps = 3;
constexpr uint64_t kSubGroup = 8192;

config::Config ratio_config(const std::string& param, const std::string& opt, double ratio,
                            const std::string& dir) {
  return make_config(config_json({3, param, opt}, DType::BF16, dir,
                                 ", \"sub_group_size\": " + std::to_string(kSubGroup), "",
                                 ", \"ratio\": " + std::to_string(ratio)));
}

// Own elements of unit `u` (stage 3, world 1: its partition).
uint64_t own(const model::LlamaModel& model, size_t u) {
  return model.layout().units[u].partition_numel(1);
}

struct PartialCase {
  std::string opt;  // offload_optimizer.device
  double ratio;
  size_t device_from;          // the first unit whose state stays on the device
  std::string param = "nvme";  // offload_param.device
  std::string name() const {
    return "param_" + param + "_opt_" + opt + "_ratio" +
           std::to_string(static_cast<int>(ratio * 10));
  }
};

class PartialOffload : public ::testing::TestWithParam<PartialCase> {};

// Units of the tiny model (3 layers, tied embeddings): the embedding (24576 elements), three
// layers of ~43k, the final norm. Ratio 0.3 offloads the embedding only, 0.5 the embedding
// and layer 0, 0 nothing.
TEST_P(PartialOffload, TrainsBitIdenticallyToFullOffload) {
  const PartialCase c = GetParam();
  const model::LlamaModel model(tiny_config(true), tiny_options(DType::BF16));
  const config::Config full =
      ratio_config(c.param, c.opt, 1.0, swap_dir("partial_full_" + c.name()).string());
  const config::Config part =
      ratio_config(c.param, c.opt, c.ratio, swap_dir("partial_" + c.name()).string());
  const RunResult ref = train(full, model, kPartialSteps);
  const RunResult r = train(part, model, kPartialSteps);
  ASSERT_EQ(r.plan.placement.device_optimizer_from, c.device_from) << format_plan(r.plan);
  EXPECT_EQ(ref.plan.placement.device_optimizer_from, SIZE_MAX);
  expect_bit_identical(ref, r, "offload_optimizer.ratio " + std::to_string(c.ratio) + " vs 1");
  // The device really holds the tail's state.
  uint64_t charged = 0;
  for (size_t u = c.device_from; u < static_cast<size_t>(model.num_units()); ++u)
    charged += device::charged_bytes(3 * own(model, u) * sizeof(float));
  EXPECT_GE(r.memory.device_peak_bytes, ref.memory.device_peak_bytes + charged);
}

// The plan moves exactly the tail's state: device + its charged arrays, host or NVMe - its
// buffers or swap files, NVMe traffic - 24 B per tail element per step; the engine's measured
// peaks and per-step traffic match the plan as PlanVsActual checks them.
TEST_P(PartialOffload, PlanMovesTheTailsStateToTheDeviceAndMatchesTheEngine) {
  const PartialCase c = GetParam();
  const model::LlamaModel model(tiny_config(true), tiny_options(DType::BF16));
  const config::Config full =
      ratio_config(c.param, c.opt, 1.0, swap_dir("partial_plan_full_" + c.name()).string());
  const config::Config part =
      ratio_config(c.param, c.opt, c.ratio, swap_dir("partial_plan_" + c.name()).string());
  const Plan p1 = make_plan(full, model);
  const Plan p = make_plan(part, model);
  ASSERT_EQ(p.placement.device_optimizer_from, c.device_from) << format_plan(p);
  uint64_t elems = 0, charged = 0, host = 0, files = 0;
  for (size_t u = c.device_from; u < static_cast<size_t>(model.num_units()); ++u) {
    elems += own(model, u);
    ASSERT_EQ(p.placement.optimizer_home(u), Tier::kDevice);
    charged += device::charged_bytes(3 * own(model, u) * sizeof(float));
    host += align_up(3 * own(model, u) * sizeof(float), kIoAlignment);
    files += swap::SwapSpace::bytes_needed(std::vector<swap::SwapFileSpec>{
        swap::optimizer_file_spec(static_cast<uint32_t>(u), own(model, u), kSubGroup)});
  }
  ASSERT_GT(elems, 0u);
  // No device budget: the gathered-slab budget does not depend on the fixed device bytes.
  EXPECT_EQ(p.peak.device, p1.peak.device + charged) << format_plan(p);
  if (c.opt == "nvme") {
    // The files (the swap trees' directories and locks besides, as many as the kinds).
    auto files_of = [](const Plan& q) {
      return q.peak.nvme - q.param_nvme_tree_bytes - q.optimizer_nvme_tree_bytes;
    };
    EXPECT_EQ(files_of(p), files_of(p1) - files) << format_plan(p);
    EXPECT_EQ(p.optimizer_nvme_bytes, p1.optimizer_nvme_bytes - files);
    EXPECT_EQ(p.per_step.nvme_read, p1.per_step.nvme_read - 12 * elems);
    EXPECT_EQ(p.per_step.nvme_write, p1.per_step.nvme_write - 12 * elems);
    EXPECT_EQ(p.peak.host, p1.peak.host);
  } else {
    EXPECT_EQ(p.peak.host, p1.peak.host - host) << format_plan(p);
    EXPECT_EQ(p.peak.nvme, p1.peak.nvme);
    EXPECT_EQ(p.per_step.nvme_read, p1.per_step.nvme_read);
    EXPECT_EQ(p.per_step.nvme_write, p1.per_step.nvme_write);
  }
  // Parameters homed on the device: the device units' new bf16 parameters are written in
  // place after Adam instead of copied host-to-device; other homes publish as before.
  EXPECT_EQ(p.per_step.h2d, p1.per_step.h2d - (c.param == "none" ? 2 * elems : 0));
  EXPECT_EQ(p.per_step.d2h, p1.per_step.d2h);
  EXPECT_EQ(p.offloaded_optimizer_elems, p1.offloaded_optimizer_elems - elems);
  EXPECT_EQ(p.optimizer_elems, p1.optimizer_elems);
  const std::string text = format_plan(p);
  EXPECT_NE(text.find("offload_optimizer.ratio"), std::string::npos) << text;

  const Measured m = measure(part, model, kPartialSteps);
  EXPECT_LE(m.memory.device_peak_bytes, p.peak.device) << format_plan(p);
  EXPECT_GE(m.memory.device_peak_bytes, p.peak.device - p.device_live_param_bytes)
      << format_plan(p);
  EXPECT_LE(m.memory.pinned_peak_bytes, p.peak.pinned) << format_plan(p);
  if (c.opt != "nvme") {
    EXPECT_EQ(m.memory.pinned_peak_bytes, p.peak.pinned);
  }
  const TrafficStats& a = m.after_init;
  const TrafficStats& b = m.after_steps;
  EXPECT_EQ(b.h2d_bytes - a.h2d_bytes, kPartialSteps * p.per_step.h2d) << format_plan(p);
  EXPECT_EQ(b.d2h_bytes - a.d2h_bytes, kPartialSteps * p.per_step.d2h) << format_plan(p);
  EXPECT_EQ(b.nvme_read_bytes - a.nvme_read_bytes, kPartialSteps * p.per_step.nvme_read)
      << format_plan(p);
  EXPECT_EQ(b.nvme_write_bytes - a.nvme_write_bytes, kPartialSteps * p.per_step.nvme_write)
      << format_plan(p);
}

INSTANTIATE_TEST_SUITE_P(Zero, PartialOffload,
                         ::testing::Values(PartialCase{"nvme", 0.3, 1}, PartialCase{"nvme", 0.5, 2},
                                           PartialCase{"nvme", 0.0, 0}, PartialCase{"cpu", 0.3, 1},
                                           PartialCase{"cpu", 0.5, 2}, PartialCase{"cpu", 0.0, 0},
                                           PartialCase{"cpu", 0.5, 2, "none"},
                                           PartialCase{"nvme", 0.3, 1, "cpu"}),
                         [](const auto& info) { return info.param.name(); });

// On a device the host cannot read (a GPU; the simulated discrete device here) the device
// units are stepped by Adam on the device (device_adam.hpp) from gradients that stay there
// (decision 037: summed there, their norm's block sums taken there), their new parameters are
// written in place on the device or come down to their home. Training is bit-identical to the
// same run on the host-accessible device (where CPU Adam steps them in place), and the plan
// counts the device's sums, scratch and copies exactly.
struct PartialDiscreteCase {
  PartialCase c;
  DType dtype = DType::BF16;
  bool bf16_moments = false;
  uint32_t copy_delay_us = 0;  // copies slow enough that one not waited for reads stale bytes
  std::string name() const {
    return c.name() + (dtype == DType::BF16 ? "_bf16" : "_fp32") +
           (bf16_moments ? "_bf16_moments" : "") + (copy_delay_us > 0 ? "_slow_copies" : "");
  }
};

class PartialOffloadOnADiscreteDevice : public ::testing::TestWithParam<PartialDiscreteCase> {};

TEST_P(PartialOffloadOnADiscreteDevice, TrainsBitIdenticalToTheHostAccessibleDevice) {
  const PartialDiscreteCase d = GetParam();
  const PartialCase& c = d.c;
  std::string json =
      config_json({3, c.param, c.opt}, d.dtype, swap_dir("partial_discrete_" + d.name()).string(),
                  ", \"sub_group_size\": " + std::to_string(kSubGroup), "",
                  ", \"ratio\": " + std::to_string(c.ratio));
  if (d.bf16_moments) json = with_bf16_moments(json);
  const config::Config cfg = make_config(json);
  const model::LlamaModel host_model(tiny_config(true), tiny_options(d.dtype));
  device::CpuDevice host_dev;
  const RunResult want = train_on(host_dev, cfg, host_model, kPartialSteps);

  device::CpuDevice dev({.discrete = true, .copy_delay_us = d.copy_delay_us});
  const model::LlamaModel model(tiny_config(true), tiny_options(d.dtype),
                                device::make_backend(dev));
  const RunResult got = train_on(dev, cfg, model, kPartialSteps);
  ASSERT_EQ(got.plan.placement.device_optimizer_from, c.device_from) << format_plan(got.plan);
  expect_bit_identical(want, got, d.name());

  // The device keeps the device units' gradients (summed over the micro-batches, with their
  // norm's block sums) and, where their new parameters are bound for host memory, one unit's new
  // parameters; the other units' gradients are summed there too and come down once per step
  // (decision 024). No gradient goes up; the block sums and those parameters come down.
  uint64_t out = 0, down = 0, blocks = 0;
  const uint64_t param_bytes = dtype_size(d.dtype);
  for (size_t u = c.device_from; u < static_cast<size_t>(model.num_units()); ++u) {
    blocks += own(model, u) / model::kPartitionAlignElems;  // the norm blocks
    if (c.param != "none") {
      // fp32 parameters come down from the master weights: no scratch of their own
      if (d.dtype != DType::F32) out = std::max(out, own(model, u) * param_bytes);
      down += own(model, u) * param_bytes;
    }
  }
  const std::string text = format_plan(got.plan);
  EXPECT_EQ(text.find("device Adam step"), std::string::npos) << text;
  EXPECT_NE(text.find(fmt::format("units {}..{}, summed and kept on the device", c.device_from,
                                  model.num_units() - 1)),
            std::string::npos)
      << text;
  const Plan& host_plan = want.plan;
  const uint64_t gas = static_cast<uint64_t>(cfg.gradient_accumulation_steps.value());
  uint64_t sums = 0, saved = 0;
  ASSERT_EQ(got.plan.device_grad_sums.size(), static_cast<size_t>(model.num_units()));
  for (size_t u = 0; u < got.plan.device_grad_sums.size(); ++u) {
    ASSERT_TRUE(got.plan.device_grad_sums[u]) << "unit " << u << "\n" << text;
    const uint64_t bytes = model.layout().units[u].padded_numel * sizeof(float);
    sums += device::charged_bytes(bytes);
    saved += (u >= c.device_from ? gas : gas - 1) * bytes;  // kept: never sent
  }
  EXPECT_EQ(got.plan.peak.device, host_plan.peak.device + sums +
                                      device::charged_bytes(blocks * sizeof(double)) +
                                      device::charged_bytes(out))
      << text;
  EXPECT_EQ(got.plan.per_step.h2d, host_plan.per_step.h2d) << text;
  EXPECT_EQ(got.plan.per_step.d2h + saved, host_plan.per_step.d2h + down + blocks * 8) << text;
  EXPECT_EQ(got.plan.per_step.nvme_read, host_plan.per_step.nvme_read) << text;
  EXPECT_EQ(got.plan.per_step.nvme_write, host_plan.per_step.nvme_write) << text;
  EXPECT_LE(got.memory.device_peak_bytes, got.plan.peak.device) << text;
  const Measured m = measure_on(dev, cfg, model, kPartialSteps);
  expect_traffic_as_planned(m, kPartialSteps);
  EXPECT_LE(m.memory.device_peak_bytes, m.plan.peak.device) << text;
}

INSTANTIATE_TEST_SUITE_P(
    Zero, PartialOffloadOnADiscreteDevice,
    ::testing::Values(
        // parameters homed on NVMe: new ones come down to be written to their swap files
        PartialDiscreteCase{PartialCase{"nvme", 0.5, 2}},
        // homed on the device: written in place by the device's Adam
        PartialDiscreteCase{PartialCase{"cpu", 0.5, 2, "none"}},
        PartialDiscreteCase{PartialCase{"cpu", 0.5, 2, "none"}, DType::F32},
        // homed in host memory (not staged)
        PartialDiscreteCase{PartialCase{"nvme", 0.3, 1, "cpu"}},
        PartialDiscreteCase{PartialCase{"nvme", 0.5, 2}, DType::F32},
        PartialDiscreteCase{PartialCase{"cpu", 0.0, 0, "none"}, DType::BF16, true},
        // slow copies: a gradient copy up or a parameter copy down not waited for shows
        PartialDiscreteCase{PartialCase{"nvme", 0.5, 2}, DType::BF16, false, 20000},
        PartialDiscreteCase{PartialCase{"cpu", 0.5, 2, "none"}, DType::F32, true, 20000}),
    [](const auto& info) { return info.param.name(); });

// With the gradient accumulators in swap files, the units whose gradients stay on the device
// (stepped there, decision 037) have no swap file: only the offloaded units' files exist, as the
// plan counts them, and the run is bit-identical to the host-accessible device's with the same
// accumulators, its NVMe traffic as planned.
TEST(PartialOffloadOnADiscreteDeviceNvmeGradients, KeptGradientsHaveNoSwapFiles) {
  const std::string dir = swap_dir("partial_discrete_nvme_grads").string();
  const config::Config cfg = ratio_config("nvme", "nvme", 0.3, dir);  // the embedding offloaded
  const model::LlamaModel host_model(tiny_config(true), tiny_options(DType::BF16));
  device::CpuDevice host_dev;
  const RunResult want = train_on(host_dev, cfg, host_model, kPartialSteps, nvme_gradients());
  device::CpuDevice dev({.discrete = true});
  const model::LlamaModel model(tiny_config(true), tiny_options(DType::BF16),
                                device::make_backend(dev));
  const RunResult got = train_on(dev, cfg, model, kPartialSteps, nvme_gradients());
  expect_bit_identical(want, got, "nvme gradients");
  const size_t from = got.plan.placement.device_optimizer_from;
  ASSERT_EQ(from, 1u) << format_plan(got.plan);
  ASSERT_EQ(got.plan.placement.gradients, Tier::kNvme);
  std::vector<swap::SwapFileSpec> offloaded;
  for (size_t u = 0; u < from; ++u)
    offloaded.push_back({.unit = static_cast<uint32_t>(u),
                         .kind = swap::SwapKind::kGrad,
                         .tensors = {{"g", own(model, u) * sizeof(float)}}});
  const std::string text = format_plan(got.plan);
  const std::string line = "fp32 gradient accumulators (swap files)";
  bool found = false;
  for (const PlanItem& it : got.plan.items)
    if (it.what == line) {
      found = true;
      EXPECT_EQ(it.bytes, swap::SwapSpace::bytes_needed(offloaded)) << text;
    }
  EXPECT_TRUE(found) << text;
  // Their staging buffers hold the longest of those units (the embedding), not a layer, which
  // keeps its gradients on the device.
  const uint64_t slot = align_up(own(model, 0) * sizeof(float), kIoAlignment);
  EXPECT_NE(text.find(fmt::format("gradient staging buffers (3 x {} B)", slot)), std::string::npos)
      << text;
  const std::filesystem::path grad_dir =
      std::filesystem::path(dir) / "outcore_swap" / "rank0" / "grad";
  const Measured m = measure_on(dev, cfg, model, kPartialSteps, nvme_gradients(), [&] {
    std::vector<std::string> files;
    for (const auto& e : std::filesystem::directory_iterator(grad_dir))
      if (e.path().extension() == ".bin") files.push_back(e.path().filename().string());
    std::sort(files.begin(), files.end());
    EXPECT_EQ(files, std::vector<std::string>{"0.bin"}) << grad_dir;
  });
  expect_traffic_as_planned(m, kPartialSteps);
}

// Ratio 1 fits a device budget of exactly its own peak (no room for gathered slabs beyond the
// minimum); ratio 0 needs every unit's optimizer state on the device as well, and the plan
// refuses it before anything is allocated, naming the device tier and its config key.
TEST(PartialOffloadBudget, DeviceTooSmallForTheDeviceStateIsRefusedNamingTheDevice) {
  const model::LlamaModel model(tiny_config(false), tiny_options(DType::BF16));
  const config::Config full = ratio_config("cpu", "cpu", 1.0, "");
  const config::Config none = ratio_config("cpu", "cpu", 0.0, "");
  const uint64_t budget = make_plan(full, model, {.device_limit_bytes = 1}).peak.device;
  {
    device::CpuDevice dev({.memory_budget_bytes = budget});
    comm::LocalComm comm;
    EXPECT_NO_THROW(ZeroEngine(full, model, dev, comm, 1));
  }
  device::CpuDevice dev({.memory_budget_bytes = budget});
  comm::LocalComm comm;
  try {
    ZeroEngine engine(none, model, dev, comm, 1);
    FAIL() << "a device budget without room for the optimizer state was accepted";
  } catch (const OutOfMemory& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.rfind("device: the plan needs", 0), 0u) << msg;
    EXPECT_NE(msg.find("outcore.device_memory_mb"), std::string::npos) << msg;
    EXPECT_NE(msg.find(std::to_string(budget) + " bytes"), std::string::npos) << msg;
  }
  EXPECT_EQ(dev.memory_stats().total_allocations, 0u);  // refused before allocating anything
}

}  // namespace
}  // namespace outcore::zero::test
