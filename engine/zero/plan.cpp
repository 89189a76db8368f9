// The placement planner: the bytes each tier holds at its peak, computed from the same
// geometry the engine allocates from.
#include "engine/zero/plan.hpp"

#include <fmt/format.h>

#include <algorithm>

#include "common/aligned_buffer.hpp"
#include "common/error.hpp"
#include "common/log.hpp"
#include "engine/device/device.hpp"
#include "engine/zero/geometry.hpp"
#include "engine/zero/plan_internal.hpp"
#include "engine/zero/residency.hpp"
#include "swap/swap.hpp"

namespace outcore::zero {

using device::charged_bytes;

std::string_view tier_name(Tier t) {
  switch (t) {
    case Tier::kDevice:
      return "device";
    case Tier::kPinned:
      return "pinned";
    case Tier::kHost:
      return "host";
    case Tier::kNvme:
      return "nvme";
  }
  return "?";
}

uint64_t& TierBytes::operator[](Tier t) {
  switch (t) {
    case Tier::kDevice:
      return device;
    case Tier::kPinned:
      return pinned;
    case Tier::kHost:
      return host;
    case Tier::kNvme:
      break;
  }
  return nvme;
}

uint64_t TierBytes::operator[](Tier t) const { return const_cast<TierBytes&>(*this)[t]; }

namespace detail {

std::vector<swap::SwapFileSpec> param_swap_files(const Geometry& g) {
  std::vector<swap::SwapFileSpec> files;
  for (size_t u = 0; u < g.units.size(); ++u)
    if (g.placement.param_home(u) == Tier::kNvme)
      files.push_back({.unit = static_cast<uint32_t>(u),
                       .kind = swap::SwapKind::kParam,
                       .tensors = {{"p", g.units[u].part * g.param_bytes}}});
  return files;
}

std::vector<swap::SwapFileSpec> grad_swap_files(const Geometry& g) {
  std::vector<swap::SwapFileSpec> files;
  for (size_t u = 0; u < g.units.size(); ++u)
    files.push_back({.unit = static_cast<uint32_t>(u),
                     .kind = swap::SwapKind::kGrad,
                     .tensors = {{"g", g.units[u].accum_len * sizeof(float)}}});
  return files;
}

std::vector<swap::SwapFileSpec> optimizer_swap_files(const Geometry& g) {
  std::vector<swap::SwapFileSpec> files;
  for (size_t u = 0; u < g.units.size(); ++u)
    if (g.placement.optimizer_home(u) == Tier::kNvme)
      files.push_back(swap::optimizer_file_spec(static_cast<uint32_t>(u), g.units[u].own_len,
                                                g.sub_group_size, g.moments,
                                                g.step_in_backward ? 2 : 1));
  return files;
}

void split_optimizer_homes(const config::Config& cfg, Geometry& g, bool warn) {
  const double ratio = cfg.zero_optimization.offload_optimizer.ratio;
  Placement& p = g.placement;
  if (!(ratio < 1.0) || p.stage != 3) return;  // engine/config refuses ratio < 1 below stage 3
  if (p.optimizer == Tier::kDevice) {
    if (warn)
      log::warn(
          "zero_optimization.offload_optimizer.ratio {} has no effect: offload_optimizer.device "
          "is none, so all the optimizer state is on the device already",
          ratio);
    return;
  }
  uint64_t total = 0;
  for (const UnitGeometry& u : g.units) total += u.own_len;
  const double offload = ratio * static_cast<double>(total);
  uint64_t offloaded = 0;
  size_t k = 0;
  while (k < g.units.size() && static_cast<double>(offloaded + g.units[k].own_len) <= offload)
    offloaded += g.units[k++].own_len;
  p.device_optimizer_from = k;
}

// The largest lease one OptimizerSwapper step takes: min(buffer_count, sub-groups) buffers of
// the unit's largest sub-group's three 4 KiB-aligned parts (units with state in swap files).
// The last part is rounded up too: the ring slot holds whole parts.
uint64_t optimizer_lease_bytes(const Geometry& g, unsigned buffer_count) {
  uint64_t most = 0;
  for (size_t unit = 0; unit < g.units.size(); ++unit) {
    if (g.placement.optimizer_home(unit) != Tier::kNvme) continue;
    const UnitGeometry& u = g.units[unit];
    const uint64_t sg = std::min<uint64_t>(g.sub_group_size, u.own_len);
    const uint64_t groups = (u.own_len + g.sub_group_size - 1) / g.sub_group_size;
    const uint64_t buffers = std::min<uint64_t>(buffer_count, groups);
    const uint64_t parts = align_up(sg * sizeof(float), kIoAlignment) +
                           2 * align_up(sg * dtype_size(g.moments), kIoAlignment);
    most = std::max(most, buffers * parts);
  }
  return most;
}

PinnedLayout pinned_layout(const config::Config& cfg, const Geometry& g, bool reduced) {
  const Placement& p = g.placement;
  PinnedLayout l;
  size_t staged_own_len = 0;  // the longest partition published through a staging slot
  bool staged = false;
  for (size_t u = 0; u < g.units.size(); ++u) {
    if (p.param_home(u) == Tier::kPinned)
      l.param_partitions += align_up(g.units[u].part * g.param_bytes, kIoAlignment);
    if (!staged_publication(p, u)) continue;
    staged = true;
    staged_own_len = std::max(staged_own_len, g.units[u].own_len);
  }
  if (p.nvme_param_units > 0) {
    l.fetch_slots = reduced ? 1
                            : static_cast<size_t>(std::max<int64_t>(
                                  1, cfg.zero_optimization.offload_param.buffer_count));
    l.fetch_slot_bytes = align_up(g.max_nvme_part * g.param_bytes, kIoAlignment);
  }
  const size_t concurrent = p.optimizer == Tier::kNvme && !reduced ? 2 : 1;
  if (staged) {
    l.writeback_slots = concurrent + 1;  // one per unit step in flight, one being written
    l.writeback_slot_bytes = align_up(staged_own_len * g.param_bytes, kIoAlignment);
  }
  if (p.optimizer == Tier::kNvme) {
    l.optimizer_buffer_count = static_cast<unsigned>(
        std::max<int64_t>(1, cfg.zero_optimization.offload_optimizer.buffer_count));
    l.concurrent_steps = concurrent;
    l.optimizer_lease_bytes = optimizer_lease_bytes(g, l.optimizer_buffer_count);
  }
  if (p.gradients == Tier::kNvme) {
    size_t longest = 0;
    for (const UnitGeometry& u : g.units) longest = std::max(longest, u.accum_len);
    l.grad_slots = concurrent + 1;
    l.grad_slot_bytes = align_up(longest * sizeof(float), kIoAlignment);
  }
  if (!g.device_host_accessible)
    l.grad_copy_back_bytes = align_up(g.max_padded * sizeof(float), kIoAlignment);
  if (g.host_gathers() && p.stage >= 1)
    l.param_gather_bytes = align_up(g.max_padded * g.param_bytes, kIoAlignment);
  return l;
}

uint64_t PinnedLayout::total() const {
  return param_partitions + fetch_slots * fetch_slot_bytes +
         writeback_slots * writeback_slot_bytes + concurrent_steps * optimizer_lease_bytes +
         grad_slots * grad_slot_bytes + grad_copy_back_bytes + param_gather_bytes;
}

PinnedLayout effective_pinned_layout(const config::Config& cfg, const Geometry& g) {
  const uint64_t limit = cfg.outcore.pinned_memory_mb << 20;
  PinnedLayout full = pinned_layout(cfg, g, false);
  if (limit > 0 && full.total() > limit) return pinned_layout(cfg, g, true);
  return full;
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

}  // namespace detail

namespace {

// "(offload_param cpu, pinned)", or for the units offload_param.max_in_cpu keeps in host
// memory "of units 0..k-1 (max_in_cpu, pinned)".
std::string host_params_what(const Placement& p, std::string_view pinned) {
  if (p.params != Tier::kNvme) return fmt::format("(offload_param cpu, {})", pinned);
  if (p.host_param_units == 0) return "";  // nothing to describe: no such item
  return fmt::format("of units 0..{} (max_in_cpu, {})", p.host_param_units - 1, pinned);
}

// offload_optimizer.ratio < 1: "of units k..U-1 (ratio r)" for the state kept on the device,
// and ", units 0..k-1" for the offloaded part (empty without a split or with nothing offloaded).
std::string device_optimizer_what(const config::Config& cfg, const detail::Geometry& g) {
  return fmt::format("of units {}..{} (ratio {})", g.placement.device_optimizer_from,
                     g.units.size() - 1, cfg.zero_optimization.offload_optimizer.ratio);
}

std::string offloaded_optimizer_what(const detail::Geometry& g) {
  const size_t k = g.placement.device_optimizer_from;
  if (k >= g.units.size() || k == 0) return "";
  return fmt::format(", units 0..{}", k - 1);
}

void add(Plan& plan, Tier tier, std::string what, uint64_t bytes, std::string key = {}) {
  if (bytes == 0) return;
  plan.items.push_back({tier, std::move(what), bytes, std::move(key)});
  plan.peak[tier] += bytes;
}

void plan_traffic(const config::Config& cfg, const model::LlamaModel& model,
                  const detail::Geometry& g, Plan& plan) {
  const Placement& p = g.placement;
  const uint64_t m = static_cast<uint64_t>(plan.micro_batches_per_step);
  TrafficBytes& t = plan.per_step;
  if (p.stage == 3) {
    // The coordinator's own policy replayed over one step's passes: every fetch it takes,
    // refetches after release, eviction or the max_live cap included.
    const size_t fetch_buffers = detail::effective_pinned_layout(cfg, g).fetch_slots;
    const auto fetches = detail::fetches_per_step(
        model, g, detail::coordinator_options(cfg, g, plan.device_live_param_bytes), fetch_buffers,
        plan.micro_batches_per_step);
    for (size_t u = 0; u < g.units.size(); ++u) {
      const uint64_t bytes = fetches[u] * g.units[u].part * g.param_bytes;
      if (p.param_home(u) == Tier::kNvme) t.nvme_read += bytes;
      if (g.host_gathers()) {
        // Gathered in pinned memory (a device-resident partition copied there first), then
        // the whole slab goes up.
        if (p.param_home(u) == Tier::kDevice) t.d2h += bytes;
        t.h2d += fetches[u] * g.units[u].padded * g.param_bytes;
      } else if (p.param_home(u) != Tier::kDevice) {
        t.h2d += bytes;
      }
      t.comm += (g.world - 1) * bytes;  // every fetch gathers the other ranks' partitions
    }
  }
  const uint64_t others = static_cast<uint64_t>(g.world - 1);
  uint64_t norm_blocks = 0;
  for (const detail::UnitGeometry& u : g.units) {
    t.comm += others * m * u.part * sizeof(float);                // gradients, every micro-batch
    if (p.stage == 0) t.comm += others * u.part * sizeof(float);  // reduced gradients
    if (p.stage == 1 || p.stage == 2) t.comm += others * u.part * g.param_bytes;
    norm_blocks += u.part / detail::kNormBlock;
  }
  t.comm += others * norm_blocks * sizeof(double);
  for (size_t unit = 0; unit < g.units.size(); ++unit) {
    const detail::UnitGeometry& u = g.units[unit];
    // Every rank's contribution to this rank's partition is added on the host.
    const uint64_t chunk = static_cast<uint64_t>(g.world) * u.part * sizeof(float);
    if (p.gradients != Tier::kDevice) t.d2h += m * chunk;
    if (p.gradients == Tier::kNvme) {
      const uint64_t acc = u.accum_len * sizeof(float);
      t.nvme_write += m * acc;  // every micro-batch writes the sum so far
      t.nvme_read += m * acc;   // later micro-batches add to it; the step reads it once
    }
    if (p.optimizer_home(unit) == Tier::kNvme) {
      t.nvme_read += u.own_len * g.optimizer_elem_bytes();
      t.nvme_write += u.own_len * g.optimizer_elem_bytes();
    }
    // New parameters after Adam: written to the swap file, or copied to the device.
    const uint64_t lowp = u.own_len * g.param_bytes;
    if (p.param_home(unit) == Tier::kNvme) t.nvme_write += lowp;
    if (p.param_home(unit) == Tier::kDevice && p.optimizer_home(unit) != Tier::kDevice)
      t.h2d += g.host_gathers_publications()
                   ? u.padded * g.param_bytes  // gathered in pinned memory, copied up whole
                   : lowp;
  }
}

}  // namespace

Plan make_plan(const config::Config& cfg, const model::LlamaModel& model,
               const PlanOptions& options) {
  if (options.world_size < 1 || options.world_size > config::kMaxWorldSize)
    throw InvalidArgument(fmt::format("world size {}: allowed: an integer in 1..{}",
                                      options.world_size, config::kMaxWorldSize));
  const detail::Geometry g = detail::make_geometry(
      cfg, model, options.world_size, 0, false, options.gradients, options.device_host_accessible);
  const Placement& p = g.placement;
  Plan plan;
  plan.placement = p;
  plan.world_size = g.world;
  plan.micro_batches_per_step = cfg.gradient_accumulation_steps.value_or(1);
  plan.tokens_per_micro_batch = model.tokens();
  plan.num_parameters = model.config().num_parameters();
  for (const detail::UnitGeometry& u : g.units) plan.padded_elems += u.padded;
  plan.optimizer_ratio = cfg.zero_optimization.offload_optimizer.ratio;
  for (size_t u = 0; u < g.units.size(); ++u) {
    plan.optimizer_elems += g.units[u].own_len;
    if (p.optimizer_home(u) != Tier::kDevice) plan.offloaded_optimizer_elems += g.units[u].own_len;
  }
  const std::string pd(dtype_name(p.param_dtype));
  const std::string moments_what = g.moments == DType::BF16
                                       ? "fp32 master weights + bf16 Adam moments"
                                       : "fp32 master weights + Adam moments";

  // ---- device
  const bool cpu_ckpt = cfg.activation_checkpointing.cpu_checkpointing;
  const model::ActivationPlan acts =
      model::plan_activations(model, cpu_ckpt, g.device_host_accessible);
  add(plan, Tier::kDevice,
      model.options().activation_checkpointing
          ? "activations (checkpointed unit inputs, scratch)"
          : "activations (unit inputs, saved internals, scratch)",
      acts.device_bytes);
  uint64_t fixed_device = acts.device_bytes;
  auto sum_units = [&](auto bytes_of) {
    uint64_t s = 0;
    for (const detail::UnitGeometry& u : g.units) s += bytes_of(u);
    return s;
  };
  if (p.stage < 3) {
    const uint64_t b =
        sum_units([&](const auto& u) { return charged_bytes(u.padded * g.param_bytes); });
    add(plan, Tier::kDevice, pd + " parameters, full slabs of every unit", b);
    fixed_device += b;
  } else if (p.params == Tier::kDevice) {
    const uint64_t b =
        sum_units([&](const auto& u) { return charged_bytes(u.part * g.param_bytes); });
    add(plan, Tier::kDevice, pd + " parameter partitions (offload_param none)", b);
    fixed_device += b;
  }
  const uint64_t grad_slabs = detail::grad_slab_peak_bytes(model, g);
  add(plan, Tier::kDevice, "fp32 gradient slabs of the units in backward", grad_slabs);
  fixed_device += grad_slabs;
  plan.device_grad_bytes = grad_slabs;
  // Optimizer state per unit where it lives: sum over the units homed in `tier` of `bytes`.
  auto sum_optimizer = [&](Tier tier, auto bytes_of) {
    uint64_t s = 0;
    for (size_t u = 0; u < g.units.size(); ++u)
      if (p.optimizer_home(u) == tier) s += bytes_of(g.units[u]);
    return s;
  };
  const std::string partial = offloaded_optimizer_what(g);
  {
    const uint64_t b = sum_optimizer(Tier::kDevice, [&](const auto& u) {
      return charged_bytes(u.own_len * g.optimizer_elem_bytes());
    });
    add(plan, Tier::kDevice,
        p.optimizer == Tier::kDevice ? std::string(moments_what)
                                     : moments_what + " " + device_optimizer_what(cfg, g),
        b);
    fixed_device += b;
  }
  if (p.gradients == Tier::kDevice) {
    const uint64_t b =
        sum_units([&](const auto& u) { return charged_bytes(u.accum_len * sizeof(float)); });
    add(plan, Tier::kDevice, "fp32 gradient accumulators", b);
    fixed_device += b;
  }
  if (p.stage == 3) {
    const auto persistent = detail::persistent_units(cfg, g);
    const uint64_t min_live = detail::live_param_min_bytes(model, g, persistent);
    const uint64_t all =
        sum_units([&](const auto& u) { return charged_bytes(u.padded * g.param_bytes); });
    uint64_t budget = all;
    const uint64_t limit = options.device_limit_bytes > 0 ? options.device_limit_bytes
                                                          : cfg.outcore.device_memory_mb << 20;
    if (limit > 0) budget = limit > fixed_device ? limit - fixed_device : 0;
    const uint64_t max_live = static_cast<uint64_t>(
        std::max<int64_t>(0, cfg.zero_optimization.stage3_max_live_parameters));
    const uint64_t live_cap = max_live * g.param_bytes + g.units.size() * device::kAllocGranularity;
    budget = std::min({budget, all, live_cap});
    budget = std::max(budget, min_live);
    plan.device_live_param_bytes = budget;
    add(plan, Tier::kDevice, pd + " gathered parameter slabs (stage 3 coordinator)", budget);
  }

  // ---- pinned
  const uint64_t pinned_limit = cfg.outcore.pinned_memory_mb << 20;
  const detail::PinnedLayout pl = detail::effective_pinned_layout(cfg, g);
  add(plan, Tier::kPinned, pd + " parameter partitions " + host_params_what(p, "pinned"),
      pl.param_partitions);
  add(plan, Tier::kPinned,
      fmt::format("parameter fetch buffers ({} x {} B)", pl.fetch_slots, pl.fetch_slot_bytes),
      pl.fetch_slots * pl.fetch_slot_bytes, "zero_optimization.offload_param.buffer_count");
  add(plan, Tier::kPinned,
      fmt::format("parameter write-back buffers ({} x {} B)", pl.writeback_slots,
                  pl.writeback_slot_bytes),
      pl.writeback_slots * pl.writeback_slot_bytes);
  add(plan, Tier::kPinned,
      fmt::format("optimizer swap buffers ({} unit steps x {} sub-group buffers)",
                  pl.concurrent_steps, pl.optimizer_buffer_count),
      pl.concurrent_steps * pl.optimizer_lease_bytes,
      "zero_optimization.offload_optimizer.buffer_count");
  add(plan, Tier::kPinned,
      fmt::format("gradient staging buffers ({} x {} B)", pl.grad_slots, pl.grad_slot_bytes),
      pl.grad_slots * pl.grad_slot_bytes);
  add(plan, Tier::kPinned, "gradient copy-back buffer (device -> host, one slab)",
      pl.grad_copy_back_bytes);
  add(plan, Tier::kPinned, "parameter gather buffer (ranks gather on the host, one slab)",
      pl.param_gather_bytes);
  plan.pinned_pool_bytes =
      pinned_limit > 0 ? pinned_limit : std::max<uint64_t>(pl.total(), kIoAlignment);

  // ---- host
  add(plan, Tier::kHost,
      moments_what + " (" +
          (partial.empty() ? std::string("offload_optimizer cpu") : "cpu" + partial) + ")",
      sum_optimizer(Tier::kHost, [&](const auto& u) {
        return align_up(u.own_len * g.optimizer_elem_bytes(), kIoAlignment);
      }));
  if (p.gradients == Tier::kHost)
    add(plan, Tier::kHost, "fp32 gradient accumulators", sum_units([&](const auto& u) {
          return align_up(u.accum_len * sizeof(float), kIoAlignment);
        }));
  uint64_t host_params = 0;
  for (size_t u = 0; u < g.units.size(); ++u)
    if (p.param_home(u) == Tier::kHost)
      host_params += align_up(g.units[u].part * g.param_bytes, kIoAlignment);
  add(plan, Tier::kHost, pd + " parameter partitions " + host_params_what(p, "not pinned"),
      host_params);
  add(plan, Tier::kHost, "activation checkpoints (cpu_checkpointing)", acts.host_bytes);
  add(plan, Tier::kHost, "fp32 scratch for initialisation and state access",
      align_up(g.max_own_len * sizeof(float), kIoAlignment));

  // ---- nvme
  if (p.nvme_param_units > 0) {
    plan.param_nvme_path = cfg.zero_optimization.offload_param.nvme_path;
    plan.param_nvme_bytes = swap::SwapSpace::bytes_needed(detail::param_swap_files(g));
    add(plan, Tier::kNvme,
        p.host_param_units == 0
            ? pd + " parameter partitions (swap files)"
            : fmt::format("{} parameter partitions of units {}..{} (swap files)", pd,
                          p.host_param_units, g.units.size() - 1),
        plan.param_nvme_bytes);
  }
  if (p.optimizer == Tier::kNvme) {
    plan.optimizer_nvme_path = cfg.zero_optimization.offload_optimizer.nvme_path;
    plan.optimizer_nvme_bytes = swap::SwapSpace::bytes_needed(detail::optimizer_swap_files(g));
    add(plan, Tier::kNvme,
        moments_what + " (swap files" + partial + (g.step_in_backward ? ", 2 copies" : "") + ")",
        plan.optimizer_nvme_bytes);
  }
  if (p.gradients == Tier::kNvme) {
    const uint64_t b = swap::SwapSpace::bytes_needed(detail::grad_swap_files(g));
    plan.optimizer_nvme_bytes += b;
    add(plan, Tier::kNvme, "fp32 gradient accumulators (swap files)", b);
  }

  std::stable_sort(plan.items.begin(), plan.items.end(),
                   [](const PlanItem& a, const PlanItem& b) { return a.tier < b.tier; });
  plan_traffic(cfg, model, g, plan);
  return plan;
}

}  // namespace outcore::zero
