// Every stage and every placement trains bit-identically to stage 0 in memory: per-step losses,
// gradient norms and overflow verdicts, the evaluation loss, and after 20 steps every unit's
// fp32 master weights, both Adam moments and low-precision parameters; in fp32, bf16 and fp16
// (fp16 with one step skipped for overflow). Stage-3 runs stream for real: no unit is
// persistent and the device budget holds only the largest step's gathered slabs, so every
// unit is fetched on every pass and units are evicted between their forward and backward.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "engine/device/compute_backend.hpp"
#include "tests/zero/zero_test_util.hpp"

namespace outcore::zero::test {
namespace {

constexpr int kSteps = 20;
constexpr double kFp16Scale = 1024;  // static loss scale of the fp16 runs
constexpr int kOverflowStep = 7;     // fp16: one micro-batch of this step overflows

struct Case {
  DType dtype;
  bool tied;
};

// What one run produced.
struct Trace {
  std::vector<float> losses;
  std::vector<double> norms;
  std::vector<bool> overflow;
  float eval_loss = 0;
  std::vector<std::vector<float>> master, exp_avg, exp_avg_sq;  // per unit, owned partition
  std::vector<std::vector<std::byte>> params;                   // per unit, full slab
  std::vector<uint64_t> pass_allocations;  // device allocations made by each forward_backward
  TrafficStats traffic;
  Tier gradients = Tier::kDevice;      // where the plan put the gradient accumulators
  std::vector<bool> device_grad_sums;  // Plan::device_grad_sums
  uint64_t plan_d2h = 0;               // Plan::per_step.d2h
};

// Inputs and next-token targets of one micro-batch, generated from `seed`.
struct Batch {
  std::vector<int32_t> in, tgt;
};

Batch make_batch(const model::LlamaModel& model, uint64_t seed) {
  const size_t T = static_cast<size_t>(model.options().seq_len);
  const size_t B = static_cast<size_t>(model.tokens()) / T;
  const std::vector<int32_t> tok = make_tokens(B * (T + 1), model.config().vocab_size, seed, T + 1);
  Batch b;
  for (size_t i = 0; i < B; ++i) {
    b.in.insert(b.in.end(), tok.begin() + i * (T + 1), tok.begin() + i * (T + 1) + T);
    b.tgt.insert(b.tgt.end(), tok.begin() + i * (T + 1) + 1, tok.begin() + (i + 1) * (T + 1));
  }
  return b;
}

// kSteps optimizer steps of gradient_accumulation_steps micro-batches on a device of
// `device_budget` bytes (0 = unlimited; the trainer's budget is outcore.device_memory_mb). fp16
// runs use kFp16Scale, except that the last micro-batch of kOverflowStep is scaled by infinity
// (what the trainer passes once a dynamic scale has grown past fp32, e.g. 2^200 in
// trainer_test), so the accumulated gradients overflow and the step is skipped; the Adam step
// number counts applied steps only.
// On `dev` (the model's backend must be its, see device::make_backend).
Trace run_on(device::Device& dev, const config::Config& cfg, const model::LlamaModel& model,
             EngineOptions eo = {}) {
  comm::LocalComm comm;
  Trace r;
  ZeroEngine engine(cfg, model, dev, comm, /*seed=*/7, eo);
  r.gradients = engine.plan().placement.gradients;
  r.device_grad_sums = engine.plan().device_grad_sums;
  r.plan_d2h = engine.plan().per_step.d2h;
  const bool fp16 = model.options().param_dtype == DType::F16;
  const double scale = fp16 ? kFp16Scale : 1.0;
  const int64_t gas = cfg.gradient_accumulation_steps.value();
  uint64_t applied = 0;
  for (int t = 1; t <= kSteps; ++t) {
    float loss = 0;
    for (int64_t k = 0; k < gas; ++k) {
      const Batch b = make_batch(model, static_cast<uint64_t>(t * 100 + k));
      const bool overflow = fp16 && t == kOverflowStep && k == gas - 1;
      const float micro_scale = overflow ? std::numeric_limits<float>::infinity()
                                         : static_cast<float>(scale / static_cast<double>(gas));
      const uint64_t allocs = dev.memory_stats().total_allocations;
      loss += engine.forward_backward(b.in.data(), b.tgt.data(), micro_scale, k == 0);
      r.pass_allocations.push_back(dev.memory_stats().total_allocations - allocs);
    }
    r.losses.push_back(loss);
    const StepResult s = engine.step(step_params(cfg, 0.003, applied + 1, scale));
    if (!s.overflow) ++applied;
    r.overflow.push_back(s.overflow);
    r.norms.push_back(s.grad_norm);
  }
  const size_t n = static_cast<size_t>(model.tokens());
  const std::vector<int32_t> tok = make_tokens(n + 1, model.config().vocab_size, 99, n + 1);
  r.eval_loss = engine.evaluate(tok.data(), tok.data() + 1);
  for (int u = 0; u < model.num_units(); ++u) {
    const size_t own = engine.partition_numel(u);
    r.master.emplace_back(own);
    r.exp_avg.emplace_back(own);
    r.exp_avg_sq.emplace_back(own);
    engine.read_unit_state(u, r.master.back(), r.exp_avg.back(), r.exp_avg_sq.back());
    r.params.emplace_back(model.layout().units[u].padded_numel *
                          dtype_size(model.options().param_dtype));
    engine.get_params(u, r.params.back());
  }
  r.traffic = engine.traffic();
  return r;
}

Trace run(const config::Config& cfg, const model::LlamaModel& model, uint64_t device_budget,
          EngineOptions eo = {}) {
  device::CpuDevice dev({.memory_budget_bytes = device_budget});
  return run_on(dev, cfg, model, eo);
}

bool same_bits(float a, float b) { return std::memcmp(&a, &b, sizeof a) == 0; }
bool same_norm(double a, double b) { return (std::isnan(a) && std::isnan(b)) || a == b; }

void expect_same_arrays(const std::vector<std::vector<float>>& a,
                        const std::vector<std::vector<float>>& b, const std::string& what) {
  ASSERT_EQ(a.size(), b.size()) << what;
  for (size_t u = 0; u < a.size(); ++u) {
    ASSERT_EQ(a[u].size(), b[u].size()) << what << " of unit " << u;
    EXPECT_EQ(std::memcmp(a[u].data(), b[u].data(), a[u].size() * sizeof(float)), 0)
        << what << " of unit " << u;
  }
}

void expect_bit_identical(const Trace& a, const Trace& b) {
  ASSERT_EQ(a.losses.size(), b.losses.size());
  for (size_t i = 0; i < a.losses.size(); ++i) {
    EXPECT_TRUE(same_bits(a.losses[i], b.losses[i]))
        << "loss of step " << i + 1 << ": " << a.losses[i] << " vs " << b.losses[i];
    EXPECT_TRUE(same_norm(a.norms[i], b.norms[i]))
        << "grad norm of step " << i + 1 << ": " << a.norms[i] << " vs " << b.norms[i];
    EXPECT_EQ(a.overflow[i], b.overflow[i]) << "overflow verdict of step " << i + 1;
  }
  EXPECT_TRUE(same_bits(a.eval_loss, b.eval_loss))
      << "evaluation loss " << a.eval_loss << " vs " << b.eval_loss;
  expect_same_arrays(a.master, b.master, "master weights");
  expect_same_arrays(a.exp_avg, b.exp_avg, "exp_avg");
  expect_same_arrays(a.exp_avg_sq, b.exp_avg_sq, "exp_avg_sq");
  ASSERT_EQ(a.params.size(), b.params.size());
  for (size_t u = 0; u < a.params.size(); ++u)
    EXPECT_EQ(a.params[u], b.params[u]) << "parameters of unit " << u;
}

// A device budget for stage 3 that holds everything the plan keeps on the device except the
// gathered slabs, and of those only what the largest pass step needs at once (the planner's
// live budget falls to that when the device limit is below it). It is below what keeping every
// slab would need, so the coordinator must evict.
uint64_t streaming_budget(const config::Config& cfg, const model::LlamaModel& model) {
  const Plan roomy = make_plan(cfg, model);
  const Plan tight = make_plan(cfg, model, {.device_limit_bytes = 1});
  EXPECT_LT(tight.device_live_param_bytes, roomy.device_live_param_bytes);
  return roomy.peak.device - roomy.device_live_param_bytes + tight.device_live_param_bytes;
}

// Evidence that a stage-3 run streamed (under a budget below all slabs, streaming_budget), each
// part failing if slabs stayed resident:
// - every pass fetched every unit, and every decoder a second time for its backward (evicted
//   after its forward). A fetch is the only device allocation stage 3 adds to a pass, so what
//   a pass allocates beyond the stage-0 reference (its gradient slabs) counts fetches; this
//   also covers partitions homed on the device, whose fetches are device-to-device copies;
// - partitions off the device: at least one slab per unit and micro-batch crossed host ->
//   device (from the pinned fetch buffer an NVMe read filled, when they live on NVMe; NVMe
//   read bytes prove nothing here, the optimizer state's reads alone exceed that).
void expect_streamed(const Trace& r, const Trace& ref, const model::LlamaModel& model,
                     const Placing& s) {
  const uint64_t units = static_cast<uint64_t>(model.num_units());
  const uint64_t decoders = static_cast<uint64_t>(model.config().num_hidden_layers);
  ASSERT_EQ(r.pass_allocations.size(), ref.pass_allocations.size());
  const size_t gas = r.pass_allocations.size() / kSteps;
  for (size_t i = 0; i < r.pass_allocations.size(); ++i) {
    ASSERT_GE(r.pass_allocations[i], ref.pass_allocations[i]) << "pass " << i;
    const uint64_t fetches = r.pass_allocations[i] - ref.pass_allocations[i];
    if (fetches < units + decoders) {
      ADD_FAILURE() << "pass " << i << " (micro-batch " << i % gas << " of step " << i / gas + 1
                    << ") fetched " << fetches << " slabs; " << units << " units and " << decoders
                    << " decoders need at least " << units + decoders
                    << ": some stayed resident (first such pass shown)";
      break;
    }
  }
  if (s.offload_param == "none") return;
  uint64_t slab_bytes = 0;
  for (const model::UnitLayout& u : model.layout().units)
    slab_bytes += u.padded_numel * dtype_size(model.options().param_dtype);
  const uint64_t passes = r.pass_allocations.size();
  EXPECT_GE(r.traffic.h2d_bytes, passes * slab_bytes)
      << "host -> device bytes over " << passes << " passes of " << units << " units";
}

class Equivalence : public ::testing::TestWithParam<Case> {};

TEST_P(Equivalence, EveryPlacementMatchesStage0InMemory) {
  const Case c = GetParam();
  const model::LlamaModel model(tiny_config(c.tied), tiny_options(c.dtype));
  const std::string tag = std::string(dtype_name(c.dtype)) + (c.tied ? "_tied" : "_untied");
  // The static scale in the config is kFp16Scale; run() passes it to the engine itself.
  const std::string fp16 =
      c.dtype == DType::F16 ? ", \"fp16\": {\"enabled\": true, \"loss_scale\": 1024}" : "";
  auto config = [&](const Placing& s, const std::string& dir) {
    const std::string zero = s.stage == 3 ? ", \"stage3_param_persistence_threshold\": 0" : "";
    return make_config(config_json(s, c.dtype, dir, zero, fp16));
  };
  const Trace ref = run(config({0}, ""), model, 0);
  // The baseline itself trains: finite, falling loss; fp16 skips exactly the forced step.
  ASSERT_TRUE(std::isfinite(ref.losses.back()));
  EXPECT_LT(ref.losses.back(), ref.losses.front());
  for (int t = 1; t <= kSteps; ++t) {
    EXPECT_EQ(ref.overflow[t - 1], c.dtype == DType::F16 && t == kOverflowStep) << "step " << t;
    if (!ref.overflow[t - 1]) {
      EXPECT_TRUE(std::isfinite(ref.norms[t - 1])) << "step " << t;
    }
  }

  struct Setup {
    Placing placing;
    bool nvme_gradients = false;
  };
  const std::vector<Setup> setups = {
      {{1, "none", "none"}},
      {{2, "none", "none"}},
      {{3, "none", "none"}},
      {{1, "none", "cpu"}},
      {{2, "none", "cpu"}},
      {{3, "cpu", "cpu"}},
      {{3, "nvme", "nvme"}},
      {{3, "none", "nvme"}},
      {{2, "none", "nvme"}},  // kept in host memory below stage 3
      // Gradient accumulators in swap files too.
      {{3, "nvme", "nvme"}, true},
      {{3, "cpu", "nvme"}, true},
  };
  for (const Setup& setup : setups) {
    const Placing& s = setup.placing;
    const std::string name = s.name() + (setup.nvme_gradients ? "_nvme_grads" : "");
    SCOPED_TRACE(name);
    const config::Config cfg = config(s, swap_dir(tag + "_" + name).string());
    const uint64_t budget = s.stage == 3 ? streaming_budget(cfg, model) : 0;
    const Trace r =
        run(cfg, model, budget, setup.nvme_gradients ? nvme_gradients() : EngineOptions{});
    expect_bit_identical(ref, r);
    if (s.stage == 3) expect_streamed(r, ref, model, s);
    if (setup.nvme_gradients) {
      EXPECT_EQ(r.gradients, Tier::kNvme);
    }
    if (s.stage == 3 && (s.offload_param == "nvme" || s.offload_optimizer == "nvme")) {
      EXPECT_GT(r.traffic.nvme_write_bytes, 0u);
    }
  }
  // On a device the host cannot read with the optimizer state there: the gradients stay on the
  // device, normed there (decision 037), and the overflow step is skipped alike.
  for (const Placing& s : {Placing{0}, Placing{2, "none", "none"}}) {
    SCOPED_TRACE("discrete device, " + s.name());
    device::CpuDevice dev({.discrete = true});
    const model::LlamaModel on_dev(tiny_config(c.tied), tiny_options(c.dtype),
                                   device::make_backend(dev));
    const Trace r =
        run_on(dev, config(s, swap_dir(tag + "_discrete_" + s.name()).string()), on_dev);
    expect_bit_identical(ref, r);
    EXPECT_EQ(r.device_grad_sums, std::vector<bool>(model.num_units(), true));
    uint64_t blocks = 0;  // only the norm's block sums come down
    for (const model::UnitLayout& u : model.layout().units)
      blocks += u.partition_numel(1) / model::kPartitionAlignElems;
    EXPECT_EQ(r.plan_d2h, blocks * sizeof(double));
  }
}

INSTANTIATE_TEST_SUITE_P(Zero, Equivalence,
                         ::testing::Values(Case{DType::F32, false}, Case{DType::BF16, true},
                                           Case{DType::BF16, false}, Case{DType::F16, true}),
                         [](const auto& info) {
                           return std::string(dtype_name(info.param.dtype)) +
                                  (info.param.tied ? "_tied" : "_untied");
                         });

// Adam moments in bf16 (optimizer.params.fp32_optimizer_states: false, or DeepSpeed's
// bf16.bf16_optimizer_states: true): every tier trains bit-identically to stage 0 in memory,
// through either key; the moments read back are bf16 values (not those of an fp32-moment
// run); and with the state in swap files the NVMe bytes are 8 per element instead of 12.
std::string with_bf16_moments_as(std::string json, bool deepspeed_bf16_key) {
  const std::string key =
      deepspeed_bf16_key ? "\"bf16\": {\"enabled\": true" : "\"weight_decay\": 0.01";
  const std::string add =
      deepspeed_bf16_key
          ? ", \"bf16_master_weights_and_grads\": true, \"bf16_optimizer_states\": true"
          : ", \"fp32_optimizer_states\": false";
  const size_t at = json.find(key);
  EXPECT_NE(at, std::string::npos) << json;
  return json.insert(at + key.size(), add);
}

TEST(Bf16Moments, EveryTierMatchesBitwiseAndMovesTwoThirdsOfTheBytes) {
  const model::LlamaModel model(tiny_config(true), tiny_options(DType::BF16));
  auto config = [&](const Placing& s, const std::string& dir, bool bf16, bool ds_key) {
    const std::string zero = s.stage == 3 ? ", \"stage3_param_persistence_threshold\": 0" : "";
    const std::string json = config_json(s, DType::BF16, dir, zero);
    return make_config(bf16 ? with_bf16_moments_as(json, ds_key) : json);
  };
  const config::Config ref_cfg = config({0}, "", true, false);
  ASSERT_TRUE(config::adam_moments_bf16(ref_cfg));
  const Trace ref = run(ref_cfg, model, 0);
  ASSERT_TRUE(std::isfinite(ref.losses.back()));
  EXPECT_LT(ref.losses.back(), ref.losses.front());
  for (const auto& unit : ref.exp_avg_sq)
    for (float v : unit) ASSERT_TRUE(same_bits(v, bf16_to_fp32(fp32_to_bf16(v)))) << v;
  const Trace fp32 = run(config({0}, "", false, false), model, 0);
  EXPECT_NE(fp32.exp_avg_sq, ref.exp_avg_sq) << "the moments were not stored in bf16";

  struct Setup {
    Placing placing;
    bool ds_key;
  };
  const std::vector<Setup> setups = {{{1, "none", "cpu"}, false},
                                     {{3, "cpu", "cpu"}, true},
                                     {{3, "none", "nvme"}, false},
                                     {{3, "nvme", "nvme"}, true}};
  for (const Setup& setup : setups) {
    const Placing& s = setup.placing;
    SCOPED_TRACE(s.name() + (setup.ds_key ? " bf16_optimizer_states" : " fp32_optimizer_states"));
    const config::Config cfg =
        config(s, swap_dir("bf16m_" + s.name()).string(), true, setup.ds_key);
    const uint64_t budget = s.stage == 3 ? streaming_budget(cfg, model) : 0;
    expect_bit_identical(ref, run(cfg, model, budget));
  }
  // Only the optimizer state is in swap files here: every NVMe byte is optimizer state.
  const Placing nvme{3, "none", "nvme"};
  const Trace b = run(config(nvme, swap_dir("bf16m_b").string(), true, false), model, 0);
  const Trace f = run(config(nvme, swap_dir("bf16m_f").string(), false, false), model, 0);
  EXPECT_GT(f.traffic.nvme_write_bytes, 0u);
  EXPECT_EQ(3 * b.traffic.nvme_write_bytes, 2 * f.traffic.nvme_write_bytes);
  EXPECT_EQ(3 * b.traffic.nvme_read_bytes, 2 * f.traffic.nvme_read_bytes);
}

}  // namespace
}  // namespace outcore::zero::test
