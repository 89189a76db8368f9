// Trainer: the start-of-run description (for a terminal and for the metrics file).
#include <fmt/format.h>

#include <string>
#include <thread>

#include "aio/aio.hpp"
#include "common/error.hpp"
#include "engine/train/trainer.hpp"
#include "engine/zero/plan.hpp"

namespace outcore::train {
namespace {

std::string params_human(uint64_t n) {
  if (n >= 1'000'000'000) return fmt::format("{:.2f}B", static_cast<double>(n) / 1e9);
  if (n >= 1'000'000) return fmt::format("{:.1f}M", static_cast<double>(n) / 1e6);
  return fmt::format("{:.1f}k", static_cast<double>(n) / 1e3);
}

std::string offload_text(config::OffloadDevice d, const std::string& path) {
  if (d == config::OffloadDevice::kNvme) return fmt::format("nvme ({})", path);
  return std::string(config::to_string(d));
}

std::string data_text(const DataLoader& l) {
  std::string s = fmt::format("{} [{}, {}) = {} tokens, {} sequences, {} micro-batches per epoch",
                              l.file().path(), l.range().begin, l.range().end, l.range().size(),
                              l.sequences(), l.batches_per_epoch());
  if (l.mask() != nullptr)
    s += fmt::format("; loss mask {}: {} of the sequences' {} targets trained", l.mask()->path(),
                     l.targets_in_split(),
                     l.sequences() * static_cast<uint64_t>(l.options().seq_len));
  return s;
}

}  // namespace

std::string Trainer::summary() const {
  const model::LlamaConfig& mc = model_->config();
  const model::ModelOptions& mo = model_->options();
  const config::OptimizerConfig& opt = cfg_.optimizer;
  const config::ZeroConfig& z = cfg_.zero_optimization;
  std::string s;
  std::string family = model::family_name(mc.model_type);
  if (mc.qkv_bias()) family += " (q, k, v biases)";
  if (mc.qk_norm()) family += " (q and k normed per head)";
  std::string rope = fmt::format("RoPE theta {}", mc.rope_theta);
  if (mc.rope_scaling.type == model::RopeScalingType::Linear)
    rope += fmt::format(", linear x{}", mc.rope_scaling.factor);
  if (mc.rope_scaling.type == model::RopeScalingType::Llama3)
    rope += fmt::format(", llama3 x{} from {} positions", mc.rope_scaling.factor,
                        mc.rope_scaling.original_max_position_embeddings);
  s += fmt::format(
      "model      {} {} parameters: hidden {}, {} layers, {} heads of {} ({} key/value), "
      "SwiGLU {}, vocab {}, {} embeddings, {}\n",
      family, params_human(mc.num_parameters()), mc.hidden_size, mc.num_hidden_layers,
      mc.num_attention_heads, mc.head_dim, mc.num_key_value_heads, mc.intermediate_size,
      mc.vocab_size, mc.tie_word_embeddings ? "tied" : "untied", rope);
  s += fmt::format(
      "batch      micro {} x gas {} x world {} sequences of {} tokens = {} tokens per step\n",
      mo.micro_batch, gas_, world_size(), mo.seq_len, tokens_per_step());
  std::string precision(dtype_name(mo.param_dtype));
  if (cfg_.fp16.enabled.value()) {
    precision += cfg_.fp16.dynamic_loss_scale()
                     ? fmt::format(", dynamic loss scale from 2^{}", cfg_.fp16.initial_scale_power)
                     : fmt::format(", static loss scale {}", cfg_.fp16.loss_scale);
  }
  s += fmt::format("precision  {} parameters, fp32 master weights and gradients, {} Adam moments\n",
                   precision, config::adam_moments_bf16(cfg_) ? "bf16" : "fp32");
  const auto betas = opt.betas.value();
  // OneCycle with cycle_momentum sets both betas at every step (the metrics carry beta1).
  const std::optional<Betas> cycled = schedule_->betas();
  s += fmt::format(
      "optimizer  {} lr {:g}, betas {}, eps {:g}, weight decay {:g} ({}), "
      "gradient clipping {}\n",
      config::to_string(opt.type), opt.lr.value(),
      cycled ? fmt::format("set by {} (beta2 {:g}; the config's betas do not apply)",
                           schedule_->name(), cycled->beta2)
             : fmt::format("({:g}, {:g})", betas[0], betas[1]),
      opt.eps.value(), opt.weight_decay.value(), opt.decoupled_weight_decay() ? "decoupled" : "L2",
      cfg_.gradient_clipping.value() > 0 ? fmt::format("{:g}", cfg_.gradient_clipping.value())
                                         : std::string("off"));
  s += fmt::format("schedule   {}, first lr {:g}\n", schedule_->name(), schedule_->lr());
  s += fmt::format(
      "zero       stage {}, parameters {}, optimizer state {}, activation checkpointing {}{}\n",
      z.stage,
      z.stage == 3 ? offload_text(z.offload_param.device, z.offload_param.nvme_path)
                   : std::string("device (full copy)"),
      // NVMe optimizer state needs stage 3: below it, the state is where the plan puts it (a
      // warning says so at start).
      z.offload_optimizer.device == config::OffloadDevice::kNvme &&
              engine_->plan().placement.optimizer != zero::Tier::kNvme
          ? fmt::format("{} (offload_optimizer nvme needs stage 3)",
                        zero::tier_name(engine_->plan().placement.optimizer))
          : offload_text(z.offload_optimizer.device, z.offload_optimizer.nvme_path),
      mo.activation_checkpointing ? "on" : "off",
      cfg_.activation_checkpointing.cpu_checkpointing ? " (checkpoints in host memory)"
      : !mo.activation_checkpointing || opts_.activation_checkpointing ? ""
      : cfg_.activation_checkpointing.partition_activations
          ? " (activation_checkpointing.partition_activations in the config)"
          : " (activation_checkpointing.number_checkpoints in the config)");
  if (world_size() > 1)
    s += fmt::format(
        "ranks      {} data-parallel ranks over {} (this is rank {}), each with its "
        "own device, swap directory rank<r>/ and slice of every batch\n",
        world_size(), comm().name(), rank());
  s += fmt::format(
      "device     {}, budget {}\n", device().name(),
      cfg_.outcore.device_memory_mb > 0
          ? fmt::format("{} MiB (outcore.device_memory_mb)", cfg_.outcore.device_memory_mb)
          : std::string("unlimited"));
  s += fmt::format("train data {}\n", data_text(*train_loader_));
  if (val_loader_) s += fmt::format("val data   {}\n", data_text(*val_loader_));
  s += fmt::format("run        {} steps, seed {}\n", opts_.steps, opts_.seed);
  const double share = cfg_.zero_optimization.offload_optimizer.cpuadam_cores_perc;
  s += fmt::format("cpu        {} threads for CPU Adam, {} for gradient sums and norms{}\n",
                   engine_->cpu_threads(), engine_->data_threads(),
                   share < 1 ? fmt::format(" ({:g} of {} hardware threads: cpuadam_cores_perc)",
                                           share, std::thread::hardware_concurrency())
                             : std::string());
  const aio::BackendChoice io = aio::resolve_backend();
  s += fmt::format(
      "aio        {} backend{}{}\n", io.name(), io.forced ? " (" + io.forced_by + ")" : "",
      io.fallback_reason.empty() ? std::string()
                                 : " (io_uring unavailable: " + io.fallback_reason + ")");
  if (!resumed_from_.empty())
    s += fmt::format("resume     from {} at step {} (data epoch {}, micro-batch {}){}\n",
                     resumed_from_, steps_done_, train_loader_->position().epoch,
                     train_loader_->position().step,
                     steps_done_ >= opts_.steps ? ": that is --steps, nothing left to train" : "");
  if (!opts_.init_from.empty()) s += fmt::format("init       weights from {}\n", opts_.init_from);
  if (save_dir_)
    s += fmt::format("checkpoint {} {}, keep {}\n", save_dir_->path().string(),
                     opts_.save_every > 0
                         ? fmt::format("every {} steps and at the end", opts_.save_every)
                         : std::string("at the end"),
                     opts_.keep > 0 ? std::to_string(opts_.keep) : std::string("all"));
  else
    s += "checkpoint none: this run saves nothing (outcore train saves with --save-dir)\n";
  // The plan with the limits it was checked against at start (now the swap files exist and
  // take part of the space they were checked against).
  const zero::Plan& plan = engine_->plan();
  if (opts_.engine.check_system_limits) {
    s += zero::format_plan(plan, &engine_->limits());
  } else {
    s += zero::format_plan(plan);
  }
  return s;
}

nlohmann::ordered_json Trainer::start_record() const {
  nlohmann::ordered_json j;
  j["type"] = "start";
  j["steps"] = opts_.steps;
  j["seed"] = opts_.seed;
  j["seq_len"] = model_->options().seq_len;
  j["tokens_per_step"] = tokens_per_step();
  j["parameters"] = model_->config().num_parameters();
  j["train_flops_per_token"] = model_->config().train_flops_per_token(model_->options().seq_len);
  j["activation_checkpointing"] = model_->options().activation_checkpointing;
  j["train_data"] = opts_.train_data;
  if (!opts_.train_mask.empty()) j["train_mask"] = opts_.train_mask;
  if (val_loader_) j["val_data"] = val_loader_->file().path();
  if (val_loader_ && val_loader_->mask() != nullptr) j["val_mask"] = val_loader_->mask()->path();
  j["model"] = nlohmann::ordered_json::parse(model_->config().to_json());
  j["config"] = config::to_json(cfg_);
  if (!resumed_from_.empty()) {
    j["resumed_from"] = resumed_from_;
    j["resumed_at_step"] = steps_done_;
  }
  return j;
}

}  // namespace outcore::train
