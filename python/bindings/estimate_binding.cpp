// outcore._outcore.estimate: the placement plan of a DeepSpeed config and a model, computed as
// `outcore estimate` computes it (zero::estimate_model_options, make_plan, system_limits,
// check_fits), returned as a dict.
#include <fcntl.h>
#include <fmt/format.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <optional>
#include <string>

#include "common/error.hpp"
#include "engine/config/config.hpp"
#include "engine/model/model.hpp"
#include "engine/zero/plan.hpp"
#include "python/bindings/bindings.hpp"

namespace outcore::python {
namespace py = pybind11;

namespace {

// A config or model given either as a file path or as JSON text (`source` names it).
struct JsonInput {
  std::string path_or_text;
  bool is_path = true;
  std::string source;
};

config::ParsedConfig load_config(const JsonInput& in) {
  // A file that cannot be opened is IoError, as for the model's config.json (the docstring's
  // promise); what it holds, a FIFO in its place included, is the config's (ConfigError).
  if (in.is_path) {
    const int fd = ::open(in.path_or_text.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) {
      const int err = errno;
      throw IoError(in.path_or_text, err, "open the config file");
    }
    ::close(fd);
  }
  // The warnings are returned (estimate's "warnings"), not also logged.
  return in.is_path ? config::load_config_file(in.path_or_text, /*log_warnings=*/false)
                    : config::parse_config(in.path_or_text, in.source, /*log_warnings=*/false);
}

model::LlamaConfig load_model(const JsonInput& in) {
  return in.is_path ? model::LlamaConfig::load(in.path_or_text)
                    : model::LlamaConfig::from_json(in.path_or_text, in.source);
}

py::dict tier_bytes(const zero::TierBytes& t) {
  py::dict d;
  for (zero::Tier tier :
       {zero::Tier::kDevice, zero::Tier::kPinned, zero::Tier::kHost, zero::Tier::kNvme})
    d[py::str(std::string(zero::tier_name(tier)))] = t[tier];
  return d;
}

py::object optional_bytes(const std::optional<uint64_t>& v) {
  return v ? py::object(py::int_(*v)) : py::object(py::none());
}

py::dict plan_dict(const zero::Plan& plan, const zero::PlanLimits& limits) {
  const zero::Placement& pl = plan.placement;
  auto tier = [](zero::Tier t) { return std::string(zero::tier_name(t)); };
  py::dict placement;
  placement["stage"] = pl.stage;
  placement["param_dtype"] = std::string(dtype_name(pl.param_dtype));
  placement["params"] = tier(pl.params);
  placement["host_params"] = tier(pl.host_params);
  placement["host_param_units"] = pl.host_param_units;
  placement["nvme_param_units"] = pl.nvme_param_units;
  placement["optimizer"] = tier(pl.optimizer);
  placement["gradients"] = tier(pl.gradients);
  placement["optimizer_nvme_below_stage3"] = pl.optimizer_nvme_below_stage3;

  py::list items;
  for (const zero::PlanItem& it : plan.items) {
    py::dict d;
    d["tier"] = tier(it.tier);
    d["what"] = it.what;
    d["bytes"] = it.bytes;
    items.append(d);
  }
  py::dict traffic;
  traffic["nvme_read"] = plan.per_step.nvme_read;
  traffic["nvme_write"] = plan.per_step.nvme_write;
  traffic["h2d"] = plan.per_step.h2d;
  traffic["d2h"] = plan.per_step.d2h;

  py::dict budgets;
  budgets["device_live_param_bytes"] = plan.device_live_param_bytes;
  budgets["device_grad_bytes"] = plan.device_grad_bytes;
  budgets["pinned_pool_bytes"] = plan.pinned_pool_bytes;
  budgets["param_nvme_path"] = plan.param_nvme_path;
  budgets["optimizer_nvme_path"] = plan.optimizer_nvme_path;
  budgets["param_nvme_bytes"] = plan.param_nvme_bytes;
  budgets["optimizer_nvme_bytes"] = plan.optimizer_nvme_bytes;

  py::dict lim;
  lim["device"] = limits.device;
  lim["pinned"] = limits.pinned;
  lim["host"] = limits.host;
  lim["param_nvme"] = optional_bytes(limits.param_nvme);
  lim["optimizer_nvme"] = optional_bytes(limits.optimizer_nvme);
  lim["nvme_same_filesystem"] = limits.nvme_same_filesystem;

  py::dict d;
  d["placement"] = placement;
  d["world_size"] = plan.world_size;
  d["micro_batches_per_step"] = plan.micro_batches_per_step;
  d["tokens_per_micro_batch"] = plan.tokens_per_micro_batch;
  d["num_parameters"] = plan.num_parameters;
  d["padded_elems"] = plan.padded_elems;
  d["checkpoint_bytes"] = plan.checkpoint_bytes;
  d["peak"] = tier_bytes(plan.peak);
  d["items"] = items;
  d["per_step"] = traffic;
  d["budgets"] = budgets;
  d["limits"] = lim;
  d["table"] = zero::format_plan(plan, &limits);
  return d;
}

// `v` as an integer in min..max. InvalidArgument (ValueError) naming `name` otherwise, also
// for an int beyond 64 bits, which must not wrap into range. The message states the range as
// shown_min..max: 0 stands for "the default" where the caller passes it, never the user.
int64_t int_in_range(const py::int_& v, const char* name, int64_t min, int64_t max,
                     int64_t shown_min) {
  int overflow = 0;
  const long long x = PyLong_AsLongLongAndOverflow(v.ptr(), &overflow);
  if (x == -1 && PyErr_Occurred()) throw py::error_already_set();
  if (overflow != 0 || x < min || x > max)
    throw InvalidArgument(fmt::format("{}: got {}; allowed: an integer in {}..{}", name,
                                      std::string(py::str(py::handle(v))), shown_min, max));
  return x;
}

// micro_batch / seq_len 0: the config's train_micro_batch_size_per_gpu (else 1) / min(max
// position embeddings, 1024), as `outcore estimate` defaults them.
py::dict estimate(const JsonInput& cfg_in, const JsonInput& model_in, const py::int_& world,
                  const py::int_& micro, const py::int_& seq, bool activation_checkpointing) {
  const int64_t world_size = int_in_range(world, "world_size", 1, config::kMaxWorldSize, 1);
  const int64_t micro_batch = int_in_range(micro, "micro_batch", 0, config::kMaxMicroBatch, 1);
  const int64_t seq_len = int_in_range(seq, "seq_len", 0, model::kMaxConfigDim, 1);
  config::ParsedConfig parsed = load_config(cfg_in);
  config::Config& cfg = parsed.config;
  const model::LlamaConfig mc = load_model(model_in);
  const model::ModelOptions mo =
      zero::estimate_model_options(cfg, mc,
                                   {.world_size = world_size,
                                    .micro_batch = micro_batch,
                                    .seq_len = seq_len,
                                    .activation_checkpointing = activation_checkpointing});
  const model::LlamaModel model(mc, mo);

  // A run that saves checkpoints, as outcore estimate plans it.
  const zero::Plan plan = zero::make_plan(
      cfg, model, {.world_size = static_cast<int>(world_size), .save_piece_elems = 0});
  const zero::PlanLimits limits = zero::system_limits(cfg, plan);
  py::dict d = plan_dict(plan, limits);
  try {
    zero::check_fits(plan, limits);
    d["fits"] = true;
    d["does_not_fit"] = py::none();
  } catch (const OutOfMemory& e) {
    d["fits"] = false;
    d["does_not_fit"] = std::string(e.what());
  }
  py::list warnings;
  for (const config::ConfigWarning& w : parsed.warnings) warnings.append(w.to_string());
  d["warnings"] = warnings;
  return d;
}

}  // namespace

void bind_estimate(py::module_& m) {
  m.def(
      "estimate",
      [](const std::string& config, bool config_is_path, const std::string& model,
         bool model_is_path, const py::int_& world_size, const py::int_& micro_batch,
         const py::int_& seq_len, bool activation_checkpointing) {
        if (config_is_path) checked_path(config, "config");
        if (model_is_path) checked_path(model, "model");
        return estimate({config, config_is_path, "<config dict>"},
                        {model, model_is_path, "<model dict>"}, world_size, micro_batch, seq_len,
                        activation_checkpointing);
      },
      py::arg("config"), py::arg("config_is_path"), py::arg("model"), py::arg("model_is_path"),
      py::arg("world_size"), py::arg("micro_batch"), py::arg("seq_len"),
      py::arg("activation_checkpointing"));
}

}  // namespace outcore::python
