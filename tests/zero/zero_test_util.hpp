// Shared helpers of the engine/zero tests: tiny models, configs per placement, a training loop.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <cstring>
#include <filesystem>
#include <functional>
#include <string>
#include <vector>

#include "engine/comm/local_comm.hpp"
#include "engine/config/config.hpp"
#include "engine/device/device.hpp"
#include "engine/model/model.hpp"
#include "engine/zero/zero.hpp"

namespace outcore::zero::test {

// A placement to test: stage and where parameters / optimizer state live.
struct Placing {
  int stage = 0;
  std::string offload_param = "none";      // none | cpu | nvme
  std::string offload_optimizer = "none";  // none | cpu | nvme
  std::string name() const {
    return "stage" + std::to_string(stage) + "_param_" + offload_param + "_opt_" +
           offload_optimizer;
  }
};

inline model::LlamaConfig tiny_config(bool tied) {
  model::LlamaConfig c;
  c.hidden_size = 64;
  c.intermediate_size = 160;
  c.num_hidden_layers = 3;
  c.num_attention_heads = 4;
  c.num_key_value_heads = 2;
  c.vocab_size = 384;
  c.max_position_embeddings = 64;
  c.head_dim = 16;
  c.tie_word_embeddings = tied;
  return c;
}

inline model::ModelOptions tiny_options(DType dtype) {
  model::ModelOptions o;
  o.micro_batch = 2;
  o.seq_len = 16;
  o.param_dtype = dtype;
  return o;
}

// A fresh directory for swap files under the build tree.
inline std::filesystem::path swap_dir(const std::string& name) {
  std::filesystem::path p = std::filesystem::path(OUTCORE_BINARY_DIR) / "zero_test_swap" / name;
  std::filesystem::remove_all(p);
  std::filesystem::create_directories(p);
  return p;
}

// DeepSpeed JSON for `s`; `extra_zero` and `extra_top` are spliced into zero_optimization and
// the top level, `extra_offload_optimizer` into offload_optimizer (each either empty or
// starting with a comma). offload_param nvme gets "max_in_cpu": 0, so that every parameter
// partition is in a swap file (DeepSpeed's default, 1e9 elements, would keep a tiny model's
// partitions in host memory).
inline std::string config_json(const Placing& s, DType dtype, const std::string& nvme,
                               const std::string& extra_zero = "",
                               const std::string& extra_top = "",
                               const std::string& extra_offload_optimizer = "") {
  auto offload = [&](const std::string& dev, const std::string& extra) {
    return "{\"device\": \"" + dev + "\"" +
           (dev == "nvme" ? ", \"nvme_path\": \"" + nvme + "\"" : "") + extra + "}";
  };
  return std::string(
             "{\"train_micro_batch_size_per_gpu\": 2, \"gradient_accumulation_steps\": 2,") +
         "\"gradient_clipping\": 0.5," +
         "\"optimizer\": {\"type\": \"AdamW\", \"params\": {\"lr\": 0.003, \"weight_decay\": "
         "0.01}}," +
         "\"bf16\": {\"enabled\": " + (dtype == DType::BF16 ? "true" : "false") + "}," +
         "\"zero_optimization\": {\"stage\": " + std::to_string(s.stage) + ", \"offload_param\": " +
         offload(s.offload_param, s.offload_param == "nvme" ? ", \"max_in_cpu\": 0" : "") +
         ", \"offload_optimizer\": " + offload(s.offload_optimizer, extra_offload_optimizer) +
         extra_zero + "}" + extra_top + "}";
}

// config_json's JSON with the Adam moments in bf16 (DeepSpeed's fp32_optimizer_states false).
inline std::string with_bf16_moments(std::string json) {
  const std::string decay = "\"weight_decay\": 0.01";
  json.replace(json.find(decay), decay.size(), decay + ", \"fp32_optimizer_states\": false");
  return json;
}

inline config::Config make_config(const std::string& json) {
  config::Config cfg = config::parse_config(json, "test").config;
  config::AutoContext ctx;
  config::resolve_auto(cfg, ctx);
  return cfg;
}

// Learnable token streams: each sequence of `seq` ids starts at a random id and continues
// with next = (3 * prev + 1) mod vocab.
inline std::vector<int32_t> make_tokens(size_t n, int64_t vocab, uint64_t seed, size_t seq = 17) {
  std::vector<int32_t> t(n);
  uint64_t x = seed * 6364136223846793005ull + 1442695040888963407ull;
  for (size_t i = 0; i < n; ++i) {
    if (i % seq == 0) {
      x = x * 6364136223846793005ull + 1442695040888963407ull;
      t[i] = static_cast<int32_t>((x >> 33) % static_cast<uint64_t>(vocab));
    } else {
      t[i] = static_cast<int32_t>((3 * int64_t{t[i - 1]} + 1) % vocab);
    }
  }
  return t;
}

inline EngineOptions nvme_gradients() {
  EngineOptions eo;
  eo.gradients = GradientPlacement::kNvme;
  return eo;
}

struct RunResult {
  std::vector<float> losses;
  float eval_loss = 0;
  std::vector<double> norms;
  std::vector<std::vector<float>> master;  // per unit, full slab
  std::vector<std::vector<std::byte>> params;
  MemoryPeaks memory;
  TrafficStats traffic;
  Plan plan;
};

// Trains `steps` optimizer steps of gradient_accumulation_steps micro-batches each on `dev`
// (the model's backend must be the device's, see device::make_backend); `micro_batches` > 0
// runs that many per step instead, whatever the config says.
inline RunResult train_on(device::Device& dev, const config::Config& cfg,
                          const model::LlamaModel& model, int steps, EngineOptions eo = {},
                          int64_t micro_batches = 0) {
  comm::LocalComm comm;
  RunResult r;
  {
    ZeroEngine engine(cfg, model, dev, comm, /*seed=*/7, eo);
    r.plan = engine.plan();
    const int64_t gas = micro_batches > 0 ? micro_batches : cfg.gradient_accumulation_steps.value();
    const size_t n = static_cast<size_t>(model.tokens());
    for (int t = 1; t <= steps; ++t) {
      float loss = 0;
      for (int64_t k = 0; k < gas; ++k) {
        const uint64_t seed = static_cast<uint64_t>(t * 100 + k);
        const size_t T = static_cast<size_t>(model.options().seq_len);
        const size_t B = n / T;
        std::vector<int32_t> tok = make_tokens(B * (T + 1), model.config().vocab_size, seed, T + 1);
        std::vector<int32_t> in, tgt;
        for (size_t b = 0; b < B; ++b) {
          in.insert(in.end(), tok.begin() + b * (T + 1), tok.begin() + b * (T + 1) + T);
          tgt.insert(tgt.end(), tok.begin() + b * (T + 1) + 1, tok.begin() + (b + 1) * (T + 1));
        }
        loss +=
            engine.forward_backward(in.data(), tgt.data(), 1.0f / static_cast<float>(gas), k == 0);
      }
      r.losses.push_back(loss);
      StepResult s = engine.step(step_params(cfg, 0.003, static_cast<uint64_t>(t), 1.0));
      EXPECT_FALSE(s.overflow);
      r.norms.push_back(s.grad_norm);
    }
    {
      const size_t n = static_cast<size_t>(model.tokens());
      std::vector<int32_t> tok = make_tokens(n + 1, model.config().vocab_size, 99, n + 1);
      r.eval_loss = engine.evaluate(tok.data(), tok.data() + 1);
    }
    for (int u = 0; u < model.num_units(); ++u) {
      const size_t padded = model.layout().units[u].padded_numel;
      r.master.emplace_back(padded);
      engine.get_master_weights(u, r.master.back());
      r.params.emplace_back(padded * dtype_size(model.options().param_dtype));
      engine.get_params(u, r.params.back());
    }
    r.memory = engine.memory();
    r.traffic = engine.traffic();
  }
  return r;
}

// train_on a simulated device with `device_budget` bytes (0: unlimited).
inline RunResult train(const config::Config& cfg, const model::LlamaModel& model, int steps,
                       uint64_t device_budget = 0, EngineOptions eo = {}) {
  device::CpuDevice dev({.memory_budget_bytes = device_budget});
  return train_on(dev, cfg, model, steps, eo);
}

// What a run's plan says and what its engine allocated and moved.
struct Measured {
  Plan plan;
  MemoryPeaks memory;
  TrafficStats after_init, after_steps;
};

// Runs `steps` optimizer steps (no evaluation, no state reads, so the traffic is the steps'
// alone) and measures. `while_alive`, if given, is called once the engine is built (its swap
// files exist).
inline Measured measure_on(device::Device& dev, const config::Config& cfg,
                           const model::LlamaModel& model, int steps, EngineOptions eo = {},
                           const std::function<void()>& while_alive = {}) {
  comm::LocalComm comm;
  ZeroEngine engine(cfg, model, dev, comm, 3, eo);
  Measured m;
  m.plan = engine.plan();
  if (while_alive) while_alive();
  m.after_init = engine.traffic();
  const size_t n = static_cast<size_t>(model.tokens());
  const int64_t gas = cfg.gradient_accumulation_steps.value();
  for (int t = 1; t <= steps; ++t) {
    for (int64_t k = 0; k < gas; ++k) {
      std::vector<int32_t> tok = make_tokens(n + 1, model.config().vocab_size, t * 10 + k, n + 1);
      engine.forward_backward(tok.data(), tok.data() + 1, 0.5f, k == 0);
    }
    engine.step(step_params(cfg, 1e-3, t, 1.0));
  }
  engine.wait_step();  // the last step otherwise finishes under the next pass
  m.memory = engine.memory();
  m.after_steps = engine.traffic();
  return m;
}

// Bytes of one bf16 copy of every unit's parameters (padded).
inline uint64_t bf16_param_bytes(const model::LlamaModel& model) {
  uint64_t n = 0;
  for (const model::UnitLayout& u : model.layout().units) n += u.padded_numel * sizeof(uint16_t);
  return n;
}

// The bytes `m`'s engine moved over its `steps` steps, each way and to and from the drive, are
// the plan's per step.
inline void expect_traffic_as_planned(const Measured& m, int steps) {
  const Plan& p = m.plan;
  const TrafficStats& a = m.after_init;
  const TrafficStats& b = m.after_steps;
  const auto n = static_cast<uint64_t>(steps);
  EXPECT_EQ(b.h2d_bytes - a.h2d_bytes, n * p.per_step.h2d) << format_plan(p);
  EXPECT_EQ(b.d2h_bytes - a.d2h_bytes, n * p.per_step.d2h) << format_plan(p);
  EXPECT_EQ(b.nvme_read_bytes - a.nvme_read_bytes, n * p.per_step.nvme_read) << format_plan(p);
  EXPECT_EQ(b.nvme_write_bytes - a.nvme_write_bytes, n * p.per_step.nvme_write) << format_plan(p);
}

inline Measured measure(const config::Config& cfg, const model::LlamaModel& model, int steps,
                        EngineOptions eo = {}, const std::function<void()>& while_alive = {}) {
  device::CpuDevice dev;
  return measure_on(dev, cfg, model, steps, eo, while_alive);
}

inline void expect_bit_identical(const RunResult& a, const RunResult& b, const std::string& what) {
  ASSERT_EQ(a.losses.size(), b.losses.size());
  for (size_t i = 0; i < a.losses.size(); ++i) {
    EXPECT_EQ(std::memcmp(&a.losses[i], &b.losses[i], sizeof(float)), 0)
        << what << ": loss of step " << i + 1 << ": " << a.losses[i] << " vs " << b.losses[i];
    EXPECT_EQ(a.norms[i], b.norms[i]) << what << ": grad norm of step " << i + 1;
  }
  EXPECT_EQ(std::memcmp(&a.eval_loss, &b.eval_loss, sizeof(float)), 0)
      << what << ": evaluation loss " << a.eval_loss << " vs " << b.eval_loss;
  ASSERT_EQ(a.master.size(), b.master.size());
  for (size_t u = 0; u < a.master.size(); ++u) {
    EXPECT_EQ(
        std::memcmp(a.master[u].data(), b.master[u].data(), a.master[u].size() * sizeof(float)), 0)
        << what << ": master weights of unit " << u;
    EXPECT_EQ(a.params[u], b.params[u]) << what << ": parameters of unit " << u;
  }
}

}  // namespace outcore::zero::test
