// "auto" resolution and DeepSpeed's batch-size arithmetic.
#include <fmt/format.h>

#include <string>
#include <string_view>

#include "engine/config/auto_fields.hpp"
#include "engine/config/config.hpp"

namespace outcore::config {
namespace {

using Issues = std::vector<ConfigIssue>;

constexpr const char* kBatchRule =
    "train_batch_size = train_micro_batch_size_per_gpu x gradient_accumulation_steps x world "
    "size";

// a * b, or nullopt on int64 overflow.
std::optional<int64_t> mul(int64_t a, int64_t b) {
  int64_t r;
  if (__builtin_mul_overflow(a, b, &r)) return std::nullopt;
  return r;
}

void batch_arithmetic(Config& cfg, int64_t world, Issues& errors) {
  auto known = [](const AutoOr<int64_t>& v) {
    return v.has_value() ? std::optional<int64_t>(v.value()) : std::nullopt;
  };
  std::optional<int64_t> b = known(cfg.train_batch_size);
  std::optional<int64_t> m = known(cfg.train_micro_batch_size_per_gpu);
  std::optional<int64_t> g = known(cfg.gradient_accumulation_steps);
  if (!b && !m) {
    if (cfg.train_batch_size.is_auto() || cfg.train_micro_batch_size_per_gpu.is_auto()) return;
    errors.push_back(
        {"train_batch_size", "missing: give train_batch_size or train_micro_batch_size_per_gpu (" +
                                 std::string(kBatchRule) + ")"});
    return;
  }
  auto fail = [&](std::string path, std::string msg) {
    errors.push_back({std::move(path), msg + " (" + kBatchRule + ")"});
  };
  if (b && m && !g) {
    auto per_step = mul(*m, world);
    if (!per_step || *b % *per_step != 0) {
      return fail("gradient_accumulation_steps",
                  fmt::format("cannot be inferred: train_batch_size {} is not a multiple of "
                              "micro {} x world {}",
                              *b, *m, world));
    }
    g = *b / *per_step;
  } else if (b && g && !m) {
    auto per_micro = mul(*g, world);
    if (!per_micro || *b % *per_micro != 0) {
      return fail("train_micro_batch_size_per_gpu",
                  fmt::format("cannot be inferred: train_batch_size {} is not a multiple of "
                              "gas {} x world {}",
                              *b, *g, world));
    }
    m = *b / *per_micro;
  } else if (b && !m) {
    g = 1;
    if (*b % world != 0) {
      return fail("train_micro_batch_size_per_gpu",
                  fmt::format("cannot be inferred: train_batch_size {} is not a multiple of "
                              "world {}",
                              *b, world));
    }
    m = *b / world;
  } else if (!b) {
    if (!g) g = 1;
  }
  if (*m > kMaxMicroBatch) {
    return fail(
        "train_micro_batch_size_per_gpu",
        fmt::format("is {}; allowed: at most {} sequences per micro-batch", *m, kMaxMicroBatch));
  }
  auto product = mul(*m, *g);
  if (product) product = mul(*product, world);
  if (!product) {
    return fail("train_batch_size",
                fmt::format("micro {} x gas {} x world {} overflows", *m, *g, world));
  }
  if (!b) b = *product;
  if (*b != *product) {
    return fail("train_batch_size",
                fmt::format("train_batch_size {} != micro {} x gas {} x world {} = {}", *b, *m, *g,
                            world, *product));
  }
  cfg.train_batch_size.set(*b);
  cfg.train_micro_batch_size_per_gpu.set(*m);
  cfg.gradient_accumulation_steps.set(*g);
}

template <typename T, typename U>
void fill(AutoOr<T>& v, const std::optional<U>& from) {
  if (v.is_auto() && from) v.set(static_cast<T>(*from));
}

template <typename T>
void fill_value(AutoOr<T>& v, T from) {
  if (v.is_auto()) v.set(from);
}

void check_context(const AutoContext& ctx, Issues& errors) {
  auto at_least = [&](std::string_view what, const std::optional<int64_t>& v, int64_t min) {
    if (v && *v < min) {
      errors.push_back({"", fmt::format("{} is {}; allowed: an integer >= {}", what, *v, min)});
    }
  };
  auto in_range = [&](std::string_view what, const std::optional<int64_t>& v, int64_t max) {
    if (v && (*v < 1 || *v > max)) {
      errors.push_back({"", fmt::format("{} is {}; allowed: an integer in 1..{}", what, *v, max)});
    }
  };
  in_range("the world size", ctx.world_size, kMaxWorldSize);
  at_least("the hidden size", ctx.hidden_size, 1);
  at_least("the train batch size", ctx.train_batch_size, 1);
  in_range("the micro batch size", ctx.micro_batch_size, kMaxMicroBatch);
  at_least("gradient accumulation steps", ctx.gradient_accumulation_steps, 1);
  at_least("the total number of steps", ctx.total_steps, 1);
  at_least("the number of warmup steps", ctx.warmup_steps, 1);
  auto non_negative = [&](std::string_view what, const std::optional<double>& v) {
    if (v && !(*v >= 0)) {
      errors.push_back({"", fmt::format("{} is {}; allowed: a number >= 0", what, *v)});
    }
  };
  non_negative("the learning rate", ctx.lr);
  non_negative("the weight decay", ctx.weight_decay);
  non_negative("the gradient clipping norm", ctx.gradient_clipping);
}

void resolve_scheduler(SchedulerConfig& s, const OptimizerConfig& opt, const AutoContext& ctx) {
  std::optional<double> lr = ctx.lr;
  if (!lr && opt.lr.has_value()) lr = opt.lr.value();
  switch (s.type) {
    case SchedulerType::kWarmupLR:
    case SchedulerType::kWarmupDecayLR:
      fill_value(s.warmup.warmup_min_lr, 0.0);
      fill(s.warmup.warmup_max_lr, lr);
      // WarmupLR without warmup_max_lr peaks at the optimizer's lr.
      if (s.warmup.warmup_max_lr.is_unset() && opt.lr.has_value()) {
        s.warmup.warmup_max_lr.set(opt.lr.value());
      }
      fill(s.warmup.warmup_num_steps, ctx.warmup_steps);
      fill(s.warmup.total_num_steps, ctx.total_steps);
      break;
    case SchedulerType::kWarmupCosineLR:
      fill(s.cosine.warmup_num_steps, ctx.warmup_steps);
      fill(s.cosine.total_num_steps, ctx.total_steps);
      break;
    case SchedulerType::kOneCycle:
    case SchedulerType::kNone:
      break;
  }
}

void resolve_zero(ZeroConfig& z, const std::optional<int64_t>& hidden, Issues& errors) {
  if (!hidden) return;
  auto h2 = mul(*hidden, *hidden);
  if (!h2) {
    errors.push_back({"", fmt::format("the hidden size {} is too large", *hidden)});
    return;
  }
  // The Hugging Face integration's formulas.
  fill_value(z.reduce_bucket_size, *h2);
  fill_value(z.stage3_prefetch_bucket_size, static_cast<int64_t>(0.9 * static_cast<double>(*h2)));
  fill_value(z.stage3_param_persistence_threshold, 10 * *hidden);
}

std::string hint(std::string_view path) {
  if (path == "train_batch_size" || path == "train_micro_batch_size_per_gpu" ||
      path == "gradient_accumulation_steps") {
    return "set a number in the config or give the batch sizes on the command line "
           "(--train-batch-size, --micro-batch-size, --gradient-accumulation-steps)";
  }
  if (path == "optimizer.params.lr" || path == "scheduler.params.warmup_max_lr") {
    return "set a number in the config or give the learning rate on the command line (--lr)";
  }
  if (path == "scheduler.params.total_num_steps") {
    return "set a number in the config or give the number of training steps (--total-steps)";
  }
  if (path == "scheduler.params.warmup_num_steps") {
    return "set a number in the config or give the number of warmup steps (--warmup-steps)";
  }
  if (path.starts_with("zero_optimization.")) {
    return "set a number in the config or give the model's hidden size (--hidden-size)";
  }
  return "set a value in the config";
}

}  // namespace

void resolve_batch_sizes(Config& cfg, int64_t world_size) {
  Issues errors;
  if (world_size < 1 || world_size > kMaxWorldSize) {
    errors.push_back({"", fmt::format("the world size is {}; allowed: an integer in 1..{}",
                                      world_size, kMaxWorldSize)});
  } else {
    batch_arithmetic(cfg, world_size, errors);
  }
  if (!errors.empty()) throw ConfigValidationError("", std::move(errors));
}

void resolve_auto(Config& cfg, const AutoContext& ctx) {
  Issues errors;
  check_context(ctx, errors);
  if (!errors.empty()) throw ConfigValidationError("", std::move(errors));

  // The batch sizes the config leaves out are the command line's too (the batch arithmetic
  // then checks them with the ones it sets).
  auto fill_batch = [](AutoOr<int64_t>& v, const std::optional<int64_t>& from) {
    if ((v.is_auto() || v.is_unset()) && from) v.set(*from);
  };
  fill_batch(cfg.train_batch_size, ctx.train_batch_size);
  fill_batch(cfg.train_micro_batch_size_per_gpu, ctx.micro_batch_size);
  fill_batch(cfg.gradient_accumulation_steps, ctx.gradient_accumulation_steps);
  fill_value(cfg.gradient_clipping, ctx.gradient_clipping.value_or(1.0));
  fill_value(cfg.fp16.enabled, ctx.fp16.value_or(false));
  fill_value(cfg.bf16.enabled, ctx.bf16.value_or(false));
  if (cfg.fp16.enabled.value_or(false) && cfg.bf16.enabled.value_or(false)) {
    errors.push_back({"bf16.enabled",
                      "true while fp16.enabled is also true; allowed: at most "
                      "one of fp16 and bf16 enabled"});
  }

  OptimizerConfig& opt = cfg.optimizer;
  fill(opt.lr, ctx.lr);
  fill_value(opt.betas, std::array<double, 2>{0.9, 0.999});
  fill_value(opt.eps, 1e-8);
  fill_value(opt.weight_decay, ctx.weight_decay.value_or(0.0));
  resolve_scheduler(cfg.scheduler, opt, ctx);
  resolve_zero(cfg.zero_optimization, ctx.hidden_size, errors);
  batch_arithmetic(cfg, ctx.world_size, errors);
  if (!errors.empty()) throw ConfigValidationError("", std::move(errors));
}

std::vector<std::string> unresolved_auto(const Config& cfg) {
  std::vector<std::string> paths;
  detail::for_each_auto(cfg, [&](const auto& v) {
    if (v.is_auto()) paths.emplace_back(v.path());
  });
  return paths;
}

void require_resolved(const Config& cfg) {
  Issues errors;
  detail::for_each_auto(cfg, [&](const auto& v) {
    if (v.is_auto()) {
      errors.push_back({v.path(), "still \"auto\": " + hint(v.path())});
    } else if (v.is_unset()) {
      errors.push_back({v.path(), "not set: " + hint(v.path())});
    }
  });
  if (!errors.empty()) throw ConfigValidationError("", std::move(errors));
}

}  // namespace outcore::config
