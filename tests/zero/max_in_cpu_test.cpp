// offload_param.max_in_cpu and offload_param.buffer_size at stage 3 with offload_param nvme:
// the first units whose partitions fit in max_in_cpu elements live in host memory, the rest in
// swap files; training is bit-identical to stage 0 in memory whatever the split, the plan is
// what the engine allocates and moves, and a buffer_size that cannot hold the largest
// partition in a swap file is refused.
#include <gtest/gtest.h>
#include <spdlog/spdlog.h>

#include <filesystem>
#include <set>
#include <sstream>

#include "common/aligned_buffer.hpp"
#include "engine/zero/geometry.hpp"
#include "tests/common/log_capture.hpp"
#include "tests/zero/zero_test_util.hpp"

namespace outcore::zero::test {
namespace {

namespace fs = std::filesystem;
using outcore::test::LogCapture;

constexpr int kMaxInCpuSteps = 6;

// Stage 3 with `offload_optimizer` and parameters on NVMe except the first units that fit in
// `max_in_cpu` elements; `offload_param_keys` replaces config_json's `"max_in_cpu": 0` (so the
// keys go through the config parser). Every unit is fetched in every pass (no persistence, no
// reuse), so the fetch path of each home is exercised.
config::Config nvme_params_config(DType dtype, const std::string& dir,
                                  const std::string& offload_optimizer,
                                  const std::string& offload_param_keys,
                                  const std::string& extra_zero = "") {
  std::string json = config_json(
      {3, "nvme", offload_optimizer}, dtype, dir,
      ", \"stage3_param_persistence_threshold\": 0, \"stage3_max_reuse_distance\": 0" + extra_zero);
  const std::string zero_key = "\"max_in_cpu\": 0";
  const size_t at = json.find(zero_key);
  EXPECT_NE(at, std::string::npos) << json;
  if (at != std::string::npos) json.replace(at, zero_key.size(), offload_param_keys);
  return make_config(json);
}

std::string max_in_cpu(uint64_t elems) { return "\"max_in_cpu\": " + std::to_string(elems); }

// Sum of the first `units` units' partitions (world size 1: the padded slabs).
uint64_t partitions_of_first(const model::LlamaModel& model, int units) {
  uint64_t n = 0;
  for (int u = 0; u < units; ++u) n += model.layout().units[u].partition_numel(1);
  return n;
}

// The units that have a parameter swap file (<unit>.bin) under `dir`.
std::set<int> param_file_units(const std::string& dir) {
  std::set<int> units;
  const fs::path p = fs::path(dir) / "outcore_swap" / "rank0" / "param";
  if (!fs::exists(p)) return units;
  for (const auto& e : fs::directory_iterator(p))
    if (e.path().extension() == ".bin") units.insert(std::stoi(e.path().stem().string()));
  return units;
}

// Bytes of those files on disk.
uint64_t param_file_bytes(const std::string& dir) {
  uint64_t bytes = 0;
  const fs::path p = fs::path(dir) / "outcore_swap" / "rank0" / "param";
  if (!fs::exists(p)) return 0;
  for (const auto& e : fs::directory_iterator(p))
    if (e.path().extension() == ".bin") bytes += fs::file_size(e.path());
  return bytes;
}

// The split: the longest prefix of units whose partitions fit together, in unit order.
TEST(MaxInCpu, KeepsTheLongestPrefixOfUnitsThatFitsInHostMemory) {
  const model::LlamaModel model(tiny_config(false), tiny_options(DType::BF16));
  const size_t units = static_cast<size_t>(model.num_units());
  const uint64_t two = partitions_of_first(model, 2);
  struct Case {
    uint64_t max_in_cpu;
    size_t host_units;
  };
  for (const Case c : {Case{0, 0}, Case{two - 1, 1}, Case{two, 2},
                       Case{partitions_of_first(model, static_cast<int>(units)) - 1, units - 1},
                       Case{1'000'000'000, units}}) {
    SCOPED_TRACE("max_in_cpu " + std::to_string(c.max_in_cpu));
    const Plan p = make_plan(
        nvme_params_config(DType::BF16, "/tmp/x", "nvme", max_in_cpu(c.max_in_cpu)), model);
    EXPECT_EQ(p.placement.params, Tier::kNvme);
    EXPECT_EQ(p.placement.host_param_units, c.host_units);
    EXPECT_EQ(p.placement.nvme_param_units, units - c.host_units);
    EXPECT_EQ(p.placement.host_params, Tier::kPinned);
    for (size_t u = 0; u < units; ++u)
      EXPECT_EQ(p.placement.param_home(u), u < c.host_units ? Tier::kPinned : Tier::kNvme) << u;
    // Swap space and its directory only for the units in swap files.
    EXPECT_EQ(p.param_nvme_path.empty(), c.host_units == units);
    EXPECT_EQ(p.param_nvme_bytes == 0, c.host_units == units);
  }
}

// The parameters in host memory are pinned exactly when the pool is page-locked: when every
// section that offloads asks for it (the plan said pinned where the engine's pool was not).
TEST(MaxInCpu, HostParametersArePinnedWhenThePoolIsLocked) {
  const model::LlamaModel model(tiny_config(false), tiny_options(DType::BF16));
  for (const bool optimizer_pins : {true, false}) {
    SCOPED_TRACE(optimizer_pins ? "both pin" : "offload_optimizer.pin_memory false");
    const config::Config cfg = make_config(
        config_json({3, "cpu", "cpu"}, DType::BF16, "", "", "",
                    optimizer_pins ? std::string() : std::string(", \"pin_memory\": false")));
    EXPECT_EQ(detail::pool_page_locked(cfg.zero_optimization), optimizer_pins);
    const Plan p = make_plan(cfg, model);
    const Tier want = optimizer_pins ? Tier::kPinned : Tier::kHost;
    EXPECT_EQ(p.placement.params, want);
    // And the prefix max_in_cpu keeps in host memory beside swap files.
    const config::Config nvme = make_config(
        config_json({3, "nvme", "cpu"}, DType::BF16, "/tmp/x", "", "",
                    optimizer_pins ? std::string() : std::string(", \"pin_memory\": false")));
    EXPECT_EQ(make_plan(nvme, model).placement.host_params, want);
  }
}

// About half the units in host memory, pinned or not, trains bit-identically to stage 0 in
// memory, as do all of them (DeepSpeed's default on a tiny model) and none.
TEST(MaxInCpu, MixedPlacementTrainsBitIdenticallyToStage0) {
  for (const bool tied : {false, true}) {
    for (const DType dtype : {DType::F32, DType::BF16}) {
      const model::LlamaModel model(tiny_config(tied), tiny_options(dtype));
      const std::string tag = std::string(dtype_name(dtype)) + (tied ? "_tied" : "_untied");
      const RunResult ref = train(make_config(config_json({0}, dtype, "")), model, kMaxInCpuSteps);
      const size_t units = static_cast<size_t>(model.num_units());
      const std::string half = max_in_cpu(partitions_of_first(model, 2));
      struct Setup {
        std::string name, optimizer, keys;
        size_t host_units;
        Tier host;
        bool nvme_gradients = false;
      };
      const std::vector<Setup> setups = {
          {"half_pinned", "nvme", half, 2, Tier::kPinned},
          {"half_not_pinned", "cpu", half + ", \"pin_memory\": false", 2, Tier::kHost},
          {"half_nvme_grads", "nvme", half, 2, Tier::kPinned, true},
          {"all_in_host", "nvme", max_in_cpu(1'000'000'000), units, Tier::kPinned},
          {"none_in_host", "nvme", max_in_cpu(0), 0, Tier::kPinned},
      };
      for (const Setup& s : setups) {
        SCOPED_TRACE(tag + " " + s.name);
        const std::string dir = swap_dir("max_in_cpu_" + tag + "_" + s.name).string();
        const RunResult r =
            train(nvme_params_config(dtype, dir, s.optimizer, s.keys), model, kMaxInCpuSteps, 0,
                  s.nvme_gradients ? nvme_gradients() : EngineOptions{});
        EXPECT_EQ(r.plan.placement.host_param_units, s.host_units);
        EXPECT_EQ(r.plan.placement.nvme_param_units, units - s.host_units);
        EXPECT_EQ(r.plan.placement.host_params, s.host);
        if (s.nvme_gradients) {
          EXPECT_EQ(r.plan.placement.gradients, Tier::kNvme);
        }
        expect_bit_identical(ref, r, s.name);
        // Parameters in swap files were read (fetches) and written (publications).
        if (s.host_units < units && s.optimizer == "cpu") {
          EXPECT_GT(r.traffic.nvme_read_bytes, 0u);
          EXPECT_GT(r.traffic.nvme_write_bytes, 0u);
        }
      }
    }
  }
}

// Checkpoint access with a mixed placement: each unit's low-precision partition is read from
// its own home (read_param_partition, get_params) and new state is published to it
// (write_unit_state), matching stage 0 in memory bit for bit.
TEST(MaxInCpu, StateAccessReadsAndWritesEachUnitInItsHome) {
  const model::LlamaModel model(tiny_config(false), tiny_options(DType::BF16));
  const std::string dir = swap_dir("max_in_cpu_state").string();
  const config::Config mixed_cfg =
      nvme_params_config(DType::BF16, dir, "nvme", max_in_cpu(partitions_of_first(model, 2)), "");
  const config::Config ref_cfg = make_config(config_json({0}, DType::BF16, ""));
  device::CpuDevice dev_a, dev_b;
  comm::LocalComm comm_a, comm_b;
  ZeroEngine mixed(mixed_cfg, model, dev_a, comm_a, 5);
  ZeroEngine ref(ref_cfg, model, dev_b, comm_b, 5);
  ASSERT_EQ(mixed.plan().placement.host_param_units, 2u);
  const size_t n = static_cast<size_t>(model.tokens());
  for (int t = 1; t <= 2; ++t) {
    for (ZeroEngine* e : {&mixed, &ref}) {
      for (int k = 0; k < 2; ++k) {
        std::vector<int32_t> tok = make_tokens(n + 1, model.config().vocab_size, t * 10 + k, n + 1);
        e->forward_backward(tok.data(), tok.data() + 1, 0.5f, k == 0);
      }
      e->step(step_params(ref_cfg, 1e-3, t, 1.0));
    }
  }
  auto expect_same_params = [&](const std::string& when) {
    for (int u = 0; u < model.num_units(); ++u) {
      const size_t bytes = model.layout().units[u].padded_numel * sizeof(uint16_t);
      std::vector<std::byte> want(bytes), full(bytes), part(bytes);
      ref.get_params(u, want);
      mixed.get_params(u, full);
      mixed.read_param_partition(u, part);  // world size 1: the partition is the slab
      EXPECT_EQ(full, want) << when << ": get_params of unit " << u;
      EXPECT_EQ(part, want) << when << ": read_param_partition of unit " << u;
    }
  };
  expect_same_params("after training");
  // Halve every master weight (as a checkpoint load would write new state) in both engines.
  for (int u = 0; u < model.num_units(); ++u) {
    const size_t own = ref.partition_numel(u);
    std::vector<float> m(own), a(own), v(own);
    ref.read_unit_state(u, m, a, v);
    for (float& x : m) x *= 0.5f;
    ref.write_unit_state(u, m, a, v);
    mixed.write_unit_state(u, m, a, v);
  }
  expect_same_params("after write_unit_state");
}

// measure() plus the parameter swap files that existed while the engine lived.
struct FileMeasured : Measured {
  std::set<int> param_files;  // units with a parameter swap file
  uint64_t param_file_bytes = 0;
};

FileMeasured measure_with_files(const config::Config& cfg, const model::LlamaModel& model,
                                const std::string& dir, int steps) {
  FileMeasured m;
  static_cast<Measured&>(m) = measure(cfg, model, steps, {}, [&] {
    m.param_files = param_file_units(dir);
    m.param_file_bytes = param_file_bytes(dir);
  });
  return m;
}

// The plan of a mixed placement is what the engine allocates and moves: pinned bytes (the
// host-homed partitions, fetch buffers and write-back slots sized to the largest partition in a
// swap file), swap files for the NVMe-homed units only, and per-step traffic, also when
// stage3_max_live_parameters forces refetches and when fetches share one fetch buffer. Splits:
// about half the units in host memory, and all but the head (whose partition is the smallest).
TEST(MaxInCpu, PlanEqualsWhatTheEngineAllocatesAndMoves) {
  struct Limits {
    std::string name, zero;
  };
  const std::vector<Limits> limits = {
      {"defaults", ""},
      {"max_live", ", \"stage3_max_live_parameters\": 50000"},
      {"one_fetch_buffer", ""},  // offload_param.buffer_count 1: prefetches wait for it
  };
  for (const bool tied : {false, true}) {
    const model::LlamaModel model(tiny_config(tied), tiny_options(DType::BF16));
    const size_t units = static_cast<size_t>(model.num_units());
    for (const size_t host : {size_t{2}, units - 1})
      for (const Limits& l : limits)
        for (const bool pin : {true, false}) {
          SCOPED_TRACE(std::to_string(host) + " units in host memory, " + l.name +
                       (tied ? " tied" : " untied") + (pin ? " pinned" : " not pinned"));
          const std::string dir = swap_dir("max_in_cpu_plan").string();
          std::string keys = max_in_cpu(partitions_of_first(model, static_cast<int>(host)));
          if (!pin) keys += ", \"pin_memory\": false";
          if (l.name == "one_fetch_buffer") keys += ", \"buffer_count\": 1";
          // Optimizer state in host memory: the pinned pool holds only parameter buffers, so
          // its peak is exactly the planned pinned bytes.
          const config::Config cfg = nvme_params_config(DType::BF16, dir, "cpu", keys, l.zero);
          const int steps = 2;
          const FileMeasured m = measure_with_files(cfg, model, dir, steps);
          const Plan& p = m.plan;
          ASSERT_EQ(p.placement.host_param_units, host);
          EXPECT_EQ(m.memory.pinned_peak_bytes, p.peak.pinned) << format_plan(p);
          EXPECT_LE(m.memory.device_peak_bytes, p.peak.device) << format_plan(p);
          expect_traffic_as_planned(m, steps);

          // Swap files exactly for the units past `host`, of the planned size.
          std::set<int> want;
          for (size_t u = host; u < units; ++u) want.insert(static_cast<int>(u));
          EXPECT_EQ(m.param_files, want);
          EXPECT_EQ(m.param_file_bytes, p.param_nvme_bytes);

          // Per tier, the host-homed partitions: pinned or host, 4 KiB-aligned each.
          uint64_t host_bytes = 0, nvme_part = 0;
          const uint64_t elem = sizeof(uint16_t);
          for (size_t u = 0; u < units; ++u) {
            const uint64_t part = model.layout().units[u].partition_numel(1);
            if (u < host)
              host_bytes += align_up(part * elem, kIoAlignment);
            else
              nvme_part = std::max(nvme_part, part);
          }
          auto item = [&](Tier t, const std::string& what) -> uint64_t {
            for (const PlanItem& it : p.items)
              if (it.tier == t && it.what.find(what) != std::string::npos) return it.bytes;
            return 0;
          };
          const std::string host_item =
              "parameter partitions of units 0.." + std::to_string(host - 1);
          EXPECT_EQ(item(pin ? Tier::kPinned : Tier::kHost, host_item), host_bytes)
              << format_plan(p);
          EXPECT_EQ(item(pin ? Tier::kHost : Tier::kPinned, "parameter partitions"), 0u)
              << format_plan(p);
          const uint64_t buffers = l.name == "one_fetch_buffer" ? 1 : 5;
          const uint64_t slot = align_up(nvme_part * elem, kIoAlignment);
          EXPECT_EQ(item(Tier::kPinned, "parameter fetch buffers"), buffers * slot)
              << format_plan(p);
          EXPECT_EQ(item(Tier::kPinned, "parameter write-back buffers"), 2 * slot)
              << format_plan(p);
        }
  }
}

// A mixed placement with optimizer state and gradients in swap files too: traffic is exact.
TEST(MaxInCpu, MixedPlacementWithNvmeOptimizerMovesWhatThePlanSays) {
  const model::LlamaModel model(tiny_config(true), tiny_options(DType::F32));
  const std::string dir = swap_dir("max_in_cpu_nvme_opt").string();
  const config::Config cfg =
      nvme_params_config(DType::F32, dir, "nvme", max_in_cpu(partitions_of_first(model, 3)),
                         ", \"sub_group_size\": 8192");
  const int steps = 2;
  const FileMeasured m = measure_with_files(cfg, model, dir, steps);
  ASSERT_EQ(m.plan.placement.host_param_units, 3u);
  EXPECT_LE(m.memory.pinned_peak_bytes, m.plan.peak.pinned);
  EXPECT_EQ(m.param_files.size(), static_cast<size_t>(model.num_units()) - 3);
  expect_traffic_as_planned(m, steps);
}

// max_in_cpu 0: every partition in a swap file, as before max_in_cpu was honoured: no
// parameter partition in host memory, one swap file per unit, fetch buffers of the largest
// partition.
TEST(MaxInCpu, ZeroPutsEveryPartitionInASwapFile) {
  const model::LlamaModel model(tiny_config(false), tiny_options(DType::BF16));
  const size_t units = static_cast<size_t>(model.num_units());
  const std::string dir = swap_dir("max_in_cpu_zero").string();
  const config::Config cfg = nvme_params_config(DType::BF16, dir, "cpu", max_in_cpu(0));
  const FileMeasured m = measure_with_files(cfg, model, dir, 1);
  const Plan& p = m.plan;
  EXPECT_EQ(p.placement.host_param_units, 0u);
  EXPECT_EQ(p.placement.nvme_param_units, units);
  EXPECT_EQ(m.param_files.size(), units);
  EXPECT_EQ(m.param_file_bytes, p.param_nvme_bytes);
  for (const PlanItem& it : p.items) {
    if (it.what.find("parameter partitions") != std::string::npos) {
      EXPECT_EQ(it.tier, Tier::kNvme) << it.what;
    }
  }
  EXPECT_EQ(m.memory.pinned_peak_bytes, p.peak.pinned);
  expect_traffic_as_planned(m, 1);
  // Every fetch reads its swap file: the whole model once per micro-batch at least.
  EXPECT_GE(p.per_step.nvme_read,
            bf16_param_bytes(model) * static_cast<uint64_t>(p.micro_batches_per_step));
}

TEST(MaxInCpu, FormatSaysHowManyUnitsAreInHostMemoryAndInSwapFiles) {
  const model::LlamaModel model(tiny_config(false), tiny_options(DType::BF16));
  const std::string half = max_in_cpu(partitions_of_first(model, 2));
  std::string text =
      format_plan(make_plan(nvme_params_config(DType::BF16, "/tmp/x", "nvme", half), model));
  EXPECT_NE(text.find("parameters nvme (2 units in pinned host memory by "
                      "offload_param.max_in_cpu, 3 in swap files)"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("parameter partitions of units 2..4 (swap files)"), std::string::npos)
      << text;
  text = format_plan(make_plan(
      nvme_params_config(DType::BF16, "/tmp/x", "nvme", half + ", \"pin_memory\": false"), model));
  EXPECT_NE(text.find("(2 units in host memory by offload_param.max_in_cpu, 3 in swap files)"),
            std::string::npos)
      << text;
}

// DeepSpeed requires each parameter swap buffer to hold the largest partition: a smaller
// buffer_size is refused at plan time (estimate and train), naming the key, the value and the
// partition's size. Only partitions in swap files count.
TEST(BufferSize, SmallerThanTheLargestPartitionInASwapFileIsRefused) {
  const model::LlamaModel model(tiny_config(true), tiny_options(DType::BF16));
  const size_t units = static_cast<size_t>(model.num_units());
  // DeepSpeed's contract: a buffer holds the largest tensor's partition (not a unit's).
  auto largest_tensor = [](const model::UnitLayout& u) {
    uint64_t n = 0;
    for (const model::TensorSpec& t : u.tensors) n = std::max<uint64_t>(n, t.numel);
    return n;
  };
  uint64_t largest = 0;
  for (const auto& u : model.layout().units) largest = std::max(largest, largest_tensor(u));
  ASSERT_LT(largest, model.layout().units[1].partition_numel(1));  // less than a layer's slab
  const std::string dir = swap_dir("buffer_size").string();
  auto cfg_with = [&](uint64_t buffer_size, uint64_t in_cpu) {
    return nvme_params_config(
        DType::BF16, dir, "nvme",
        max_in_cpu(in_cpu) + ", \"buffer_size\": " + std::to_string(buffer_size));
  };
  const config::Config small = cfg_with(largest - 1, 0);
  try {
    make_plan(small, model);
    FAIL() << "buffer_size " << largest - 1 << " was accepted";
  } catch (const ConfigError& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find("zero_optimization.offload_param.buffer_size"), std::string::npos) << msg;
    EXPECT_NE(msg.find(std::to_string(largest - 1)), std::string::npos) << msg;
    EXPECT_NE(msg.find(std::to_string(largest) + " elements"), std::string::npos) << msg;
  }
  {
    device::CpuDevice dev;
    comm::LocalComm comm;
    EXPECT_THROW(ZeroEngine(small, model, dev, comm, 1), ConfigError);
    EXPECT_EQ(dev.memory_stats().in_use_bytes, 0u);
    EXPECT_TRUE(fs::is_empty(dir));  // refused before any swap file was made
  }
  EXPECT_NO_THROW(make_plan(cfg_with(largest, 0), model));
  // Tied: the head unit holds only the final norm. With every other unit in host memory, only
  // its partition has to fit.
  const uint64_t head = largest_tensor(model.layout().units[units - 1]);
  ASSERT_LT(head, largest);
  const uint64_t all_but_head = partitions_of_first(model, static_cast<int>(units) - 1);
  EXPECT_NO_THROW(make_plan(cfg_with(head, all_but_head), model));
  EXPECT_THROW(make_plan(cfg_with(head - 1, all_but_head), model), ConfigError);
  // Every partition in host memory: nothing to hold.
  EXPECT_NO_THROW(make_plan(cfg_with(1, 1'000'000'000), model));
}

// A buffer_size above the largest partition allocates nothing more: the pinned bytes do not
// change, and the engine says once that the value has no further effect.
TEST(BufferSize, LargerValueAllocatesNothingMoreAndIsWarnedAboutOnce) {
  const model::LlamaModel model(tiny_config(false), tiny_options(DType::BF16));
  const std::string dir = swap_dir("buffer_size_large").string();
  const config::Config def = nvme_params_config(DType::BF16, dir, "nvme", max_in_cpu(0));
  const config::Config big =
      nvme_params_config(DType::BF16, dir, "nvme", max_in_cpu(0) + ", \"buffer_size\": 1e9");
  EXPECT_EQ(make_plan(big, model).peak.pinned, make_plan(def, model).peak.pinned);
  LogCapture log;
  {
    device::CpuDevice dev;
    comm::LocalComm comm;
    ZeroEngine engine(big, model, dev, comm, 1);
  }
  EXPECT_EQ(LogCapture::count(log.text(), "offload_param.buffer_size 1000000000 has no effect"), 1u)
      << log.text();
  LogCapture quiet;
  {
    device::CpuDevice dev;
    comm::LocalComm comm;
    ZeroEngine engine(def, model, dev, comm, 1);
  }
  EXPECT_EQ(LogCapture::count(quiet.text(), "buffer_size"), 0u) << quiet.text();
}

// offload_optimizer.pipeline_read reads a unit's next sub-group ahead: with one buffer, or one
// sub-group per unit, it does nothing, and the engine says so once, naming why; where some unit
// has two sub-groups and two buffers, nothing is said. pipeline_write is never said to do
// nothing (it leaves the initialisation's writes in flight).
TEST(OptimizerPipelining, ReadAheadWithoutTwoSubGroupsAndTwoBuffersIsSaidToHaveNoEffect) {
  const model::LlamaModel model(tiny_config(false), tiny_options(DType::BF16));
  const std::string dir = swap_dir("pipelining").string();
  auto said = [&](const std::string& zero_extra, const std::string& optimizer_extra) {
    const config::Config cfg = make_config(
        config_json(Placing{3, "none", "nvme"}, DType::BF16, dir, zero_extra, "", optimizer_extra));
    LogCapture log;
    {
      device::CpuDevice dev;
      comm::LocalComm comm;
      ZeroEngine engine(cfg, model, dev, comm, 1);
    }
    return log.text();
  };
  const std::string one_buffer =
      said(", \"sub_group_size\": 1000", ", \"pipeline_read\": true, \"buffer_count\": 1");
  EXPECT_EQ(LogCapture::count(one_buffer, "offload_optimizer.pipeline_read has no effect"), 1u)
      << one_buffer;
  EXPECT_EQ(LogCapture::count(one_buffer, "buffer_count is 1"), 1u) << one_buffer;
  const std::string one_group = said("", R"(, "pipeline_read": true, "pipeline_write": true)");
  EXPECT_EQ(LogCapture::count(one_group, "offload_optimizer.pipeline_read has no effect"), 1u)
      << one_group;
  EXPECT_EQ(LogCapture::count(one_group, "pipeline_write"), 0u) << one_group;
  EXPECT_EQ(LogCapture::count(one_group, "sub_group_size 1000000000 is not below"), 1u)
      << one_group;
  const std::string acts =
      said(", \"sub_group_size\": 1000", ", \"pipeline_read\": true, \"buffer_count\": 2");
  EXPECT_EQ(LogCapture::count(acts, "pipeline"), 0u) << acts;
  // A ratio whose share is below the first unit offloads nothing: said, once, and the
  // read-ahead (with nothing in swap files) is not said to do nothing on top of it.
  const std::string none = said(", \"sub_group_size\": 1000",
                                ", \"pipeline_read\": true, \"buffer_count\": 1, \"ratio\": 0.001");
  EXPECT_EQ(LogCapture::count(none, "ratio 0.001 offloads no unit's optimizer state"), 1u) << none;
  EXPECT_EQ(LogCapture::count(none, "pipeline_read"), 0u) << none;
  EXPECT_EQ(LogCapture::count(said("", R"(, "ratio": 0.9)"), "offloads no unit"), 0u);
}

}  // namespace
}  // namespace outcore::zero::test
