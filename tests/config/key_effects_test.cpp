// Every config key is honoured or, set to a non-default value, warned about: the table in
// engine/config/key_effects.cpp covers every key config::to_json prints, each honoured key
// names a behaviour test that exists, and each no-effect key draws a warning naming it.
#include "engine/config/key_effects.hpp"

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>
#include <string>
#include <tuple>

#include "engine/config/config.hpp"

namespace outcore::config::detail {
namespace {

// A config with every section present (a scheduler too), as to_json prints it.
nlohmann::ordered_json full_json() {
  return to_json(parse_config(R"({"train_micro_batch_size_per_gpu": 1,
      "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}})",
                              "walk")
                     .config);
}

const KeyEffect* covering(std::string_view path) {
  for (const KeyEffect& e : key_effects()) {
    if (path == e.path) return &e;
    if (path.size() > e.path.size() && path.substr(0, e.path.size()) == e.path &&
        path[e.path.size()] == '.')
      return &e;  // a subtree listed as one entry (scheduler)
  }
  return nullptr;
}

void leaves(const nlohmann::ordered_json& j, const std::string& prefix,
            std::vector<std::string>& out) {
  if (j.is_object() && !j.empty()) {
    for (const auto& [k, v] : j.items()) leaves(v, prefix.empty() ? k : prefix + "." + k, out);
  } else {
    out.push_back(prefix);
  }
}

std::string slurp(const std::filesystem::path& p) {
  std::ifstream in(p);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

TEST(KeyEffects, EveryKeyIsClassifiedAndNoEntryIsStale) {
  std::vector<std::string> paths;
  leaves(full_json(), "", paths);
  ASSERT_GT(paths.size(), 80u);
  std::set<std::string_view> used;
  for (const std::string& p : paths) {
    const KeyEffect* e = covering(p);
    EXPECT_NE(e, nullptr) << p
                          << " is neither honoured nor warned about (add it to "
                             "engine/config/key_effects.cpp)";
    if (e) used.insert(e->path);
  }
  for (const KeyEffect& e : key_effects())
    EXPECT_TRUE(used.count(e.path)) << e.path << " is listed but to_json has no such key";
}

TEST(KeyEffects, EveryHonouredKeyNamesABehaviourTestThatExists) {
  for (const KeyEffect& e : key_effects()) {
    if (!e.honoured) continue;
    const std::string note(e.note);
    const size_t colon = note.find(": ");
    ASSERT_NE(colon, std::string::npos) << e.path << ": note \"" << note << "\"";
    const std::filesystem::path file =
        std::filesystem::path(OUTCORE_SOURCE_DIR) / note.substr(0, colon);
    const std::string text = slurp(file);
    ASSERT_FALSE(text.empty()) << e.path << ": " << file << " does not exist";
    const std::string test = note.substr(colon + 2);
    const size_t dot = test.find('.');
    const std::string suite = test.substr(0, dot);
    EXPECT_NE(text.find("(" + suite + ","), std::string::npos)
        << e.path << ": no test suite " << suite << " in " << file;
    if (dot != std::string::npos) {
      EXPECT_NE(text.find(", " + test.substr(dot + 1) + ")"), std::string::npos)
          << e.path << ": no test " << test << " in " << file;
    }
  }
}

// A value different from `d` of the same kind.
nlohmann::json other_than(const nlohmann::json& d) {
  if (d.is_null()) return 2;  // an unset count (number_checkpoints)
  if (d.is_boolean()) return !d.get<bool>();
  if (d.is_number_integer()) return d.get<int64_t>() == -1 ? 2 : d.get<int64_t>() + 1;
  if (d.is_number()) return d.get<double>() == 0.0 ? 0.5 : d.get<double>() / 2;
  return nullptr;
}

TEST(KeyEffects, EveryKeyWithoutEffectIsWarnedAboutWhenSet) {
  const nlohmann::ordered_json defaults = full_json();
  int checked = 0;
  for (const KeyEffect& e : key_effects()) {
    if (e.honoured) continue;
    std::string pointer = "/" + std::string(e.path);
    for (char& c : pointer)
      if (c == '.') c = '/';
    const nlohmann::json d = nlohmann::json(defaults).at(nlohmann::json::json_pointer(pointer));
    const nlohmann::json v = other_than(d);
    ASSERT_FALSE(v.is_null()) << e.path << ": no non-default value to try for " << d;
    nlohmann::json cfg = {{"train_micro_batch_size_per_gpu", 1}, {"bf16", {{"enabled", true}}}};
    cfg[nlohmann::json::json_pointer(pointer)] = v;
    if (e.path == "bf16.bf16_optimizer_states")  // DeepSpeed allows it only with this one
      cfg["bf16"]["bf16_master_weights_and_grads"] = true;
    if (e.path == "activation_checkpointing.contiguous_memory_optimization") {
      cfg["activation_checkpointing"]["partition_activations"] = true;
      cfg["activation_checkpointing"]["number_checkpoints"] = 2;
    }
    const ParsedConfig p = parse_config(cfg.dump(), "key test");
    bool warned = false;
    for (const ConfigWarning& w : p.warnings)
      warned |= w.json_path == e.path && w.message.find("no effect") != std::string::npos;
    EXPECT_TRUE(warned) << e.path << " set to " << v << " drew no warning";
    ++checked;
  }
  EXPECT_GT(checked, 20);
}

// Keys honoured with another meaning than DeepSpeed's, or overruled by another key: said when set.
TEST(KeyEffects, KeysThatActOtherwiseThanInDeepSpeedAreSaid) {
  auto warning = [](const std::string& json, const std::string& path) {
    for (const ConfigWarning& w : parse_config(json, "k").warnings)
      if (w.json_path == path) return w.message;
    return std::string("(none)");
  };
  // The config, the key warned about, and a part of the warning ("" for none).
  const std::tuple<const char*, const char*, const char*> cases[] = {
      {R"({"zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 500000}})",
       "zero_optimization.stage3_param_persistence_threshold", "a whole unit's elements"},
      {R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory":
           true}, "offload_optimizer": {"device": "cpu", "pin_memory": false}}})",
       "zero_optimization.offload_optimizer.pin_memory", "none of it is page-locked"},
      // A section that does not offload has no say in the pool: its pin_memory has no effect.
      {R"({"zero_optimization": {"stage": 3, "offload_param": {"device": "none", "pin_memory":
           false}, "offload_optimizer": {"device": "cpu", "pin_memory": true}}})",
       "zero_optimization.offload_param.pin_memory",
       "acts only with offload_param.device cpu or nvme at stage 3"},
      // The optimizer's lr under a schedule that sets its own; the same value is not warned.
      {R"({"optimizer": {"type": "AdamW", "params": {"lr": 0.05}}, "scheduler": {"type":
           "WarmupDecayLR", "params": {"total_num_steps": 10}}})",
       "optimizer.params.lr", "warms up to its warmup_max_lr, 0.001 (default 0.001)"},
      {R"({"optimizer": {"type": "AdamW", "params": {"lr": 0.05}}, "scheduler": {"type":
           "WarmupLR", "params": {"warmup_max_lr": 0.05}}})",
       "optimizer.params.lr", ""},
      {R"({"optimizer": {"type": "AdamW", "params": {"lr": 0.05}}, "scheduler": {"type":
           "WarmupLR"}})",
       "optimizer.params.lr", ""},
      {R"({"optimizer": {"type": "AdamW", "params": {"betas": [0.5, 0.6]}}, "scheduler": {"type":
           "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3}}})",
       "optimizer.params.betas", "sets the betas at every step"},
      // Written at their defaults, they are overridden all the same: said too.
      {R"({"optimizer": {"type": "AdamW", "params": {"lr": 0.001}}, "scheduler": {"type":
           "WarmupLR", "params": {"warmup_max_lr": 0.01}}})",
       "optimizer.params.lr", "set to 0.001, but scheduler WarmupLR warms up to its warmup_max_lr"},
      {R"({"optimizer": {"type": "AdamW", "params": {"lr": 0.001, "betas": [0.9, 0.999]}},
           "scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr":
           1e-2}}})",
       "optimizer.params.betas", "set to [0.9,0.999], but scheduler OneCycle"},
      {R"({"optimizer": {"type": "AdamW", "params": {"lr": 0.001}}, "scheduler": {"type":
           "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-2}}})",
       "optimizer.params.lr", "OneCycle sets the lr between"},
      {R"({"activation_checkpointing": {"number_checkpoints": 4}})",
       "activation_checkpointing.number_checkpoints", "turns activation checkpointing on"},
      // DeepSpeed takes bf16 moments only beside bf16_master_weights_and_grads: not warned then.
      {R"({"bf16": {"enabled": true, "bf16_master_weights_and_grads": true,
           "bf16_optimizer_states": true}, "zero_optimization": {"stage": 1}})",
       "bf16.bf16_master_weights_and_grads", ""},
      {R"({"bf16": {"enabled": false, "bf16_master_weights_and_grads": true,
           "bf16_optimizer_states": true}})",
       "bf16.bf16_optimizer_states", "keeps the Adam moments in bf16 all the same"}};
  for (const auto& [json, path, says] : cases) {
    nlohmann::json cfg = nlohmann::json::parse(json);
    cfg["train_micro_batch_size_per_gpu"] = 1;
    const std::string w = warning(cfg.dump(), path);
    if (*says == '\0')
      EXPECT_EQ(w, "(none)") << path;
    else
      EXPECT_NE(w.find(says), std::string::npos) << path << ": " << w;
  }
}

// A checkpoint's saved config writes every key: a default lr or betas there is no user's, and a
// resume on it is not told they have no effect; a value of the user's still is.
TEST(KeyEffects, ASavedConfigIsNotWarnedForTheDefaultsItWrites) {
  auto paths = [](const ParsedConfig& p) {
    std::set<std::string> out;
    for (const ConfigWarning& w : p.warnings) out.insert(w.json_path);
    return out;
  };
  const ParsedConfig user = parse_config(R"({"train_micro_batch_size_per_gpu": 1, "scheduler":
      {"type": "OneCycle", "params": {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-2}}})",
                                         "user");
  EXPECT_TRUE(paths(user).empty());
  const std::string saved = to_json(user.config).dump();
  // As a user's file, every key written: the defaults are said to be overridden.
  EXPECT_TRUE(paths(parse_config(saved, "as a user's")).contains("optimizer.params.betas"));
  EXPECT_TRUE(paths(parse_saved_config(saved, "saved")).empty());
  EXPECT_EQ(to_json(parse_saved_config(saved, "saved").config), to_json(user.config));
  // The user's own value is warned about on the saved config too.
  const ParsedConfig lr = parse_config(R"({"train_micro_batch_size_per_gpu": 1, "optimizer":
      {"type": "AdamW", "params": {"lr": 0.05}}, "scheduler": {"type": "OneCycle", "params":
      {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-2}}})",
                                       "user");
  EXPECT_TRUE(paths(lr).contains("optimizer.params.lr"));
  EXPECT_TRUE(paths(parse_saved_config(to_json(lr.config).dump(), "saved"))
                  .contains("optimizer.params.lr"));
}

TEST(KeyEffects, DefaultsAndHonouredKeysDrawNoSuchWarning) {
  // Every section at its default, then honoured keys changed: no "no effect" warning.
  const ParsedConfig p = parse_config(R"({"train_micro_batch_size_per_gpu": 2,
      "gradient_clipping": 0.5, "zero_optimization": {"stage": 3, "sub_group_size": 1000,
      "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp", "pipeline_read": true}},
      "aio": {"queue_depth": 32}, "fp16": {"enabled": true, "hysteresis": 3}})",
                                      "honoured");
  for (const ConfigWarning& w : p.warnings)
    EXPECT_EQ(w.message.find("no effect"), std::string::npos) << w.to_string();
}

// The paths `json` draws a "no effect" warning for.
std::set<std::string> warned(const std::string& json) {
  std::set<std::string> paths;
  for (const ConfigWarning& w : parse_config(json, "conditional").warnings)
    if (w.message.find("no effect") != std::string::npos) paths.insert(w.json_path);
  return paths;
}

// Keys that act only at stage 3, or only with their section's NVMe device, are said to have no
// effect where they have none (below stage 3, with device cpu), and draw nothing where they act.
TEST(KeyEffects, KeysOfAStageOrDeviceNotInUseAreWarnedAbout) {
  EXPECT_EQ(warned(R"({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2,
      "stage3_max_live_parameters": 10, "stage3_max_reuse_distance": 0}})"),
            (std::set<std::string>{"zero_optimization.stage3_max_live_parameters",
                                   "zero_optimization.stage3_max_reuse_distance"}));
  EXPECT_EQ(warned(R"({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3,
      "offload_param": {"device": "cpu", "buffer_count": 9},
      "offload_optimizer": {"device": "cpu", "nvme_path": "/tmp", "pipeline_write": true}}})"),
            (std::set<std::string>{"zero_optimization.offload_param.buffer_count",
                                   "zero_optimization.offload_optimizer.nvme_path",
                                   "zero_optimization.offload_optimizer.pipeline_write"}));
  // sub_group_size sizes only the optimizer's swap I/O; max_in_cpu splits only parameters
  // bound for swap files; ratio splits only state that is offloaded.
  EXPECT_EQ(warned(R"({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3,
      "sub_group_size": 7, "offload_param": {"device": "cpu", "max_in_cpu": 0},
      "offload_optimizer": {"device": "cpu"}}})"),
            (std::set<std::string>{"zero_optimization.sub_group_size",
                                   "zero_optimization.offload_param.max_in_cpu"}));
  EXPECT_EQ(warned(R"({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3,
      "offload_optimizer": {"device": "none", "ratio": 0.3}}})"),
            (std::set<std::string>{"zero_optimization.offload_optimizer.ratio"}));
  // Below stage 3 DeepSpeed ignores it: warned, not refused.
  for (const char* stage : {"1", "2"})
    EXPECT_EQ(warned(std::string(R"({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {
        "stage": )") +
                     stage + R"(, "offload_optimizer": {"device": "cpu", "ratio": 0.5}}})"),
              (std::set<std::string>{"zero_optimization.offload_optimizer.ratio"}))
        << "stage " << stage;
  EXPECT_TRUE(warned(R"({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3,
      "stage3_max_live_parameters": 10, "sub_group_size": 1000,
      "offload_param": {"device": "nvme", "nvme_path": "/tmp", "buffer_count": 9, "max_in_cpu": 5},
      "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp", "pipeline_write": true,
                            "ratio": 0.5}}})")
                  .empty());
}

// fp16's keys without fp16, the dynamic scaler's beside a static scale, and outcore's swap keys
// without swap files are said to have no effect; with what they act on, nothing is said.
TEST(KeyEffects, KeysOfAFeatureNotInUseAreWarnedAbout) {
  const std::string scaler =
      R"("loss_scale_window": 10, "hysteresis": 5, "min_loss_scale": 4, "initial_scale_power": 8,
         "consecutive_hysteresis": true)";
  EXPECT_EQ(warned(R"({"train_micro_batch_size_per_gpu": 2, "fp16": {"loss_scale": 64, )" + scaler +
                   "}}"),
            (std::set<std::string>{"fp16.loss_scale", "fp16.loss_scale_window", "fp16.hysteresis",
                                   "fp16.min_loss_scale", "fp16.initial_scale_power",
                                   "fp16.consecutive_hysteresis"}));
  EXPECT_EQ(
      warned(R"({"train_micro_batch_size_per_gpu": 2,
      "fp16": {"enabled": true, "loss_scale": 64, )" +
             scaler + "}}"),
      (std::set<std::string>{"fp16.loss_scale_window", "fp16.hysteresis", "fp16.min_loss_scale",
                             "fp16.initial_scale_power", "fp16.consecutive_hysteresis"}));
  EXPECT_TRUE(
      warned(R"({"train_micro_batch_size_per_gpu": 2, "fp16": {"enabled": true, )" + scaler + "}}")
          .empty());
  EXPECT_EQ(warned(R"({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3,
      "offload_optimizer": {"device": "cpu"}},
      "outcore": {"step_in_backward": true, "swap_checksum": false}})"),
            (std::set<std::string>{"outcore.step_in_backward", "outcore.swap_checksum"}));
  EXPECT_EQ(warned(R"({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3,
      "offload_param": {"device": "nvme", "nvme_path": "/tmp"}},
      "outcore": {"step_in_backward": true, "swap_checksum": false}})"),
            (std::set<std::string>{"outcore.step_in_backward"}));
  EXPECT_TRUE(warned(R"({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3,
      "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}},
      "outcore": {"step_in_backward": true, "swap_checksum": false}})")
                  .empty());
  // offload_optimizer.ratio 0 keeps all the optimizer state on the device: no optimizer swap
  // files for the keys that shape them to act on (the swap path and its checksums still serve
  // the gradient accumulators); a ratio above 0 offloads some.
  const std::string swapped_optimizer =
      R"("offload_optimizer": {"device": "nvme", "nvme_path": "/tmp", "buffer_count": 8,
         "pipeline_read": true, "pipeline_write": true, "ratio": )";
  const std::string keys = R"(}, "sub_group_size": 1000},
      "outcore": {"step_in_backward": true, "swap_checksum": false}})";
  EXPECT_EQ(warned(R"({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3, )" +
                   swapped_optimizer + "0" + keys),
            (std::set<std::string>{"outcore.step_in_backward", "zero_optimization.sub_group_size",
                                   "zero_optimization.offload_optimizer.buffer_count",
                                   "zero_optimization.offload_optimizer.pipeline_read",
                                   "zero_optimization.offload_optimizer.pipeline_write"}));
  EXPECT_TRUE(warned(R"({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3, )" +
                     swapped_optimizer + "0.25" + keys)
                  .empty());
}

// What acts only where parameters or optimizer state are offloaded, or with bf16, is warned
// about elsewhere; where it acts, it is not.
TEST(KeyEffects, KeysOfAnOffloadOrDtypeNotInUseAreWarnedAbout) {
  EXPECT_EQ(warned(R"({"train_micro_batch_size_per_gpu": 2, "bf16": {"check_grad_overflow":
      false}, "zero_optimization": {"stage": 3, "offload_param": {"device": "none", "pin_memory":
      false}, "offload_optimizer": {"device": "none", "pin_memory": false}}})"),
            (std::set<std::string>{"bf16.check_grad_overflow",
                                   "zero_optimization.offload_param.pin_memory",
                                   "zero_optimization.offload_optimizer.pin_memory"}));
  EXPECT_TRUE(warned(R"({"train_micro_batch_size_per_gpu": 2, "bf16": {"enabled": true,
      "check_grad_overflow": false}, "zero_optimization": {"stage": 3, "offload_param":
      {"device": "cpu", "pin_memory": false}, "offload_optimizer": {"device": "cpu",
      "pin_memory": false}}, "outcore": {"pinned_memory_mb": 64}})")
                  .empty());
  // The pinned pool's cap acts without offload too (write-back and gather buffers).
  EXPECT_TRUE(warned(R"({"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 2},
      "outcore": {"pinned_memory_mb": 64}})")
                  .empty());
}

}  // namespace
}  // namespace outcore::config::detail
