// The plan against the machine: limits from the config and the system, the fit check and the
// table `outcore estimate` prints.
#include <fmt/format.h>
#include <linux/magic.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/vfs.h>

#include <algorithm>
#include <cerrno>
#include <filesystem>
#include <fstream>
#include <initializer_list>
#include <sstream>
#include <string>
#include <utility>

#include "common/error.hpp"
#include "engine/zero/geometry.hpp"
#include "engine/zero/plan.hpp"

namespace outcore::zero {
namespace {

namespace fs = std::filesystem;

// The directory itself, or its nearest existing ancestor (swap directories are made at start).
fs::path existing_ancestor(const fs::path& dir) {
  fs::path p = fs::absolute(dir);
  std::error_code ec;
  while (!fs::exists(p, ec) && p.has_parent_path() && p != p.parent_path()) p = p.parent_path();
  return p;
}

struct FsInfo {
  uint64_t free_bytes = 0;
  dev_t device = 0;
};

// `key`: the config key that names `dir`, for the error when its filesystem stores no files.
FsInfo fs_info(const std::string& dir, const char* key) {
  const fs::path p = existing_ancestor(dir);
  struct statvfs sv {};
  if (::statvfs(p.c_str(), &sv) != 0) throw IoError(p.string(), errno, "statvfs");
  // A filesystem of no blocks that is not ramfs (which counts none): /proc, /sys, cgroups.
  struct statfs sf {};
  if (sv.f_blocks == 0 && ::statfs(p.c_str(), &sf) == 0 && sf.f_type != RAMFS_MAGIC)
    throw ConfigError(key, fmt::format("{}: {} is on a filesystem that stores no files (such as "
                                       "/proc or /sys); give a directory on a drive",
                                       dir, p.string()));
  struct stat st {};
  if (::stat(p.c_str(), &st) != 0) throw IoError(p.string(), errno, "stat");
  return {static_cast<uint64_t>(sv.f_bavail) * sv.f_frsize, st.st_dev};
}

// A need and a limit in the same unit, with as many decimals as they take to differ (a need
// just above its limit would read "53.0 MiB ... allows 53.0 MiB" otherwise).
std::pair<std::string, std::string> format_apart(uint64_t need, uint64_t limit) {
  const uint64_t larger = std::max(need, limit);
  const int shift = larger >= (1ull << 30) ? 30 : larger >= (1ull << 20) ? 20 : 10;
  if (larger < 1024 || need == limit) return {format_bytes(need), format_bytes(limit)};
  const std::string_view unit = shift == 30 ? "GiB" : shift == 20 ? "MiB" : "KiB";
  const double scale = static_cast<double>(1ull << shift);
  for (int decimals = shift == 30 ? 2 : 1;; ++decimals) {
    std::string a = fmt::format("{:.{}f} {}", static_cast<double>(need) / scale, decimals, unit),
                b = fmt::format("{:.{}f} {}", static_cast<double>(limit) / scale, decimals, unit);
    if (a != b || decimals == 9) return {std::move(a), std::move(b)};
  }
}

[[noreturn]] void refuse(std::string_view tier, uint64_t need, std::string_view what,
                         uint64_t limit, std::string_view by, std::string_view cause = {}) {
  const auto [need_text, limit_text] = format_apart(need, limit);
  throw OutOfMemory(
      fmt::format("{}: {} needs {} ({} bytes) at its peak but {} allows {} ({} bytes){}", tier,
                  what, need_text, need, by, limit_text, limit, cause));
}

// When the largest part of what `tiers` hold (the items, and with `with_pool` the pinned pool
// beyond the pinned peak) is sized by a config key: "; the largest part, <what> (<bytes>), is
// set by <key>". Empty otherwise: the model, not a setting, is what does not fit.
std::string keyed_cause(const Plan& plan, std::initializer_list<Tier> tiers, bool with_pool) {
  PlanItem largest;
  for (const PlanItem& it : plan.items)
    if (std::find(tiers.begin(), tiers.end(), it.tier) != tiers.end() && it.bytes > largest.bytes)
      largest = it;
  if (with_pool && plan.pinned_pool_bytes > plan.peak.pinned &&
      plan.pinned_pool_bytes - plan.peak.pinned > largest.bytes)
    largest = {Tier::kPinned, "pinned pool beyond what the plan uses",
               plan.pinned_pool_bytes - plan.peak.pinned, "outcore.pinned_memory_mb"};
  if (largest.key.empty()) return "";
  return fmt::format("; the largest part, {} ({}), is set by {}", largest.what,
                     format_bytes(largest.bytes), largest.key);
}

}  // namespace

std::string format_bytes(uint64_t bytes) {
  const double b = static_cast<double>(bytes);
  if (bytes >= (1ull << 30)) return fmt::format("{:.2f} GiB", b / double(1ull << 30));
  if (bytes >= (1ull << 20)) return fmt::format("{:.1f} MiB", b / double(1ull << 20));
  if (bytes >= (1ull << 10)) return fmt::format("{:.1f} KiB", b / 1024.0);
  return fmt::format("{} B", bytes);
}

PlanLimits system_limits(const config::Config& cfg, const Plan& plan) {
  PlanLimits l;
  l.device = cfg.outcore.device_memory_mb << 20;
  l.pinned = cfg.outcore.pinned_memory_mb << 20;
  const detail::HostMemory host = detail::host_memory_available();
  l.host = host.bytes;
  l.host_by = host.by;
  std::optional<FsInfo> pi, oi;
  if (!plan.param_nvme_path.empty()) {
    pi = fs_info(plan.param_nvme_path, "zero_optimization.offload_param.nvme_path");
    l.param_nvme = pi->free_bytes;
  }
  if (!plan.optimizer_nvme_path.empty()) {
    oi = fs_info(plan.optimizer_nvme_path, "zero_optimization.offload_optimizer.nvme_path");
    l.optimizer_nvme = oi->free_bytes;
  }
  l.nvme_same_filesystem = pi && oi && pi->device == oi->device;
  return l;
}

void apply_machine(PlanLimits& limits, const PlanOptions& po) {
  if (po.host_memory_bytes > 0) {
    limits.host = po.host_memory_bytes;
    limits.host_by = "--host-memory-gb";
  }
  if (po.nvme_free_bytes > 0) {
    limits.param_nvme = limits.optimizer_nvme = po.nvme_free_bytes;
    limits.nvme_same_filesystem = true;
    limits.nvme_by = "--nvme-free-gb";
  }
}

void check_fits(const Plan& plan, const PlanLimits& limits) {
  // Disk first: a swap path without room is the most common start-up failure.
  // outcore.step_in_backward keeps a spare copy of the NVMe optimizer state: named when it is
  // part of what does not fit.
  const std::string spare =
      plan.step_in_backward && plan.placement.optimizer == Tier::kNvme
          ? " (outcore.step_in_backward keeps a second copy of the optimizer state's files)"
          : "";
  auto nvme = [&](const std::string& path, uint64_t need, std::optional<uint64_t> free_bytes,
                  bool optimizer) {
    if (!free_bytes) return;
    const uint64_t free = *free_bytes;
    if (need <= free) return;
    const auto [need_text, free_text] = format_apart(need, free);
    throw OutOfMemory(fmt::format(
        "nvme: swap files under {} need {} ({} bytes) but {} {} ({} bytes){}", path, need_text,
        need, limits.nvme_by.empty() ? "the filesystem has" : limits.nvme_by + " gives", free_text,
        free,
        (limits.nvme_by.empty() ? " free" : "") + std::string(optimizer ? spare : "") +
            (optimizer && !plan.sub_group_padding.empty() ? "; " + plan.sub_group_padding : "")));
  };
  // The files, and the directories and lock files made before them.
  const uint64_t param_need = plan.param_nvme_bytes + plan.param_nvme_tree_bytes;
  const uint64_t optimizer_need = plan.optimizer_nvme_bytes + plan.optimizer_nvme_tree_bytes;
  if (limits.nvme_same_filesystem) {
    nvme(plan.param_nvme_path == plan.optimizer_nvme_path
             ? plan.param_nvme_path
             : plan.param_nvme_path + " and " + plan.optimizer_nvme_path,
         param_need + optimizer_need, limits.param_nvme, true);
  } else {
    if (!plan.param_nvme_path.empty())
      nvme(plan.param_nvme_path, param_need, limits.param_nvme, false);
    if (!plan.optimizer_nvme_path.empty())
      nvme(plan.optimizer_nvme_path, optimizer_need, limits.optimizer_nvme, true);
  }

  if (limits.device > 0 && plan.peak.device > limits.device)
    refuse("device", plan.peak.device, "the plan", limits.device, limits.device_by,
           keyed_cause(plan, {Tier::kDevice}, false));
  if (limits.pinned > 0 && plan.peak.pinned > limits.pinned)
    refuse("pinned", plan.peak.pinned, "the pinned host pool", limits.pinned,
           "outcore.pinned_memory_mb", keyed_cause(plan, {Tier::kPinned}, false));
  const uint64_t host = host_need_bytes(plan);
  if (limits.host > 0 && host > limits.host)
    refuse("host", host,
           plan.device_in_host_memory
               ? "host memory (pinned pool + other host buffers + the simulated device's memory)"
               : "host memory (pinned pool + other host buffers)",
           limits.host, limits.host_by,
           plan.device_in_host_memory
               ? keyed_cause(plan, {Tier::kPinned, Tier::kHost, Tier::kDevice}, true)
               : keyed_cause(plan, {Tier::kPinned, Tier::kHost}, true));
}

uint64_t host_need_bytes(const Plan& plan) {
  return plan.peak.host + std::max(plan.peak.pinned, plan.pinned_pool_bytes) +
         (plan.device_in_host_memory ? plan.peak.device : 0);
}

std::string format_plan(const Plan& plan, const PlanLimits* limits) {
  const Placement& p = plan.placement;
  std::ostringstream out;
  out << fmt::format(
      "ZeRO stage {}, {} parameters, world size {}, {} tokens per micro-batch, {} micro-batch(es) "
      "per step\n",
      p.stage, dtype_name(p.param_dtype), plan.world_size, plan.tokens_per_micro_batch,
      plan.micro_batches_per_step);
  out << fmt::format("model: {} parameters ({} padded elements)\n", plan.num_parameters,
                     plan.padded_elems);
  std::string params(tier_name(p.params));
  if (p.params == Tier::kNvme)
    params +=
        fmt::format(" ({} units in {} memory by offload_param.max_in_cpu, {} in swap files)",
                    p.host_param_units, p.host_params == Tier::kPinned ? "pinned host" : "host",
                    p.nvme_param_units);
  std::string optimizer(tier_name(p.optimizer));
  if (p.optimizer != Tier::kDevice && p.device_optimizer_from == 0)
    optimizer = fmt::format("device (offload_optimizer.ratio {}: none of {} elements offloaded)",
                            plan.optimizer_ratio, plan.optimizer_elems);
  else if (p.optimizer != Tier::kDevice && p.device_optimizer_from != SIZE_MAX)
    optimizer += fmt::format(
        " for units 0..{}, device from unit {} (offload_optimizer.ratio {}: {} of {} elements "
        "offloaded)",
        p.device_optimizer_from - 1, p.device_optimizer_from, plan.optimizer_ratio,
        plan.offloaded_optimizer_elems, plan.optimizer_elems);
  // Gradients kept on a device the host cannot read for Adam there (decision 037).
  size_t kept = 0;
  for (size_t u = 0; u < plan.device_grad_sums.size(); ++u)
    kept += !plan.device_host_accessible && plan.device_grad_sums[u] &&
            p.optimizer_home(u) == Tier::kDevice;
  std::string gradients(tier_name(p.gradients));
  if (kept > 0 && kept == plan.device_grad_sums.size())
    gradients = "device (kept there for Adam on the device)";
  else if (kept > 0)
    gradients += fmt::format(", device for {} unit{} (kept there for Adam on the device)", kept,
                             kept == 1 ? "" : "s");
  out << fmt::format("placement: parameters {}, optimizer state {}, gradient accumulators {}\n\n",
                     params, optimizer, gradients);
  out << fmt::format("{:<7} {:<66} {:>12}\n", "tier", "holds at its peak", "bytes");
  for (int t = 0; t < kNumTiers; ++t) {
    const Tier tier = static_cast<Tier>(t);
    for (const PlanItem& it : plan.items)
      if (it.tier == tier)
        out << fmt::format("{:<7} {:<66} {:>12}\n", tier_name(tier), it.what,
                           format_bytes(it.bytes));
    uint64_t limit = 0;
    std::string by;
    if (limits != nullptr) {
      switch (tier) {
        case Tier::kDevice:
          limit = limits->device, by = limits->device_by;
          break;
        case Tier::kPinned:
          limit = limits->pinned, by = "outcore.pinned_memory_mb";
          break;
        case Tier::kHost:
          limit = limits->host, by = limits->host_by;
          break;
        case Tier::kNvme:
          limit = limits->nvme_same_filesystem
                      ? limits->param_nvme.value_or(0)
                      : limits->param_nvme.value_or(0) + limits->optimizer_nvme.value_or(0);
          by = limits->nvme_by.empty() ? "free on the swap filesystem(s)" : limits->nvme_by;
          break;
      }
    }
    const uint64_t need = tier == Tier::kHost ? host_need_bytes(plan) : plan.peak[tier];
    std::string verdict;
    // Host memory holds the pinned pool too (the pinned peak, or the pool's size where that is
    // larger), and the simulated device's memory: the figure compared is then all of them.
    const std::string compared =
        need != plan.peak[tier]
            ? fmt::format(" for host + pinned pool{} {}",
                          plan.device_in_host_memory && plan.peak.device > 0 ? " + device" : "",
                          format_bytes(need))
            : "";
    if (limit > 0)
      verdict = fmt::format("  limit {} ({}){}: {}", format_bytes(limit), by, compared,
                            need <= limit ? "fits" : "DOES NOT FIT");
    else if (limits != nullptr)
      verdict = "  no limit";
    out << fmt::format("{:<7} {:<66} {:>12}{}\n", tier_name(tier), "= total",
                       format_bytes(plan.peak[tier]), verdict);
  }
  if (!plan.sub_group_padding.empty()) out << "note: " << plan.sub_group_padding << "\n";
  const TrafficBytes& t = plan.per_step;
  out << fmt::format(
      "\nper optimizer step: nvme read {}, nvme write {}, host->device {}, device->host {}\n",
      format_bytes(t.nvme_read), format_bytes(t.nvme_write), format_bytes(t.h2d),
      format_bytes(t.d2h));
  if (plan.world_size > 1)
    out << fmt::format(
        "per rank per step: {} sent to the other {} ranks (gradients, parameter "
        "gathers, norm)\n",
        format_bytes(t.comm), plan.world_size - 1);
  out << fmt::format(
      "a checkpoint (--save-dir): {} (fp32 master weights, Adam moments and the parameters; "
      "--keep N keeps N)\n",
      format_bytes(plan.checkpoint_bytes));
  return out.str();
}

}  // namespace outcore::zero
