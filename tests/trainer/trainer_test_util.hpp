// Shared by the trainer tests: a tiny Llama, a small slice of the demo dataset, and DeepSpeed
// configs built from JSON.
#pragma once

#include <filesystem>
#include <fstream>
#include <memory>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "engine/config/config.hpp"
#include "engine/model/model.hpp"
#include "engine/train/demo_data.hpp"
#include "engine/train/trainer.hpp"
#include "tests/train/temp_dir.hpp"

namespace outcore::train::testing {

// 2 layers, hidden 64, 4 query heads sharing 2 key/value heads, byte vocabulary.
inline nlohmann::json tiny_model_json() {
  return {{"hidden_size", 64},
          {"intermediate_size", 176},
          {"num_hidden_layers", 2},
          {"num_attention_heads", 4},
          {"num_key_value_heads", 2},
          {"vocab_size", 256},
          {"max_position_embeddings", 128},
          {"rms_norm_eps", 1e-5}};
}

inline model::LlamaConfig tiny_model() {
  return model::LlamaConfig::from_json(tiny_model_json().dump(), "tiny");
}

// Stage 0, fp32, micro-batch 4, AdamW at a constant 3e-3, no clipping.
inline nlohmann::json base_ds_json() {
  return nlohmann::json::parse(R"({
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 0.0,
    "optimizer": {"type": "AdamW",
                  "params": {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0}},
    "zero_optimization": {"stage": 0}
  })");
}

// `patch` merged into base_ds_json() (RFC 7386), parsed and resolved for `model`.
inline config::Config make_config(const nlohmann::json& patch, const model::LlamaConfig& model,
                                  int64_t total_steps = 100) {
  nlohmann::json j = base_ds_json();
  if (!patch.is_null()) j.merge_patch(patch);  // `{}` in a call is null, not an object
  config::Config cfg = config::parse_config(j.dump(), "test config").config;
  config::AutoContext ctx;
  ctx.hidden_size = model.hidden_size;
  ctx.total_steps = total_steps;
  config::resolve_auto(cfg, ctx);
  return cfg;
}

// ZeRO-3 with parameters and optimizer state in swap files under `swap_dir` (max_in_cpu 0:
// every parameter partition in a swap file, none kept in host memory).
inline nlohmann::json nvme_patch(const std::string& swap_dir) {
  return {{"zero_optimization",
           {{"stage", 3},
            {"offload_param", {{"device", "nvme"}, {"nvme_path", swap_dir}, {"max_in_cpu", 0}}},
            {"offload_optimizer", {{"device", "nvme"}, {"nvme_path", swap_dir}}}}}};
}

// A temporary directory holding a slice of the demo dataset (256 KiB train, 32 KiB val).
class DemoData {
 public:
  DemoData() {
    DemoDataOptions o;
    o.train_tokens = 256u << 10;
    o.val_tokens = 32u << 10;
    files_ = write_demo_dataset(dir_.file("data"), o);
  }
  const std::string& train() const { return files_.train; }
  const std::string& val() const { return files_.val; }
  std::string file(const std::string& name) const { return dir_.file(name); }

 private:
  TempDir dir_;
  DemoDatasetFiles files_;
};

// Options that train on `data` quietly (no progress display), sequences of 32 tokens.
inline TrainerOptions quiet_options(const DemoData& data, int64_t steps) {
  TrainerOptions o;
  o.train_data = data.train();
  o.val_data = data.val();
  o.steps = steps;
  o.seed = 7;
  o.seq_len = 32;
  o.progress_out = nullptr;
  o.engine.cpu_threads = 2;
  return o;
}

// Every unit's full slabs, as the engine holds them.
struct Weights {
  std::vector<std::vector<float>> master;
  std::vector<std::vector<std::byte>> params;  // in the param dtype
};

inline Weights weights_of(Trainer& tr) {
  Weights w;
  zero::ZeroEngine& e = tr.engine();
  for (const model::UnitLayout& ul : tr.model().layout().units) {
    w.master.emplace_back(ul.padded_numel);
    e.get_master_weights(ul.index, w.master.back());
    w.params.emplace_back(ul.padded_numel * dtype_size(e.param_dtype()));
    e.get_params(ul.index, w.params.back());
  }
  return w;
}

// Every swap file (regular file) left under `dir`.
inline int count_files(const std::string& dir) {
  int n = 0;
  std::error_code ec;
  if (!std::filesystem::exists(dir, ec)) return 0;
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir, ec)) {
    if (e.is_regular_file()) ++n;
  }
  return n;
}

}  // namespace outcore::train::testing
