#include "engine/zero/geometry.hpp"

#include <fmt/format.h>
#include <sys/resource.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <optional>
#include <string>
#include <string_view>
#include <thread>

#include "common/error.hpp"
#include "common/log.hpp"
#include "engine/device/device.hpp"

namespace outcore::zero::detail {

using config::OffloadDevice;
using device::charged_bytes;

namespace {

// stage3_param_persistence_threshold when the config leaves it unset (DeepSpeed's default).
constexpr int64_t kDefaultParamPersistenceThreshold = 100'000;

// Copies of each sub-group an optimizer swap file holds: one, or two when units may step
// during the backward into a spare copy (outcore.step_in_backward).
constexpr unsigned kOptimizerCopies = 1;
constexpr unsigned kOptimizerCopiesWithSpare = 2;

}  // namespace

bool pool_page_locked(const config::ZeroConfig& z) {
  const bool params_offloaded = z.stage == 3 && z.offload_param.device != OffloadDevice::kNone;
  return (!params_offloaded || z.offload_param.pin_memory) &&
         (z.offload_optimizer.device == OffloadDevice::kNone || z.offload_optimizer.pin_memory);
}

Placement resolve_placement(const config::Config& cfg, const model::LlamaModel& model) {
  const config::ZeroConfig& z = cfg.zero_optimization;
  Placement p;
  p.stage = z.stage;
  if (p.stage < 0 || p.stage > 3)
    throw ConfigError("zero_optimization.stage",
                      fmt::format("got {}; allowed: 0, 1, 2 or 3", p.stage));
  const bool fp16 = cfg.fp16.enabled.value_or(false);
  const bool bf16 = cfg.bf16.enabled.value_or(false);
  const DType want = fp16 ? DType::F16 : bf16 ? DType::BF16 : DType::F32;
  const DType have = model.options().param_dtype;
  if (have != want)
    throw ConfigError(fp16 ? "fp16.enabled" : "bf16.enabled",
                      fmt::format("the config trains in {} but the model was built with {} "
                                  "parameters",
                                  dtype_name(want), dtype_name(have)));
  p.param_dtype = want;

  const OffloadDevice param_dev = z.offload_param.device;
  // offload_param below stage 3 and offload_optimizer at stage 0 are ignored, as the config's
  // parse says (config::check_offload_stage).
  if (p.stage < 3) {
    p.params = Tier::kDevice;
  } else if (param_dev == OffloadDevice::kNone) {
    p.params = Tier::kDevice;
  } else if (param_dev == OffloadDevice::kCpu) {
    p.params = pool_page_locked(z) ? Tier::kPinned : Tier::kHost;
  } else {
    p.params = Tier::kNvme;
  }

  const OffloadDevice opt_dev = z.offload_optimizer.device;
  if (p.stage == 0) {
    p.optimizer = Tier::kDevice;
  } else if (opt_dev == OffloadDevice::kNone) {
    p.optimizer = Tier::kDevice;
  } else if (opt_dev == OffloadDevice::kCpu) {
    p.optimizer = Tier::kHost;
  } else if (p.stage < 3) {
    // As DeepSpeed (and engine/config, which warns): swap files need stage 3; below it the
    // state stays in host memory as with "cpu".
    p.optimizer = Tier::kHost;
    p.optimizer_nvme_below_stage3 = true;
  } else {
    p.optimizer = Tier::kNvme;
  }
  p.gradients = p.optimizer == Tier::kDevice ? Tier::kDevice : Tier::kHost;
  return p;
}

namespace {

// offload_param.max_in_cpu: the longest prefix of units whose partitions fit together stays
// in host memory (DeepSpeed keeps up to max_in_cpu elements of partitions in CPU buffers).
// offload_param.buffer_size keeps DeepSpeed's contract: it must hold the largest parameter
// tensor's partition left in swap files (DeepSpeed swaps tensor by tensor), so every config
// DeepSpeed accepts is accepted; outcore's fetch buffers hold a whole unit's partition and are
// sized to it whatever buffer_size says.
void split_param_homes(const config::Config& cfg, const model::ModelLayout& layout, int world,
                       Geometry& g) {
  const config::OffloadParamConfig& o = cfg.zero_optimization.offload_param;
  Placement& p = g.placement;
  p.host_params = pool_page_locked(cfg.zero_optimization) ? Tier::kPinned : Tier::kHost;
  const uint64_t max_in_cpu = static_cast<uint64_t>(std::max<int64_t>(0, o.max_in_cpu));
  uint64_t in_cpu = 0;
  size_t host = 0;
  while (host < g.units.size() && in_cpu + g.units[host].part <= max_in_cpu)
    in_cpu += g.units[host++].part;
  p.host_param_units = host;
  p.nvme_param_units = g.units.size() - host;
  uint64_t largest_tensor = 0;
  std::string largest_name;
  for (size_t u = host; u < g.units.size(); ++u) {
    g.max_nvme_part = std::max(g.max_nvme_part, g.units[u].part);
    for (const model::TensorSpec& t : layout.units[u].tensors) {
      const uint64_t part = (t.numel + static_cast<uint64_t>(world) - 1) / world;
      if (part > largest_tensor) largest_tensor = part, largest_name = t.name;
    }
  }
  if (p.nvme_param_units > 0 && static_cast<uint64_t>(o.buffer_size) < largest_tensor)
    throw ConfigError(
        "zero_optimization.offload_param.buffer_size",
        fmt::format("got {}; a parameter swap buffer must hold the largest parameter partition "
                    "in a swap file, as in DeepSpeed: {} elements ({}); allowed: >= {}",
                    o.buffer_size, largest_tensor, largest_name, largest_tensor));
}

// offload_param keys set to a value that changes nothing (outcore sizes fetch buffers exactly).
void warn_unused_offload_param_keys(const config::Config& cfg, const Geometry& g) {
  const config::OffloadParamConfig& o = cfg.zero_optimization.offload_param;
  const config::OffloadParamConfig defaults;
  const Placement& p = g.placement;
  if (p.stage != 3) return;  // the whole section is ignored, with its own warning
  if (o.buffer_size != defaults.buffer_size) {
    if (p.nvme_param_units > 0)
      log::warn(
          "zero_optimization.offload_param.buffer_size {} has no effect beyond the check that "
          "it holds the largest parameter tensor's partition in a swap file: outcore sizes "
          "each fetch buffer to the largest unit partition ({} elements) exactly",
          o.buffer_size, g.max_nvme_part);
    else
      log::warn(
          "zero_optimization.offload_param.buffer_size {} has no effect: no parameter "
          "partition is in a swap file",
          o.buffer_size);
  }
  // max_in_cpu without swap files: said by the config's parse (config::keys_without_effect).
}

// offload_optimizer.pipeline_read reads a unit's next optimizer sub-group into another buffer
// while one is stepped (OptimizerSwapper). Where no unit with state in swap files has two
// sub-groups and two buffers it changes nothing (the units' steps still overlap two at a
// time): said once here. (pipeline_write acts even then: it leaves the writes of the state's
// initialisation in flight.)
void warn_unused_read_ahead(const config::Config& cfg, const Geometry& g) {
  const config::OffloadOptimizerConfig& o = cfg.zero_optimization.offload_optimizer;
  if (!o.pipeline_read) return;
  const uint64_t buffers = static_cast<uint64_t>(std::max<int64_t>(1, o.buffer_count));
  uint64_t largest = 0;  // own elements of the largest unit with its state in swap files
  for (size_t u = 0; u < g.units.size(); ++u) {
    if (g.placement.optimizer_home(u) != Tier::kNvme) continue;
    const uint64_t n = g.units[u].own_len;
    if (buffers >= 2 && n > g.sub_group_size) return;  // two sub-groups, two buffers: it acts
    largest = std::max(largest, n);
  }
  if (largest == 0) return;  // no optimizer state in swap files: said by the config's parse
  const std::string why =
      buffers < 2
          ? fmt::format("offload_optimizer.buffer_count is {}: a second buffer is needed", buffers)
          : fmt::format(
                "each unit's optimizer state in swap files is one sub-group: "
                "zero_optimization.sub_group_size {} is not below the {} elements of the largest "
                "of them on this rank",
                g.sub_group_size, largest);
  log::warn(
      "zero_optimization.offload_optimizer.pipeline_read has no effect in this run: it reads "
      "the next sub-group of a unit's optimizer state while one is stepped, and {}; the units' "
      "optimizer steps overlap each other all the same",
      why);
}

// offload_optimizer.ratio < 1 at stage 3 with offload_optimizer cpu or nvme (DeepSpeed's
// partial offload): sets g.placement.device_optimizer_from, the first unit whose optimizer
// state stays on the device. The units before it are the longest prefix whose own elements
// are at most ratio x all own elements (ratio 0: none; ratio 1: all). With offload none and a
// ratio < 1 it changes nothing.
void split_optimizer_homes(const config::Config& cfg, Geometry& g) {
  const double ratio = cfg.zero_optimization.offload_optimizer.ratio;
  Placement& p = g.placement;
  if (!(ratio < 1.0) || p.stage != 3) return;  // ignored below stage 3, as in DeepSpeed
  if (p.optimizer == Tier::kDevice) return;    // said by the config's parse (keys_without_effect)
  uint64_t total = 0;
  for (const UnitGeometry& u : g.units) total += u.own_len;
  const double offload = ratio * static_cast<double>(total);
  uint64_t offloaded = 0;
  size_t k = 0;
  while (k < g.units.size() && static_cast<double>(offloaded + g.units[k].own_len) <= offload)
    offloaded += g.units[k++].own_len;
  p.device_optimizer_from = k;
}

// A ratio above 0 whose share is smaller than the first unit offloads nothing: said once (the
// plan's placement line says it too), as ratio 0 is by the config's parse.
void warn_ratio_offloading_nothing(const config::Config& cfg, const Geometry& g) {
  const double ratio = cfg.zero_optimization.offload_optimizer.ratio;
  const Placement& p = g.placement;
  if (!(ratio > 0.0 && ratio < 1.0) || p.stage != 3 || p.optimizer == Tier::kDevice ||
      p.device_optimizer_from != 0 || g.units.empty())
    return;
  uint64_t total = 0;
  for (const UnitGeometry& u : g.units) total += u.own_len;
  log::warn(
      "zero_optimization.offload_optimizer.ratio {} offloads no unit's optimizer state: the "
      "first unit's {} elements are more than {} x the {} of all units on this rank, so all of "
      "it stays on the device (as with ratio 0, where the keys that shape optimizer swap files "
      "have no effect); raise the ratio to offload some",
      ratio, g.units.front().own_len, ratio, total);
}

// With the optimizer state on NVMe, the gradient accumulators go to swap files for kNvme, and
// for kAuto when they would take more than a quarter of the available host memory (`host`, or
// this machine's where 0); else they stay where resolve_placement put them.
void place_gradients(GradientPlacement gradients, uint64_t host, Geometry& g) {
  if (g.placement.optimizer != Tier::kNvme || gradients == GradientPlacement::kHost) return;
  uint64_t bytes = 0;
  for (const UnitGeometry& u : g.units) bytes += u.accum_len * sizeof(float);
  const uint64_t avail = gradients != GradientPlacement::kAuto ? 0
                         : host > 0                            ? host
                                                               : host_memory_available().bytes;
  if (gradients == GradientPlacement::kNvme || (avail > 0 && bytes > avail / 4))
    g.placement.gradients = Tier::kNvme;
}

// outcore.step_in_backward: the step during backward runs units' NVMe optimizer steps from a
// worker while the driving thread computes. The optimizer state is in swap files only at stage
// 3 (where those steps issue no collective); without it the config's parse says the key has no
// effect.
void enable_step_in_backward(const config::Config& cfg, bool warn, Geometry& g) {
  if (!cfg.outcore.step_in_backward || g.placement.optimizer != Tier::kNvme) return;
  const char* why = nullptr;
  if (g.host_gathers_publications()) why = "parameters are gathered in host memory";
  if (why == nullptr)
    g.step_in_backward = true;
  else if (warn)
    log::warn("outcore.step_in_backward is ignored: {}; the step runs after backward", why);
}

// Every unit's slab, and what rank `rank` owns of it at `stage`.
UnitGeometry unit_geometry(const model::UnitLayout& ul, int stage, int world, int rank) {
  UnitGeometry u;
  u.padded = ul.padded_numel;
  u.part = ul.partition_numel(world);
  u.own_off = stage == 0 ? 0 : static_cast<size_t>(rank) * u.part;
  u.own_len = stage == 0 ? u.padded : u.part;
  u.accum_len = stage <= 1 ? u.padded : u.part;
  u.red_off = stage <= 1 ? static_cast<size_t>(rank) * u.part : 0;
  return u;
}

}  // namespace

Geometry make_geometry(const config::Config& cfg, const model::LlamaModel& model,
                       const GeometryOptions& options) {
  const int world = options.world;
  const int rank = options.rank;
  const bool warn = options.warn;
  if (world < 1 || rank < 0 || rank >= world)
    throw InvalidArgument(fmt::format("zero: rank {} of world size {} is invalid", rank, world));
  if (model.options().world_size != world)
    throw InvalidArgument(fmt::format(
        "zero: the model's layout is padded for world size {} but the world size is {} (set "
        "ModelOptions::world_size)",
        model.options().world_size, world));
  Geometry g;
  g.placement = resolve_placement(cfg, model);
  g.world = world;
  g.rank = rank;
  g.param_bytes = dtype_size(g.placement.param_dtype);
  g.sub_group_size =
      static_cast<uint64_t>(std::max<int64_t>(1, cfg.zero_optimization.sub_group_size));
  g.moments = config::adam_moments_bf16(cfg) ? DType::BF16 : DType::F32;
  g.device_host_accessible = options.device_host_accessible;
  const int stage = g.placement.stage;
  for (const model::UnitLayout& ul : model.layout().units) {
    const UnitGeometry u = unit_geometry(ul, stage, world, rank);
    g.max_own_len = std::max(g.max_own_len, u.own_len);
    g.max_part = std::max(g.max_part, u.part);
    g.max_padded = std::max(g.max_padded, u.padded);
    g.units.push_back(u);
  }
  if (stage == 3 && g.placement.params == Tier::kNvme)
    split_param_homes(cfg, model.layout(), world, g);
  if (warn) warn_unused_offload_param_keys(cfg, g);
  split_optimizer_homes(cfg, g);
  if (warn) {
    warn_ratio_offloading_nothing(cfg, g);
    warn_unused_read_ahead(cfg, g);
  }
  // A device the host cannot read: the accumulators are in host memory even with all the
  // optimizer state on the device (stage 0, offload_optimizer none). At one rank the planner
  // keeps each unit's gradients on the device instead wherever the budget allows (decision
  // 037); the others come down, and up again for their Adam step there (decision 036).
  if (!g.device_host_accessible && g.placement.gradients == Tier::kDevice)
    g.placement.gradients = Tier::kHost;
  place_gradients(options.gradients, options.host_memory_bytes, g);
  enable_step_in_backward(cfg, warn, g);
  return g;
}

bool staged_publication(const Placement& p, size_t unit) {
  const Tier home = p.param_home(unit);
  return home == Tier::kNvme || (home == Tier::kDevice && p.optimizer_home(unit) != Tier::kDevice);
}

bool optimizer_publication_staged(const Geometry& g, size_t unit) {
  return staged_publication(g.placement, unit) || g.host_gathers_publications();
}

bool publishes_on_device(const Geometry& g, size_t unit) {
  const Placement& p = g.placement;
  return !optimizer_publication_staged(g, unit) &&
         (p.stage < 3 || p.param_home(unit) == Tier::kDevice);
}

bool host_publication_staged(const Geometry& g, size_t unit) {
  return optimizer_publication_staged(g, unit) ||
         (!g.device_host_accessible && publishes_on_device(g, unit));
}

bool grads_come_down(const Geometry& g, const std::vector<bool>& device_sums) {
  if (g.device_host_accessible) return false;
  for (size_t u = 0; u < g.units.size(); ++u)
    if (!grads_stay_on_device(g, device_sums, u)) return true;
  return false;
}

DeviceAdamScratch device_adam_scratch(const Geometry& g, const std::vector<bool>& device_sums) {
  DeviceAdamScratch s;
  for (size_t u = 0; u < g.units.size(); ++u) {
    if (!stepped_on_device(g, u)) continue;
    if (!grads_stay_on_device(g, device_sums, u))
      s.grad_bytes = std::max(s.grad_bytes, g.units[u].own_len * sizeof(float));
    // fp32 parameters are the master weights themselves: copied down from them directly.
    if (!publishes_on_device(g, u) && g.placement.param_dtype != DType::F32)
      s.out_bytes = std::max(s.out_bytes, g.units[u].own_len * g.param_bytes);
  }
  return s;
}

namespace {

// The first number of file `path` (`max`, or none: nullopt).
std::optional<uint64_t> number_in(const std::filesystem::path& path) {
  std::ifstream in(path);
  uint64_t v = 0;
  if (!(in >> v)) return std::nullopt;
  return v;
}

// The value of `key` in a memory.stat file (0 when absent).
uint64_t stat_value(const std::filesystem::path& path, std::string_view key) {
  std::ifstream in(path);
  std::string k;
  uint64_t v = 0;
  while (in >> k >> v)
    if (k == key) return v;
  return 0;
}

}  // namespace

std::optional<CgroupMemory> cgroup_memory(const std::filesystem::path& proc_cgroup,
                                          const std::filesystem::path& root) {
  namespace fs = std::filesystem;
  std::ifstream in(proc_cgroup);
  std::optional<CgroupMemory> best;
  // One candidate level: its limit less what it holds that cannot be reclaimed (its file pages,
  // active and inactive, can: the kernel reclaims them before it kills, and MemAvailable counts
  // the page cache as available too).
  auto level = [&](const fs::path& dir, const char* limit_file, const char* usage_file,
                   const std::string& stat_prefix) {
    const std::optional<uint64_t> limit = number_in(dir / limit_file);
    const std::optional<uint64_t> usage = number_in(dir / usage_file);
    if (!limit || !usage || *limit >= (uint64_t{1} << 60)) return;  // unlimited
    const uint64_t reclaimable = stat_value(dir / "memory.stat", stat_prefix + "inactive_file") +
                                 stat_value(dir / "memory.stat", stat_prefix + "active_file");
    const uint64_t held = *usage > reclaimable ? *usage - reclaimable : 0;
    const uint64_t left = *limit > held ? *limit - held : 0;
    if (!best || left < best->available_bytes)
      best = CgroupMemory{left, *limit, (dir / limit_file).string()};
  };
  for (std::string line; std::getline(in, line);) {
    // "<id>:<controllers>:<path>": v2 is id 0 with no controllers, v1 lists "memory".
    const size_t a = line.find(':'), b = a == std::string::npos ? a : line.find(':', a + 1);
    if (b == std::string::npos) continue;
    const std::string controllers = line.substr(a + 1, b - a - 1);
    const fs::path rel = fs::path(line.substr(b + 1)).relative_path();
    const bool v2 = controllers.empty();
    if (!v2 && ("," + controllers + ",").find(",memory,") == std::string::npos) continue;
    // v2 mounted at the root, or beside v1 as "unified"; v1's memory hierarchy under "memory".
    const std::vector<fs::path> mounts =
        v2 ? std::vector<fs::path>{root, root / "unified"} : std::vector<fs::path>{root / "memory"};
    for (const fs::path& mount : mounts) {
      // The cgroup and each ancestor up to the mount: every one's limit applies.
      for (fs::path p = rel;; p = p.parent_path()) {
        if (v2)
          level(mount / p, "memory.max", "memory.current", "");
        else
          level(mount / p, "memory.limit_in_bytes", "memory.usage_in_bytes", "total_");
        if (p.empty()) break;
      }
    }
  }
  return best;
}

HostMemory host_memory_available() {
  HostMemory m;
  std::ifstream in("/proc/meminfo");
  std::string key, unit;
  uint64_t kb = 0;
  while (in >> key >> kb >> unit)
    if (key == "MemAvailable:") {
      m.bytes = kb * 1024;
      break;
    }
  if (const std::optional<CgroupMemory> cg = cgroup_memory();
      cg && (m.bytes == 0 || cg->available_bytes < m.bytes)) {
    m.bytes = cg->available_bytes;
    m.by = fmt::format("this process's memory cgroup: {} less its usage", cg->limit_file);
  }
  // A limit on the address space (ulimit -v) counts what is mapped, not what is used: each of a
  // run's threads maps more than it uses (a malloc arena of up to 64 MiB, its stack, OpenBLAS's
  // buffers at its first GEMM; a 10M-parameter run on 2 cores, 12 threads, peaks at 1.4 GiB).
  // Past the limit OpenBLAS spins forever instead of failing, so a run must fit well within it.
  rlimit rl{};
  if (::getrlimit(RLIMIT_AS, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY) {
    uint64_t mapped = 0;
    std::ifstream status("/proc/self/status");
    for (std::string line; std::getline(status, line);)
      if (line.starts_with("VmSize:")) mapped = std::stoull(line.substr(7)) * 1024;
    constexpr uint64_t kPerThread = 104ull << 20;  // arena 64 MiB, stack 8, OpenBLAS 32
    const uint64_t threads = 4ull * std::max(1u, std::thread::hardware_concurrency()) + 8;
    const uint64_t used = mapped + threads * kPerThread;
    const uint64_t left = rl.rlim_cur > used ? rl.rlim_cur - used : 1;  // 0 would be "unknown"
    if (m.bytes == 0 || left < m.bytes) {
      m.bytes = left;
      m.by = fmt::format(
          "ulimit -v ({:.2f} GiB, less the {:.2f} GiB this process maps and about {:.2f} GiB its "
          "{} threads map beyond their use: malloc arenas, stacks, OpenBLAS's buffers; `ulimit "
          "-v unlimited` lifts it)",
          static_cast<double>(rl.rlim_cur) / (1ull << 30),
          static_cast<double>(mapped) / (1ull << 30),
          static_cast<double>(threads * kPerThread) / (1ull << 30), threads);
    }
  }
  return m;
}

std::vector<PassStep> train_schedule(const model::LlamaModel& model) {
  const int head = model.num_units() - 1;
  const bool tied = model.config().tie_word_embeddings;
  std::vector<PassStep> s;
  for (int u = 0; u < head; ++u) s.push_back({u, false, {u}});
  PassStep h{head, true, {head}};
  if (tied) h.needs.push_back(0);
  s.push_back(h);
  for (int u = head - 1; u >= 1; --u) s.push_back({u, true, {u}});
  s.push_back({0, true, {}});  // the embedding's backward reads no parameters
  return s;
}

std::vector<PassStep> eval_schedule(const model::LlamaModel& model) {
  const int head = model.num_units() - 1;
  std::vector<PassStep> s;
  for (int u = 0; u < head; ++u) s.push_back({u, false, {u}});
  PassStep h{head, false, {head}};
  if (model.config().tie_word_embeddings) h.needs.push_back(0);
  s.push_back(h);
  return s;
}

std::vector<bool> persistent_units(const config::Config& cfg, const Geometry& g) {
  const config::ZeroConfig& z = cfg.zero_optimization;
  const int64_t threshold =
      z.stage3_param_persistence_threshold.value_or(kDefaultParamPersistenceThreshold);
  const int64_t cap = z.stage3_model_persistence_threshold;
  std::vector<bool> out(g.units.size(), false);
  int64_t total = 0;
  for (size_t u = 0; u < g.units.size(); ++u) {
    const int64_t n = static_cast<int64_t>(g.units[u].padded);
    if (n <= threshold && total + n <= cap) {
      out[u] = true;
      total += n;
    }
  }
  return out;
}

uint64_t grad_slab_peak_bytes(const model::LlamaModel& model, const Geometry& g) {
  const int head = model.num_units() - 1;
  const bool tied = model.config().tie_word_embeddings;
  auto slab = [&](int u) { return charged_bytes(g.units[u].padded * sizeof(float)); };
  std::vector<int> order;
  for (int u = head; u >= (tied ? 1 : 0); --u) order.push_back(u);
  uint64_t peak = 0;
  for (size_t k = 0; k < order.size(); ++k) {
    uint64_t alive = slab(order[k]);
    for (size_t d = 1; d <= kGradSlabsInFlight && d <= k; ++d) alive += slab(order[k - d]);
    peak = std::max(peak, alive);
  }
  return peak + (tied ? slab(0) : 0);
}

uint64_t live_param_min_bytes(const model::LlamaModel& model, const Geometry& g,
                              const std::vector<bool>& persistent) {
  auto slab = [&](int u) { return charged_bytes(g.units[u].padded * g.param_bytes); };
  uint64_t persistent_bytes = 0;
  for (size_t u = 0; u < g.units.size(); ++u)
    if (persistent[u]) persistent_bytes += slab(static_cast<int>(u));
  uint64_t need = 0;
  for (const auto& sched : {train_schedule(model), eval_schedule(model)})
    for (const PassStep& s : sched) {
      uint64_t b = persistent_bytes;
      for (int u : s.needs)
        if (!persistent[u]) b += slab(u);
      need = std::max(need, b);
    }
  return need;
}

std::vector<swap::SwapFileSpec> param_swap_files(const Geometry& g) {
  std::vector<swap::SwapFileSpec> files;
  for (size_t u = 0; u < g.units.size(); ++u)
    if (g.placement.param_home(u) == Tier::kNvme)
      files.push_back({.unit = static_cast<uint32_t>(u),
                       .kind = swap::SwapKind::kParam,
                       .tensors = {{"p", g.units[u].part * g.param_bytes}}});
  return files;
}

std::vector<swap::SwapFileSpec> optimizer_swap_files(const Geometry& g) {
  const unsigned copies = g.step_in_backward ? kOptimizerCopiesWithSpare : kOptimizerCopies;
  std::vector<swap::SwapFileSpec> files;
  for (size_t u = 0; u < g.units.size(); ++u)
    if (g.placement.optimizer_home(u) == Tier::kNvme)
      files.push_back(swap::optimizer_file_spec(static_cast<uint32_t>(u), g.units[u].own_len,
                                                g.sub_group_size, g.moments, copies));
  return files;
}

std::vector<swap::SwapFileSpec> grad_swap_files(const Geometry& g,
                                                const std::vector<bool>& device_sums) {
  std::vector<swap::SwapFileSpec> files;
  for (size_t u = 0; u < g.units.size(); ++u)
    if (!grads_stay_on_device(g, device_sums, u))
      files.push_back({.unit = static_cast<uint32_t>(u),
                       .kind = swap::SwapKind::kGrad,
                       .tensors = {{"g", g.units[u].accum_len * sizeof(float)}}});
  return files;
}

}  // namespace outcore::zero::detail
