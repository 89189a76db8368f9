// ConfigIssue / ConfigValidationError formatting, enum names, unresolved-value errors.
#include "engine/config/config.hpp"

namespace outcore::config {
namespace {

std::string format_issues(const std::string& source, const std::vector<ConfigIssue>& issues) {
  std::string prefix = source.empty() ? "" : source + ": ";
  if (issues.size() == 1) return prefix + issues[0].to_string();
  std::string msg = prefix + std::to_string(issues.size()) + " errors:";
  for (const ConfigIssue& i : issues) msg += "\n  " + i.to_string();
  return msg;
}

}  // namespace

std::string message_naming_config_file(const ConfigError& e, const std::string& file) {
  const std::string what = e.what();
  if (file.empty() || e.json_path().empty() || what.find(file) != std::string::npos) return what;
  static const nlohmann::ordered_json keys = to_json(Config{});
  const std::string top = e.json_path().substr(0, e.json_path().find('.'));
  return keys.contains(top) ? file + ": " + what : what;
}

std::string ConfigIssue::to_string() const {
  return json_path.empty() ? message : json_path + ": " + message;
}

ConfigValidationError::ConfigValidationError(std::string source, std::vector<ConfigIssue> issues)
    : ConfigError("", format_issues(source, issues)),
      source_(std::move(source)),
      issues_(std::move(issues)) {}

void throw_unresolved(const char* path, bool is_auto) {
  if (is_auto) {
    throw ConfigError(path,
                      "is \"auto\" and was not resolved: set it in the config or give its "
                      "value on the command line");
  }
  throw ConfigError(path, "is not set: set it in the config or give its value on the command line");
}

std::string_view to_string(OptimizerType t) {
  switch (t) {
    case OptimizerType::kAdam:
      return "Adam";
    case OptimizerType::kAdamW:
      return "AdamW";
  }
  return "?";
}

std::string_view to_string(SchedulerType t) {
  switch (t) {
    case SchedulerType::kNone:
      return "none";
    case SchedulerType::kWarmupLR:
      return "WarmupLR";
    case SchedulerType::kWarmupDecayLR:
      return "WarmupDecayLR";
    case SchedulerType::kWarmupCosineLR:
      return "WarmupCosineLR";
    case SchedulerType::kOneCycle:
      return "OneCycle";
  }
  return "?";
}

std::string_view to_string(OffloadDevice d) {
  switch (d) {
    case OffloadDevice::kNone:
      return "none";
    case OffloadDevice::kCpu:
      return "cpu";
    case OffloadDevice::kNvme:
      return "nvme";
  }
  return "?";
}

std::string_view to_string(WarmupType t) { return t == WarmupType::kLog ? "log" : "linear"; }

DType compute_dtype(const Config& cfg) {
  if (cfg.outcore.compute_dtype == "fp32") return DType::F32;
  if (cfg.outcore.compute_dtype == "bf16") return DType::BF16;
  return cfg.bf16.enabled.value_or(false) ? DType::BF16 : DType::F32;
}

bool adam_moments_bf16(const Config& cfg) {
  return !cfg.optimizer.fp32_optimizer_states || cfg.bf16.bf16_optimizer_states;
}

}  // namespace outcore::config
