// Out-of-core: a device budget at a tenth of the model's training state, and a small pinned
// pool, still train to the same numbers as the unlimited in-memory run.
#include <gtest/gtest.h>

#include "tests/common/log_capture.hpp"
#include "tests/zero/zero_test_util.hpp"

namespace outcore::zero::test {
namespace {

model::LlamaConfig deep_config() {
  model::LlamaConfig c = tiny_config(/*tied=*/true);
  c.hidden_size = 128;
  c.intermediate_size = 352;
  c.num_hidden_layers = 12;
  c.num_attention_heads = 8;
  c.num_key_value_heads = 4;
  c.head_dim = 16;
  c.vocab_size = 512;
  return c;
}

TEST(ZeroBudget, TenthOfStateOnDeviceTrainsLikeInMemory) {
  model::ModelOptions mo = tiny_options(DType::BF16);
  mo.activation_checkpointing = true;
  const model::LlamaModel model(deep_config(), mo);
  // Training state: 16 bytes per parameter (bf16 params and grads, fp32 master and moments).
  const uint64_t state = model.config().num_parameters() * 16;
  const uint64_t budget = state / 10;
  const std::string dir = swap_dir("budget").string();
  const std::string zero_extra =
      ", \"stage3_max_reuse_distance\": 0, \"stage3_max_live_parameters\": 400000, "
      "\"stage3_prefetch_bucket_size\": 400000, \"stage3_param_persistence_threshold\": 4096, "
      "\"sub_group_size\": 32768";
  const std::string top_extra =
      ", \"outcore\": {\"pinned_memory_mb\": 4}, \"activation_checkpointing\": "
      "{\"cpu_checkpointing\": true}";
  const config::Config cfg =
      make_config(config_json({3, "nvme", "nvme"}, DType::BF16, dir, zero_extra, top_extra,
                              ", \"buffer_count\": 3, \"pipeline_read\": true, "
                              "\"pipeline_write\": true"));
  const RunResult r = train(cfg, model, 6, budget, nvme_gradients());
  EXPECT_EQ(r.plan.placement.gradients, Tier::kNvme);
  EXPECT_LE(r.memory.device_peak_bytes, budget);
  EXPECT_EQ(r.memory.device_budget_bytes, budget);
  EXPECT_LE(r.memory.pinned_peak_bytes, r.memory.pinned_budget_bytes);
  EXPECT_LE(r.memory.pinned_budget_bytes, 4u << 20);  // the layout that fits: 2 fetch buffers
  EXPECT_EQ(r.memory.pinned_budget_bytes, r.plan.pinned_pool_bytes);
  EXPECT_LE(r.memory.device_peak_bytes, r.plan.peak.device);
  // Parameters really streamed: more NVMe reads than one copy of the parameter partitions.
  EXPECT_GT(r.traffic.nvme_read_bytes, model.config().num_parameters() * 2);

  const RunResult ref = train(make_config(config_json({0}, DType::BF16, "", "",
                                                      ", \"activation_checkpointing\": "
                                                      "{\"cpu_checkpointing\": true}")),
                              model, 6);
  EXPECT_GT(ref.memory.device_peak_bytes, 5 * budget);  // the in-memory run needs far more
  expect_bit_identical(ref, r, "budgeted stage 3 vs stage 0");
}

// A pinned limit below what the placement uses at full speed takes parameter fetch buffers
// first, keeping as many of offload_param.buffer_count as fit, and says so in the plan; the run
// keeps under the limit and trains to the same bits.
TEST(ZeroBudget, APinnedLimitKeepsAsManyFetchBuffersAsFit) {
  model::LlamaConfig c = deep_config();
  c.hidden_size = 256;
  c.vocab_size = 2048;  // the embedding's partition: 2 MiB in fp32, one fetch buffer
  c.num_hidden_layers = 3;
  const model::LlamaModel model(c, tiny_options(DType::F32));
  const std::string dir = swap_dir("pinned-fetch").string();
  auto config = [&](int64_t pinned_mb) {
    std::string json =
        config_json({3, "nvme", "nvme"}, DType::F32, dir, "",
                    ", \"outcore\": {\"pinned_memory_mb\": " + std::to_string(pinned_mb) + "}");
    const std::string in_cpu = "\"max_in_cpu\": 0";
    json.replace(json.find(in_cpu), in_cpu.size(), in_cpu + ", \"buffer_count\": 5");
    return make_config(json);
  };
  auto fetch_item = [](const Plan& plan) {
    for (const PlanItem& i : plan.items)
      if (i.what.starts_with("parameter fetch buffers")) return i;
    ADD_FAILURE() << "no fetch buffers in the plan";
    return PlanItem{};
  };
  const RunResult full = train(config(0), model, 2);
  const PlanItem all = fetch_item(full.plan);
  ASSERT_TRUE(all.what.starts_with("parameter fetch buffers (5 x ")) << all.what;
  const uint64_t slot = all.bytes / 5;
  ASSERT_GE(slot, uint64_t{1} << 20);
  // Lower limits never keep more fetch buffers (whichever layout holds more of them is taken);
  // one that keeps fewer than five says what a larger limit gives.
  uint64_t last = 5;
  int64_t between = 0;  // a limit keeping 2-4 of them
  for (int64_t mb = static_cast<int64_t>(full.plan.peak.pinned >> 20); mb >= 1; --mb) {
    const PlanItem item = fetch_item(make_plan(config(mb), model));
    const uint64_t kept = item.bytes / slot;
    EXPECT_LE(kept, last) << mb << " MiB: " << item.what;
    EXPECT_GE(kept, 1u);
    if (kept < 5) {
      EXPECT_NE(item.what.find("; 5 with more outcore.pinned_memory_mb"), std::string::npos)
          << item.what;
    }
    if (kept > 1 && kept < 5 && between == 0) between = mb;
    last = kept;
  }
  ASSERT_GT(between, 0) << "no limit keeps two to four fetch buffers";
  const RunResult fewer = train(config(between), model, 2);
  EXPECT_LE(fewer.memory.pinned_peak_bytes, uint64_t(between) << 20);
  EXPECT_LE(fewer.memory.pinned_budget_bytes, uint64_t(between) << 20);
  EXPECT_EQ(fewer.memory.pinned_budget_bytes, fewer.plan.pinned_pool_bytes);
  expect_bit_identical(full, fewer, "five fetch buffers vs those a pinned limit leaves");
  // The limit caps the pool, which is allocated and locked whole at start: a limit far above
  // the full layout's size allocates that size, not the limit.
  const Plan roomy = make_plan(config(100000), model);
  EXPECT_EQ(roomy.pinned_pool_bytes, full.plan.pinned_pool_bytes);
  EXPECT_EQ(roomy.pinned_pool_bytes, roomy.peak.pinned);
  EXPECT_EQ(fetch_item(roomy).what, all.what);
}

// A pinned limit where the placement uses no pinned buffers has no effect: said once; where the
// pool holds buffers (parameters offloaded to host memory), nothing is said.
TEST(ZeroBudget, APinnedLimitWithoutPinnedBuffersIsSaidToHaveNoEffect) {
  const model::LlamaModel model(tiny_config(false), tiny_options(DType::F32));
  auto said = [&](const Placing& placing, int64_t pinned_mb) {
    const config::Config cfg = make_config(
        config_json(placing, DType::F32, "", "",
                    ", \"outcore\": {\"pinned_memory_mb\": " + std::to_string(pinned_mb) + "}"));
    outcore::test::LogCapture log;
    device::CpuDevice dev;
    comm::LocalComm comm;
    ZeroEngine engine(cfg, model, dev, comm, 1);
    return outcore::test::LogCapture::count(log.text(), "outcore.pinned_memory_mb 1 has no effect");
  };
  EXPECT_EQ(said({0, "none", "none"}, 1), 1u);
  EXPECT_EQ(said({0, "none", "none"}, 0), 0u);  // the default: no cap
  EXPECT_EQ(said({3, "cpu", "cpu"}, 1), 0u);
}

TEST(ZeroBudget, DeviceBudgetTooSmallIsRefusedAtStartNamingTheTier) {
  const model::LlamaModel model(tiny_config(false), tiny_options(DType::F32));
  const config::Config cfg = make_config(config_json({3, "cpu", "cpu"}, DType::F32, ""));
  device::CpuDevice dev({.memory_budget_bytes = 64 << 10});
  comm::LocalComm comm;
  try {
    ZeroEngine engine(cfg, model, dev, comm, 1);
    FAIL() << "a 64 KiB device budget was accepted";
  } catch (const OutOfMemory& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("device"), std::string::npos) << msg;
    EXPECT_NE(msg.find("65536 bytes"), std::string::npos) << msg;
  }
  EXPECT_EQ(dev.memory_stats().in_use_bytes, 0u);
}

}  // namespace
}  // namespace outcore::zero::test
