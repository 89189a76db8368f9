// `outcore estimate --config ds.json --model config.json [--micro-batch B] [--seq-len T]
// [--world-size W] [--activation-checkpointing] [--device auto|cpu|cuda]`: the placement plan
// of this config and model (bytes each tier holds at its peak, bytes moved per optimizer step)
// against what this machine offers, computed as `outcore train` computes it; on a GPU, its
// free memory (cudaMemGetInfo) caps the device budget as it does in training. Exit 0 when it fits,
// 2 when it does not (the reason on stderr, as `outcore train` refuses it) or on bad input.
#include <fmt/format.h>

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>

#include "common/error.hpp"
#include "engine/config/config.hpp"
#include "engine/model/model.hpp"
#include "engine/zero/plan.hpp"
#include "tools/outcore/commands.hpp"
#include "tools/outcore/launch.hpp"

namespace outcore::cli {
namespace {

// Numbers arrive as text and are checked here, so bad values exit 2 like any bad input.
struct EstimateArgs {
  std::string config_file, model_file, micro_batch, seq_len, world_size;
  std::string device = "auto";
  bool activation_checkpointing = false;
};

struct EstimateOptions {
  std::string config_file;
  std::string model_file;
  int64_t micro_batch = 0;  // 0: the config's train_micro_batch_size_per_gpu, else 1
  int64_t seq_len = 0;      // 0: min(max_position_embeddings, 1024)
  int64_t world_size = 1;
};

// An integer in 1..max from `text` (empty: `fallback`), read as 64 bits so that no value
// wraps into range. Throws InvalidArgument naming `flag` and the range.
int64_t positive(const std::string& text, const char* flag, int64_t fallback, int64_t max) {
  if (text.empty()) return fallback;
  int64_t v = 0;
  const char* end = text.data() + text.size();
  auto [ptr, ec] = std::from_chars(text.data(), end, v);
  if (ec != std::errc() || ptr != end || v < 1 || v > max)
    throw InvalidArgument(std::string(flag) + ": got \"" + text + "\"; allowed: an integer in 1.." +
                          std::to_string(max));
  return v;
}

int run_estimate(const EstimateArgs& a) {
  config::Config cfg;
  std::optional<model::LlamaModel> model;
  EstimateOptions o;
  try {
    if (a.config_file.empty() || a.model_file.empty())
      throw InvalidArgument("estimate needs --config FILE and --model FILE");
    o.config_file = a.config_file;
    o.model_file = a.model_file;
    o.micro_batch = positive(a.micro_batch, "--micro-batch", 0, config::kMaxMicroBatch);
    o.seq_len = positive(a.seq_len, "--seq-len", 0, model::kMaxConfigDim);
    o.world_size = positive(a.world_size, "--world-size", 1, config::kMaxWorldSize);
    cfg = config::load_config_file(o.config_file).config;
    const model::LlamaConfig mc = model::LlamaConfig::load(o.model_file);
    if (o.seq_len > mc.max_position_embeddings)
      throw InvalidArgument(
          fmt::format("--seq-len: got {}; allowed: 1..{} (max_position_embeddings of {})",
                      o.seq_len, mc.max_position_embeddings, o.model_file));
    const model::ModelOptions mo =
        zero::estimate_model_options(cfg, mc,
                                     {.world_size = o.world_size,
                                      .micro_batch = o.micro_batch,
                                      .seq_len = o.seq_len,
                                      .activation_checkpointing = a.activation_checkpointing});
    model.emplace(mc, mo);
  } catch (const Error& e) {  // unreadable or malformed input
    std::fprintf(stderr, "error: %s\n", e.what());
    return 2;
  }
  const std::optional<DeviceChoice> dev = choose_device(a.device);
  if (!dev) return 2;
  zero::PlanOptions po{.world_size = static_cast<int>(o.world_size)};
  if (dev->kind == device::DeviceKind::Cuda) {
    try {
      const uint64_t budget = cfg.outcore.device_memory_mb << 20;
      const uint64_t free = device::make_cuda_device({.ordinal = dev->gpu})->free_memory_bytes();
      po.device_limit_bytes = budget > 0 ? std::min(budget, free) : free;
      po.device_host_accessible = false;
      // The head's rows per launch on this GPU, as training chooses them.
      const model::LlamaConfig mc = model->config();  // copied: emplace destroys the old model
      model::ModelOptions mo = model->options();
      mo.head_chunk_rows = model::head_rows_for_device(mc, mo, po.device_limit_bytes);
      model.emplace(mc, mo);
      std::printf("device     %s: %s free%s\n", dev->description.c_str(),
                  zero::format_bytes(free).c_str(),
                  budget > 0 ? (", budget " + zero::format_bytes(budget)).c_str() : "");
    } catch (const Error& e) {
      std::fprintf(stderr, "error: --device cuda: %s\n", e.what());
      return 2;
    }
  }
  const zero::Plan plan = zero::make_plan(cfg, *model, po);
  zero::PlanLimits limits = zero::system_limits(cfg, plan);
  if (po.device_limit_bytes > 0) limits.device = po.device_limit_bytes;
  std::fputs(zero::format_plan(plan, &limits).c_str(), stdout);
  try {
    zero::check_fits(plan, limits);
  } catch (const OutOfMemory& e) {
    std::fprintf(stderr, "error: does not fit: %s\n", e.what());
    return 2;
  }
  return 0;
}

}  // namespace

void add_estimate_command(CLI::App& app, int& rc) {
  auto o = std::make_shared<EstimateArgs>();
  CLI::App* cmd = app.add_subcommand(
      "estimate", "Print where each byte of training state lives and the traffic per step");
  cmd->add_option("--config", o->config_file, "DeepSpeed JSON config (required)");
  cmd->add_option("--model", o->model_file, "Hugging Face config.json of the model (required)");
  cmd->add_option("--micro-batch", o->micro_batch,
                  "sequences per micro-batch (default: the config's, else 1)");
  cmd->add_option("--seq-len", o->seq_len,
                  "tokens per sequence (default: min(max_position, 1024))");
  cmd->add_option("--world-size", o->world_size, "data-parallel ranks (default 1)");
  cmd->add_option("--device", o->device,
                  "plan for: auto (a GPU when there is one, else the simulated device), cpu, "
                  "cuda (the GPU's free memory caps the device budget)");
  cmd->add_flag("--activation-checkpointing", o->activation_checkpointing,
                "plan with activation checkpointing (as `outcore train "
                "--activation-checkpointing`; on anyway when the config's "
                "activation_checkpointing section asks for cpu_checkpointing)");
  cmd->callback([o, &rc] { rc = run_estimate(*o); });
}

}  // namespace outcore::cli
