// The placement planner against what the engine really allocates and moves.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <optional>
#include <regex>
#include <string>

#include "engine/zero/geometry.hpp"
#include "engine/zero/step_bounds.hpp"
#include "tests/common/log_capture.hpp"
#include "tests/zero/zero_test_util.hpp"

namespace outcore::zero::test {
namespace {

class PlanVsActual : public ::testing::TestWithParam<Placing> {};

TEST_P(PlanVsActual, PeaksAndTrafficMatchThePlan) {
  const Placing s = GetParam();
  const model::LlamaModel model(tiny_config(true), tiny_options(DType::BF16));
  const std::string dir = swap_dir("plan_" + s.name()).string();
  const config::Config cfg = make_config(config_json(
      s, DType::BF16, dir, ", \"stage3_max_reuse_distance\": 0, \"sub_group_size\": 8192"));
  const int steps = 3;
  const Measured m = measure(cfg, model, steps);
  const Plan& p = m.plan;
  if (s.stage < 3) {
    // Every device allocation is fixed: the plan is exact.
    EXPECT_EQ(m.memory.device_peak_bytes, p.peak.device) << format_plan(p);
  } else {
    EXPECT_LE(m.memory.device_peak_bytes, p.peak.device) << format_plan(p);
    EXPECT_GE(m.memory.device_peak_bytes, p.peak.device - p.device_live_param_bytes)
        << format_plan(p);
  }
  EXPECT_LE(m.memory.pinned_peak_bytes, p.peak.pinned) << format_plan(p);
  if (s.offload_optimizer != "nvme") {
    EXPECT_EQ(m.memory.pinned_peak_bytes, p.peak.pinned);
  }

  const TrafficStats& a = m.after_init;
  const TrafficStats& b = m.after_steps;
  EXPECT_EQ(b.h2d_bytes - a.h2d_bytes, steps * p.per_step.h2d) << format_plan(p);
  EXPECT_EQ(b.d2h_bytes - a.d2h_bytes, steps * p.per_step.d2h) << format_plan(p);
  EXPECT_EQ(b.nvme_read_bytes - a.nvme_read_bytes, steps * p.per_step.nvme_read) << format_plan(p);
  EXPECT_EQ(b.nvme_write_bytes - a.nvme_write_bytes, steps * p.per_step.nvme_write)
      << format_plan(p);
}

INSTANTIATE_TEST_SUITE_P(Zero, PlanVsActual,
                         ::testing::Values(Placing{0}, Placing{1, "none", "cpu"},
                                           Placing{2, "none", "none"}, Placing{3, "none", "none"},
                                           Placing{3, "cpu", "cpu"}, Placing{3, "nvme", "nvme"}),
                         [](const auto& info) { return info.param.name(); });

// Adam moments in bf16 (optimizer.params.fp32_optimizer_states: false): the optimizer state
// takes 8 B per element in every tier; the plan says so, the engine allocates and moves exactly
// that, and with the state on NVMe each step reads and writes 4 B per element less.
TEST(Plan, Bf16MomentsShrinkTheOptimizerBytesExactlyAsMeasured) {
  const model::LlamaModel model(tiny_config(true), tiny_options(DType::BF16));
  for (const Placing& s : {Placing{0}, Placing{3, "nvme", "nvme"}}) {
    SCOPED_TRACE(s.name());
    const std::string dir = swap_dir("plan_bf16m_" + s.name()).string();
    std::string json = config_json(s, DType::BF16, dir,
                                   ", \"stage3_max_reuse_distance\": 0, \"sub_group_size\": 8192");
    const config::Config fp32 = make_config(json);
    const std::string key = "\"weight_decay\": 0.01";
    json.insert(json.find(key) + key.size(), ", \"fp32_optimizer_states\": false");
    const config::Config bf16 = make_config(json);
    const int steps = 2;
    const Measured m = measure(bf16, model, steps);
    const Plan& p = m.plan;
    const Plan pf = make_plan(fp32, model);
    const uint64_t saved = 4 * p.optimizer_elems;  // 2 B less per moment
    if (s.stage == 0) {
      EXPECT_EQ(m.memory.device_peak_bytes, p.peak.device) << format_plan(p);
      EXPECT_EQ(pf.peak.device - p.peak.device, saved) << format_plan(p);
    } else {
      EXPECT_EQ(pf.optimizer_nvme_bytes - p.optimizer_nvme_bytes, saved) << format_plan(p);
      EXPECT_EQ(pf.per_step.nvme_read - p.per_step.nvme_read, saved);
      EXPECT_EQ(pf.per_step.nvme_write - p.per_step.nvme_write, saved);
      EXPECT_LT(p.peak.pinned, pf.peak.pinned);  // smaller sub-group buffers
      EXPECT_LE(m.memory.pinned_peak_bytes, p.peak.pinned) << format_plan(p);
    }
    const TrafficStats& a = m.after_init;
    const TrafficStats& b = m.after_steps;
    EXPECT_EQ(b.nvme_read_bytes - a.nvme_read_bytes, steps * p.per_step.nvme_read)
        << format_plan(p);
    EXPECT_EQ(b.nvme_write_bytes - a.nvme_write_bytes, steps * p.per_step.nvme_write)
        << format_plan(p);
    EXPECT_NE(format_plan(p).find("bf16 Adam moments"), std::string::npos) << format_plan(p);
  }
}

// A sub_group_size that is not a multiple of 1024 elements pads each sub-group's three parts
// to 4 KiB: the plan counts the bytes the drive moves, as measured (it counted the state's bytes,
// 10 times fewer at 100 elements), says which key pads them, and a swap path without room
// for the padded files names the key too.
TEST(Plan, SmallSubGroupsPadTheOptimizerFilesAndTrafficAsMeasured) {
  const model::LlamaModel model(tiny_config(true), tiny_options(DType::BF16));
  const Placing s{3, "nvme", "nvme"};
  const std::string dir = swap_dir("plan_small_sub_groups").string();
  const config::Config cfg = make_config(config_json(
      s, DType::BF16, dir, ", \"stage3_max_reuse_distance\": 0, \"sub_group_size\": 100"));
  const int steps = 2;
  const Measured m = measure(cfg, model, steps);
  const Plan& p = m.plan;
  const TrafficStats& a = m.after_init;
  const TrafficStats& b = m.after_steps;
  EXPECT_EQ(b.nvme_read_bytes - a.nvme_read_bytes, steps * p.per_step.nvme_read) << format_plan(p);
  EXPECT_EQ(b.nvme_write_bytes - a.nvme_write_bytes, steps * p.per_step.nvme_write)
      << format_plan(p);
  EXPECT_GT(p.per_step.nvme_read, 10 * 12 * p.offloaded_optimizer_elems) << format_plan(p);
  const std::string text = format_plan(p);
  EXPECT_NE(text.find("note: zero_optimization.sub_group_size 100 pads"), std::string::npos)
      << text;
  PlanLimits limits;
  limits.optimizer_nvme = p.optimizer_nvme_bytes - 1;
  try {
    check_fits(p, limits);
    ADD_FAILURE() << "fits in a byte less than its swap files";
  } catch (const OutOfMemory& e) {
    EXPECT_NE(std::string(e.what()).find("zero_optimization.sub_group_size 100"), std::string::npos)
        << e.what();
  }
  const config::Config whole = make_config(config_json(
      s, DType::BF16, dir, ", \"stage3_max_reuse_distance\": 0, \"sub_group_size\": 8192"));
  EXPECT_EQ(make_plan(whole, model).sub_group_padding, "");
}

// Stage 3 with a small stage3_max_live_parameters or stage3_max_reuse_distance: units released
// after forward (or evicted, or refused by the live cap) are fetched again in backward, in
// every micro-batch (gradient_accumulation_steps 2). The plan replays the coordinator's policy,
// so its traffic is exact, and it must count those refetches.
TEST(Plan, SmallLiveAndReuseLimitsTrafficMatchesThePlan) {
  struct Limits {
    std::string name;
    std::string zero;  // spliced into zero_optimization
  };
  const std::vector<Limits> limits = {
      {"max_live",
       ", \"stage3_param_persistence_threshold\": 0, \"stage3_max_live_parameters\": 50000,"
       " \"stage3_max_reuse_distance\": 1000000000"},
      {"reuse_distance",
       ", \"stage3_param_persistence_threshold\": 0, \"stage3_max_reuse_distance\": 30000"},
      {"persistent_embedding",
       ", \"stage3_param_persistence_threshold\": 30000, \"stage3_max_live_parameters\": "
       "100000, \"stage3_max_reuse_distance\": 100000, \"stage3_prefetch_bucket_size\": 50000"},
  };
  const std::vector<Placing> placings = {{3, "cpu", "cpu"}, {3, "nvme", "nvme"}};
  for (const bool tied : {true, false}) {
    const model::LlamaModel model(tiny_config(tied), tiny_options(DType::BF16));
    for (const Placing& s : placings)
      for (const Limits& l : limits) {
        SCOPED_TRACE(s.name() + " " + l.name + (tied ? " tied" : " untied"));
        const std::string dir = swap_dir("plan_limits_" + s.name()).string();
        const config::Config cfg =
            make_config(config_json(s, DType::BF16, dir, l.zero + ", \"sub_group_size\": 8192"));
        ASSERT_EQ(cfg.gradient_accumulation_steps.value(), 2);
        const int steps = 2;
        const Measured m = measure(cfg, model, steps);
        const Plan& p = m.plan;
        // One fetch of each unit per micro-batch: what the plan would say without refetches.
        const uint64_t once =
            bf16_param_bytes(model) * static_cast<uint64_t>(p.micro_batches_per_step);
        EXPECT_GT(p.per_step.h2d, once) << format_plan(p);
        expect_traffic_as_planned(m, steps);
      }
  }
}

// With room for every slab and a reuse distance longer than a pass, the gathered parameters
// stay on the device through the micro-batches of a step: each unit crosses to the device once
// per step (not twice per micro-batch), the plan says so, and the engine moves exactly that.
TEST(Plan, GatheredParametersStayThroughTheMicroBatchesOfAStep) {
  for (const bool tied : {true, false}) {
    SCOPED_TRACE(tied ? "tied" : "untied");
    const model::LlamaModel model(tiny_config(tied), tiny_options(DType::BF16));
    const std::string dir = swap_dir("plan_kept").string();
    const config::Config cfg = make_config(config_json(
        {3, "nvme", "nvme"}, DType::BF16, dir,
        ", \"stage3_param_persistence_threshold\": 0, \"stage3_max_live_parameters\": "
        "1000000000, \"stage3_max_reuse_distance\": 1000000000, \"sub_group_size\": 8192"));
    ASSERT_EQ(cfg.gradient_accumulation_steps.value(), 2);
    const int steps = 2;
    const Measured m = measure(cfg, model, steps);
    EXPECT_EQ(m.plan.per_step.h2d, bf16_param_bytes(model)) << format_plan(m.plan);
    expect_traffic_as_planned(m, steps);
  }
}

TEST(Plan, NvmeGradientsMatchThePlan) {
  const model::LlamaModel model(tiny_config(false), tiny_options(DType::F32));
  const std::string dir = swap_dir("plan_nvme_grads").string();
  const config::Config cfg = make_config(config_json({3, "nvme", "nvme"}, DType::F32, dir));
  const int steps = 2;
  const Measured m = measure(cfg, model, steps, nvme_gradients());
  const Plan& p = m.plan;
  ASSERT_EQ(p.placement.gradients, Tier::kNvme);
  EXPECT_EQ(
      p.peak.host, make_plan(cfg, model).peak.host - [&] {
        uint64_t b = 0;
        for (const auto& u : model.layout().units) b += u.padded_numel * sizeof(float);
        return b;
      }());  // no host accumulators
  EXPECT_LE(m.memory.device_peak_bytes, p.peak.device);
  EXPECT_LE(m.memory.pinned_peak_bytes, p.peak.pinned);
  const TrafficStats& a = m.after_init;
  const TrafficStats& b = m.after_steps;
  EXPECT_EQ(b.nvme_read_bytes - a.nvme_read_bytes, steps * p.per_step.nvme_read) << format_plan(p);
  EXPECT_EQ(b.nvme_write_bytes - a.nvme_write_bytes, steps * p.per_step.nvme_write)
      << format_plan(p);
  EXPECT_EQ(b.d2h_bytes - a.d2h_bytes, steps * p.per_step.d2h);
}

// The step's times: FLOPs of every token of every micro-batch (with activation checkpointing,
// each decoder's forward again but its down projection), the attention's at its rate and the rest
// at the GEMM rate, the copies at the PCIe rate, the drive's bytes at its rates, CPU Adam's
// elements at its rate, and the bound is the largest; an NVMe plan without drive rates leaves
// the drive unknown.
TEST(StepBounds, TimesAreBytesAndFlopsOverTheRatesAndTheBoundIsTheLargest) {
  Plan plan;
  plan.tokens_per_micro_batch = 32;
  plan.micro_batches_per_step = 3;
  plan.per_step = {
      .nvme_read = 4'000'000, .nvme_write = 2'000'000, .h2d = 6'000'000, .d2h = 2'000'000};
  const model::LlamaModel m(tiny_config(true), tiny_options(DType::BF16));
  const double flops = m.config().train_flops_per_token(m.options().seq_len) * 96;
  StepTimes t = step_times(
      plan, m,
      {.gemm_flops = 1e9, .pcie_bytes = 4e9, .drive_read_bytes = 2e9, .drive_write_bytes = 1e9});
  EXPECT_DOUBLE_EQ(t.flops, flops);
  EXPECT_DOUBLE_EQ(t.compute_s, flops / 1e9);  // the attention at the GEMM rate when not given
  // The attention's FLOPs at their own rate, the rest at the GEMM rate.
  const double attention = 3 * m.config().attention_flops_per_token(m.options().seq_len) * 96;
  ASSERT_GT(attention, 0);
  ASSERT_LT(attention, flops);
  const StepTimes split = step_times(plan, m, {.gemm_flops = 1e9, .attention_flops = 1e8});
  EXPECT_DOUBLE_EQ(split.attention_flops, attention);
  EXPECT_DOUBLE_EQ(split.gemm_s, (flops - attention) / 1e9);
  EXPECT_DOUBLE_EQ(split.attention_s, attention / 1e8);
  EXPECT_DOUBLE_EQ(split.compute_s, split.gemm_s + split.attention_s);
  EXPECT_DOUBLE_EQ(t.pcie_s, 8e6 / 4e9);
  EXPECT_DOUBLE_EQ(t.drive_s, 4e6 / 2e9 + 2e6 / 1e9);
  EXPECT_TRUE(t.drive_known);
  EXPECT_EQ(t.bound(), t.compute_s >= 4e-3 ? "compute" : "drive");
  EXPECT_DOUBLE_EQ(t.bound_s(), std::max({t.compute_s, t.pcie_s, t.drive_s}));
  t = step_times(
      plan, m,
      {.gemm_flops = 1e15, .pcie_bytes = 1e9, .drive_read_bytes = 2e9, .drive_write_bytes = 1e9});
  EXPECT_EQ(t.bound(), "PCIe");  // 8 ms of copies against 4 ms of drive
  EXPECT_FALSE(t.transfers_hidden());
  t = step_times(plan, m, {.gemm_flops = 1e15, .pcie_bytes = 1e9});
  EXPECT_FALSE(t.drive_known);
  // CPU Adam over the elements it steps: the offloaded ones on a GPU, all of them on a device
  // in host memory; not counted without a rate.
  plan.optimizer_elems = 30'000'000;
  plan.offloaded_optimizer_elems = 20'000'000;
  plan.device_host_accessible = false;
  t = step_times(plan, m, {.gemm_flops = 1e15, .pcie_bytes = 1e9, .adam_elems = 1e9});
  EXPECT_EQ(t.adam_elems, 20'000'000u);
  EXPECT_DOUBLE_EQ(t.adam_s, 0.02);
  EXPECT_EQ(t.bound(), "CPU Adam");  // 20 ms against 8 ms of copies
  EXPECT_DOUBLE_EQ(t.bound_s(), 0.02);
  EXPECT_FALSE(t.transfers_hidden());
  plan.device_host_accessible = true;
  t = step_times(plan, m, {.gemm_flops = 1e9, .pcie_bytes = 1e9, .adam_elems = 1e9});
  EXPECT_EQ(t.adam_elems, 30'000'000u);
  EXPECT_DOUBLE_EQ(t.adam_s, 0.03);
  EXPECT_EQ(t.bound(), t.compute_s >= 0.03 ? "compute" : "CPU Adam");
  EXPECT_EQ(step_times(plan, m, {.gemm_flops = 1e9}).adam_s, 0.0);
  // Compute hides the transfers, not CPU Adam (it runs under the next step's first forward
  // only): slow enough Adam bounds the step whatever the compute.
  t = step_times(plan, m, {.gemm_flops = 1e6, .pcie_bytes = 1e12, .adam_elems = 1e3});
  EXPECT_TRUE(t.transfers_hidden());
  EXPECT_GT(t.adam_s, t.compute_s);
  EXPECT_EQ(t.bound(), "CPU Adam");
  model::ModelOptions o = tiny_options(DType::BF16);
  o.activation_checkpointing = true;
  const model::LlamaModel ck(tiny_config(true), o);
  // Checkpointing: each decoder's forward again, all but the down projection (the head is not
  // recomputed).
  const model::LlamaConfig& c = ck.config();
  const double layer_again =
      2.0 * c.hidden_size * (2.0 * c.q_dim() + 2.0 * c.kv_dim() + 2.0 * c.intermediate_size);
  EXPECT_DOUBLE_EQ(step_times(plan, ck, {.gemm_flops = 1e9}).flops,
                   flops + (c.num_hidden_layers * layer_again + attention / 3 / 96) * 96);
  EXPECT_DOUBLE_EQ(step_times(plan, ck, {.gemm_flops = 1e9}).attention_flops,
                   attention * 4.0 / 3.0);
}

// The attention measured for a model's rate is its own (heads, head size, dtype) on one
// sequence of at most the tokens asked for, and its FLOPs are those the step counts per layer.
TEST(StepBounds, TheAttentionMeasuredIsTheModelsAndCountsItsFlops) {
  const model::LlamaModel m(tiny_config(true), tiny_options(DType::BF16));
  const int64_t T = m.options().seq_len;
  const device::ComputeBackend::Attention whole = rate_attention(m, 1 << 20);
  const device::ComputeBackend::Attention model_attention = m.workspace_shape().attention;
  EXPECT_EQ(whole.B, 1);
  EXPECT_EQ(whole.T, T);
  EXPECT_EQ(whole.nh, model_attention.nh);
  EXPECT_EQ(whole.nkv, model_attention.nkv);
  EXPECT_EQ(whole.hd, model_attention.hd);
  EXPECT_EQ(whole.dtype, model_attention.dtype);
  EXPECT_DOUBLE_EQ(device::attention_train_flops(whole),
                   3 * m.config().attention_flops_per_token(T) * T /
                       static_cast<double>(m.config().num_hidden_layers));
  const device::ComputeBackend::Attention part = rate_attention(m, T / 2);
  EXPECT_EQ(part.T, T / 2);
  EXPECT_LE(part.block, part.T);
}

// The simulated device's memory is host memory: the host figure checked holds the device's
// peak there, and not for a GPU; a refusal says so.
TEST(Plan, TheSimulatedDevicesMemoryCountsAsHostMemory) {
  const model::LlamaModel model(tiny_config(false), tiny_options(DType::BF16));
  const config::Config cfg = make_config(config_json({3, "nvme", "nvme"}, DType::BF16, "/tmp/x"));
  const Plan sim = make_plan(cfg, model);
  const Plan gpu = make_plan(cfg, model, {.device_in_host_memory = false});
  ASSERT_GT(sim.peak.device, 0u);
  const uint64_t pool = std::max(sim.peak.pinned, sim.pinned_pool_bytes);
  EXPECT_EQ(host_need_bytes(sim), sim.peak.host + pool + sim.peak.device);
  EXPECT_EQ(host_need_bytes(gpu), gpu.peak.host + pool);
  PlanLimits l;
  l.host = host_need_bytes(gpu);
  EXPECT_NO_THROW(check_fits(gpu, l));
  try {
    check_fits(sim, l);
    ADD_FAILURE() << "the simulated device's memory was not counted as host memory";
  } catch (const OutOfMemory& e) {
    EXPECT_NE(std::string(e.what()).find("the simulated device's memory"), std::string::npos)
        << e.what();
  }
}

// With the optimizer state on NVMe, the gradient sums go to swap files where they would take
// more than a quarter of the host memory: the memory of the machine planned for when it is
// given (outcore estimate --host-memory-gb), not this one's.
TEST(Plan, GradientsArePlacedForTheMachinePlannedFor) {
  const model::LlamaModel model(tiny_config(false), tiny_options(DType::BF16));
  const config::Config cfg = make_config(config_json({3, "nvme", "nvme"}, DType::BF16, "/tmp/x"));
  const Plan small = make_plan(cfg, model, {.host_memory_bytes = 4096});
  const Plan large = make_plan(cfg, model, {.host_memory_bytes = uint64_t{1} << 40});
  EXPECT_EQ(small.placement.gradients, Tier::kNvme);
  EXPECT_EQ(large.placement.gradients, Tier::kHost);
}

// A memory cgroup's limit less its usage that cannot be reclaimed (its file pages can), v2 and v1,
// the tightest of the cgroup and its ancestors; none without a limit.
TEST(HostMemory, TheMemoryCgroupsLimitLessItsUsage) {
  namespace fs = std::filesystem;
  const fs::path root = swap_dir("cgroup_root");
  fs::remove_all(root);
  auto put = [&](const fs::path& rel, const std::string& text) {
    fs::create_directories((root / rel).parent_path());
    std::ofstream(root / rel) << text;
  };
  const uint64_t mib = uint64_t{1} << 20;
  // v2: a/b limited to 1 GiB, holding 300 MiB of which 100 MiB page cache (active and inactive:
  // reclaimable); a: "max".
  put("a/b/memory.max", std::to_string(1024 * mib) + "\n");
  put("a/b/memory.current", std::to_string(300 * mib) + "\n");
  put("a/b/memory.stat", "anon 1\nactive_file " + std::to_string(50 * mib) + "\ninactive_file " +
                             std::to_string(50 * mib) + "\nfile 5\n");
  put("a/memory.max", "max\n");
  put("a/memory.current", "1\n");
  put("proc_v2", "0::/a/b\n");
  std::optional<detail::CgroupMemory> m = detail::cgroup_memory(root / "proc_v2", root);
  ASSERT_TRUE(m.has_value());
  EXPECT_EQ(m->available_bytes, 824 * mib);
  EXPECT_EQ(m->limit_bytes, 1024 * mib);
  EXPECT_EQ(m->limit_file, (root / "a" / "b" / "memory.max").string());
  // The parent's limit is the tighter one.
  put("a/memory.max", std::to_string(512 * mib) + "\n");
  put("a/memory.current", std::to_string(400 * mib) + "\n");
  m = detail::cgroup_memory(root / "proc_v2", root);
  ASSERT_TRUE(m.has_value());
  EXPECT_EQ(m->available_bytes, 112 * mib);
  EXPECT_EQ(m->limit_file, (root / "a" / "memory.max").string());
  // v1: the memory controller's hierarchy; an unlimited one (a huge limit) is no limit.
  put("memory/c/memory.limit_in_bytes", std::to_string(2048 * mib) + "\n");
  put("memory/c/memory.usage_in_bytes", std::to_string(48 * mib) + "\n");
  put("memory/c/memory.stat", "total_inactive_file 0\n");
  put("memory/memory.limit_in_bytes", "9223372036854771712\n");
  put("memory/memory.usage_in_bytes", "1\n");
  put("proc_v1", "7:blkio:/\n4:cpu,memory:/c\n1:name=systemd:/\n");
  m = detail::cgroup_memory(root / "proc_v1", root);
  ASSERT_TRUE(m.has_value());
  EXPECT_EQ(m->available_bytes, 2000 * mib);
  EXPECT_EQ(m->limit_file, (root / "memory" / "c" / "memory.limit_in_bytes").string());
  put("proc_none", "4:memory:/\n");
  EXPECT_FALSE(detail::cgroup_memory(root / "proc_none", root).has_value());
  fs::remove_all(root);
}

// The GPU test of stage 3 under a device budget below the model's state (gpu_test.cpp) still
// fits once the CUDA backend's workspaces are charged to that budget: checked here, where there
// is no GPU, with the planner's own figures for a CUDA device.
TEST(Plan, TheGpuTestsBudgetHoldsTheCudaBackendsWorkspace) {
  const uint64_t budget = 3u << 19;
  const config::Config cfg = make_config(config_json({3, "nvme", "nvme"}, DType::BF16, "/tmp/x",
                                                     ", \"stage3_max_reuse_distance\": 0"));
  const model::LlamaModel model(tiny_config(true), tiny_options(DType::BF16));
  const device::Workspace w =
      device::backend_workspace(device::DeviceKind::Cuda, model.workspace_shape());
  EXPECT_EQ(w.gemm, device::gemm_workspace_bytes());  // none unless a program asks
  const Plan p = make_plan(cfg, model,
                           {.device_limit_bytes = budget,
                            .device_host_accessible = false,
                            .compute_workspace_bytes = w.total()});
  EXPECT_NE(format_plan(p).find("compute backend"), std::string::npos) << format_plan(p);
  PlanLimits l;
  l.device = budget;
  EXPECT_NO_THROW(check_fits(p, l)) << format_plan(p, &l);
}

TEST(Plan, FormatShowsEveryTierTheTotalsAndTheTraffic) {
  const model::LlamaModel model(tiny_config(false), tiny_options(DType::BF16));
  const config::Config cfg = make_config(config_json({3, "nvme", "nvme"}, DType::BF16, "/tmp/x"));
  const Plan p = make_plan(cfg, model);
  PlanLimits l;
  l.device = 1 << 20;
  const std::string text = format_plan(p, &l);
  for (const char* s : {"device", "pinned", "host", "nvme", "= total", "per optimizer step",
                        "DOES NOT FIT", "swap files"})
    EXPECT_NE(text.find(s), std::string::npos) << s << " missing from:\n" << text;
  EXPECT_EQ(p.placement.params, Tier::kNvme);
  EXPECT_EQ(p.placement.optimizer, Tier::kNvme);
  EXPECT_GT(p.peak.nvme, model.config().num_parameters() * 14);  // 12 B optimizer + 2 B params
  // A checkpoint: 12 B of fp32 master weights and moments + 2 B of bf16 parameters per element.
  EXPECT_EQ(p.checkpoint_bytes, p.padded_elems * 14);
  EXPECT_NE(text.find("a checkpoint (--save-dir): " + format_bytes(p.checkpoint_bytes)),
            std::string::npos)
      << text;
  // Host memory's verdict is on host and pinned together: the row shows that figure, between
  // the host figure alone (which fits) and the sum (which does not).
  ASSERT_GT(p.peak.pinned, 0u);
  ASSERT_GE(host_need_bytes(p), p.peak.host + p.peak.pinned);
  l.host = p.peak.host + p.peak.pinned / 2;
  const std::string host_row = format_plan(p, &l);
  EXPECT_NE(host_row.find("(MemAvailable) for host + pinned pool + device " +
                          format_bytes(host_need_bytes(p)) + ": DOES NOT FIT"),
            std::string::npos)
      << host_row;
  // The scratch names what sizes it: here the head's logits for the micro-batch's 32 rows;
  // with 16 rows per launch of a 64-token vocabulary, a decoder layer.
  EXPECT_NE(text.find("scratch: 32 rows of head logits)"), std::string::npos) << text;
  model::LlamaConfig narrow = tiny_config(false);
  narrow.vocab_size = 64;
  model::ModelOptions rows = tiny_options(DType::BF16);
  rows.head_chunk_rows = 16;
  const std::string decoder = format_plan(make_plan(cfg, model::LlamaModel(narrow, rows)));
  EXPECT_NE(decoder.find("scratch: a decoder layer)"), std::string::npos) << decoder;
}

TEST(Plan, CheckFitsNamesTheTierTheNeedAndTheLimit) {
  const model::LlamaModel model(tiny_config(false), tiny_options(DType::F32));
  const config::Config cfg = make_config(config_json({3, "nvme", "nvme"}, DType::F32, "/tmp/x"));
  const Plan p = make_plan(cfg, model);
  auto message = [&](PlanLimits l) {
    try {
      check_fits(p, l);
    } catch (const OutOfMemory& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  EXPECT_EQ(message({}), "");
  PlanLimits l;
  l.device = p.peak.device - 1;
  std::string m = message(l);
  EXPECT_NE(m.find("device"), std::string::npos) << m;
  EXPECT_NE(m.find(std::to_string(p.peak.device) + " bytes"), std::string::npos) << m;
  EXPECT_NE(m.find("outcore.device_memory_mb"), std::string::npos) << m;
  // A byte short: the two figures are shown with the decimals that tell them apart.
  const std::regex figures(R"(needs ([0-9.]+ [KMG]iB) .* allows ([0-9.]+ [KMG]iB))");
  std::smatch got;
  ASSERT_TRUE(std::regex_search(m, got, figures)) << m;
  EXPECT_NE(got[1].str(), got[2].str()) << m;
  l = {};
  l.pinned = p.peak.pinned - 1;
  EXPECT_NE(message(l).find("pinned"), std::string::npos);
  l = {};
  l.host = 4096;
  EXPECT_NE(message(l).find("MemAvailable"), std::string::npos);
  l = {};
  l.param_nvme = l.optimizer_nvme = 4096;
  m = message(l);
  EXPECT_NE(m.find("/tmp/x"), std::string::npos) << m;
  EXPECT_NE(m.find(std::to_string(p.param_nvme_bytes + p.param_nvme_tree_bytes) + " bytes"),
            std::string::npos)
      << m;
  EXPECT_EQ(m.find("step_in_backward"), std::string::npos) << m;
  // The optimizer state's spare copy under outcore.step_in_backward is named with it.
  const Plan spare =
      make_plan(make_config(config_json({3, "nvme", "nvme"}, DType::F32, "/tmp/x", "",
                                        ", \"outcore\": {\"step_in_backward\": true}")),
                model);
  ASSERT_TRUE(spare.step_in_backward);
  l = {};
  l.optimizer_nvme = spare.optimizer_nvme_bytes - 1;
  try {
    check_fits(spare, l);
    ADD_FAILURE() << "accepted";
  } catch (const OutOfMemory& e) {
    EXPECT_NE(std::string(e.what()).find("outcore.step_in_backward"), std::string::npos)
        << e.what();
  }
}

// A device that cannot hold the activations of a long micro-batch is refused naming what sizes
// them, the micro-batch and the sequence length (and activation checkpointing when it is off).
// The swap trees' directories and lock files are made before the files: a drive with room for
// the files alone is refused by the plan, not by the swap space at start.
TEST(Plan, SwapRoomCountsTheTreesDirectoriesAndLockFiles) {
  const model::LlamaModel model(tiny_config(false), tiny_options(DType::F32));
  const Plan p =
      make_plan(make_config(config_json({3, "nvme", "nvme"}, DType::F32, "/tmp/x")), model);
  ASSERT_GT(p.param_nvme_tree_bytes, 0u);
  ASSERT_GT(p.optimizer_nvme_tree_bytes, 0u);
  PlanLimits l;
  l.nvme_same_filesystem = true;
  l.param_nvme = l.optimizer_nvme = p.param_nvme_bytes + p.optimizer_nvme_bytes;
  EXPECT_THROW(check_fits(p, l), OutOfMemory);
  l.param_nvme = l.optimizer_nvme =
      *l.param_nvme + p.param_nvme_tree_bytes + p.optimizer_nvme_tree_bytes;
  EXPECT_NO_THROW(check_fits(p, l));
  EXPECT_EQ(p.peak.nvme, *l.param_nvme);
}

TEST(Plan, ADeviceRefusalNamesWhatSizesTheActivations) {
  model::ModelOptions o = tiny_options(DType::F32);
  o.micro_batch = 16;
  o.seq_len = 64;
  const model::LlamaModel model(tiny_config(false), o);
  const Plan p = make_plan(make_config(config_json({3, "cpu", "cpu"}, DType::F32, "")), model);
  PlanLimits l;
  l.device = p.peak.device - 1;
  try {
    check_fits(p, l);
    FAIL() << "accepted";
  } catch (const OutOfMemory& e) {
    const std::string m = e.what();
    EXPECT_NE(m.find("outcore.device_memory_mb"), std::string::npos) << m;
    EXPECT_NE(m.find("; the largest part, activations ("), std::string::npos) << m;
    EXPECT_NE(m.find("is set by train_micro_batch_size_per_gpu and --seq-len (activation "
                     "checkpointing keeps only each unit's input: --activation-checkpointing)"),
              std::string::npos)
        << m;
  }
}

TEST(Plan, SwapPathWithoutRoomFailsAtStartWithTheBytesNeeded) {
  // A model whose optimizer state (12 bytes per parameter) is larger than the disk.
  model::LlamaConfig big = tiny_config(false);
  big.hidden_size = 8192;
  big.intermediate_size = 28672;
  big.num_attention_heads = 64;
  big.num_key_value_heads = 8;
  big.head_dim = 128;
  big.num_hidden_layers = 160;
  big.vocab_size = 128000;
  const model::LlamaModel model(big, tiny_options(DType::BF16));
  const std::string dir = swap_dir("no_room").string();
  config::Config cfg = make_config(config_json({3, "nvme", "nvme"}, DType::BF16, dir));
  // Each fetch buffer must hold the largest partition (the 1e9-element head), above the
  // default 1e8 of offload_param.buffer_size.
  for (const auto& u : model.layout().units)
    cfg.zero_optimization.offload_param.buffer_size = std::max(
        cfg.zero_optimization.offload_param.buffer_size, static_cast<int64_t>(u.padded_numel));
  device::CpuDevice dev;
  comm::LocalComm comm;
  try {
    ZeroEngine engine(cfg, model, dev, comm, 1);
    FAIL() << "a plan larger than the disk was accepted";
  } catch (const OutOfMemory& e) {
    const std::string msg = e.what();
    const Plan p = make_plan(cfg, model);
    EXPECT_NE(msg.find("nvme"), std::string::npos) << msg;
    EXPECT_NE(msg.find(dir), std::string::npos) << msg;
    EXPECT_NE(msg.find(std::to_string(p.param_nvme_bytes + p.optimizer_nvme_bytes +
                                      p.param_nvme_tree_bytes + p.optimizer_nvme_tree_bytes) +
                       " bytes"),
              std::string::npos)
        << msg;
  }
  EXPECT_EQ(dev.memory_stats().in_use_bytes, 0u);
  EXPECT_TRUE(std::filesystem::is_empty(dir));  // nothing was written
}

// A swap path on a filesystem that stores no files (/proc) is refused naming the key, not as a
// disk with 0 bytes free.
TEST(Plan, SwapPathOnAFilesystemWithoutStorageIsRefusedNamingTheKey) {
  if (!std::filesystem::is_directory("/proc/self")) GTEST_SKIP() << "no /proc";
  const model::LlamaModel model(tiny_config(true), tiny_options(DType::BF16));
  const config::Config cfg =
      make_config(config_json({3, "cpu", "nvme"}, DType::BF16, "/proc/self"));
  const Plan p = make_plan(cfg, model);
  try {
    system_limits(cfg, p);
    FAIL() << "/proc taken for a swap drive";
  } catch (const ConfigError& e) {
    EXPECT_EQ(e.json_path(), "zero_optimization.offload_optimizer.nvme_path") << e.what();
    EXPECT_NE(std::string(e.what()).find("stores no files"), std::string::npos) << e.what();
  }
}

// Each of the activation_checkpointing section's cpu_checkpointing, partition_activations and
// number_checkpoints turns activation checkpointing on (outcore's model has no call sites that
// would choose it); none of them leaves it off.
TEST(Plan, EachActivationCheckpointingKeyTurnsItOn) {
  const model::LlamaConfig model = tiny_config(false);
  auto checkpointing = [&](const std::string& section) {
    config::Config cfg =
        config::parse_config(
            R"({"train_micro_batch_size_per_gpu": 1, "activation_checkpointing": )" + section + "}",
            "ac")
            .config;
    return estimate_model_options(cfg, model, {}).activation_checkpointing;
  };
  EXPECT_FALSE(checkpointing("{}"));
  EXPECT_TRUE(checkpointing(R"({"cpu_checkpointing": true})"));
  EXPECT_TRUE(checkpointing(R"({"partition_activations": true})"));
  EXPECT_TRUE(checkpointing(R"({"number_checkpoints": 4})"));
}

// A micro-batch given to estimate replaces the config's as if the config said it: the step keeps
// its accumulation, and train_batch_size follows (it stayed the config's: 5 x 3 under 12).
TEST(Plan, AnEstimatesMicroBatchReplacesTheConfigs) {
  const model::LlamaConfig model = tiny_config(false);
  config::Config cfg =
      config::parse_config(R"({"train_batch_size": 24, "train_micro_batch_size_per_gpu": 4})", "mb")
          .config;
  const model::ModelOptions mo =
      estimate_model_options(cfg, model, {.world_size = 2, .micro_batch = 5});
  EXPECT_EQ(mo.micro_batch, 5);
  EXPECT_EQ(cfg.train_micro_batch_size_per_gpu.value(), 5);
  EXPECT_EQ(cfg.gradient_accumulation_steps.value(), 3);
  EXPECT_EQ(cfg.train_batch_size.value(), 30);
  // The same sizes written as train_batch_size and an accumulation: the same plan (it was
  // refused as 24 != 5 x 3 x 2), with a warning that train_batch_size changes.
  outcore::test::LogCapture log;
  config::Config with_gas =
      config::parse_config(R"({"train_batch_size": 24, "gradient_accumulation_steps": 3})", "mb")
          .config;
  EXPECT_EQ(
      estimate_model_options(with_gas, model, {.world_size = 2, .micro_batch = 5}).micro_batch, 5);
  EXPECT_EQ(with_gas.gradient_accumulation_steps.value(), 3);
  EXPECT_EQ(with_gas.train_batch_size.value(), 30);
  EXPECT_NE(
      log.text().find("planning train_batch_size 30 (micro-batch 5 x gradient_accumulation_steps 3 "
                      "x world size 2) in place of the config's 24"),
      std::string::npos)
      << log.text();
  // A config without a micro-batch: filled, the accumulation following from train_batch_size.
  config::Config no_micro = config::parse_config(R"({"train_batch_size": 20})", "mb").config;
  estimate_model_options(no_micro, model, {.world_size = 2, .micro_batch = 5});
  EXPECT_EQ(no_micro.gradient_accumulation_steps.value(), 2);
  // A product past int64 is refused, not wrapped.
  config::Config huge = config::parse_config(R"({"train_micro_batch_size_per_gpu": 1,
      "gradient_accumulation_steps": 4600000000000000})",
                                             "mb")
                            .config;
  EXPECT_THROW(estimate_model_options(huge, model, {.micro_batch = 4096}), InvalidArgument);
}

}  // namespace
}  // namespace outcore::zero::test
