// The placement planner: the bytes each tier holds at its peak and the bytes moved per step,
// counted from the same geometry the engine allocates from (every per-unit decision is the
// geometry's; this file only counts).
#include "engine/zero/plan.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <string_view>
#include <vector>

#include "common/aligned_buffer.hpp"
#include "common/error.hpp"
#include "engine/ckpt/ckpt.hpp"
#include "engine/device/device.hpp"
#include "engine/zero/geometry.hpp"
#include "engine/zero/optimizer_store.hpp"
#include "engine/zero/plan_internal.hpp"
#include "engine/zero/residency.hpp"
#include "swap/swap.hpp"

namespace outcore::zero {

using device::charged_bytes;

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

namespace {

// Unit steps on NVMe optimizer state that run at once in the full pinned layout (one steps
// while the next one's state is read); the reduced layout runs one.
constexpr size_t kConcurrentNvmeSteps = 2;

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
    // One sub-group's slot: its three parts, each 4 KiB-aligned.
    most = std::max(most, buffers * swap::optimizer_swap_io_bytes(sg, sg, g.moments));
  }
  return most;
}

}  // namespace

PinnedLayout pinned_layout(const config::Config& cfg, const Geometry& g,
                           const std::vector<bool>& device_sums, PinnedLayoutSize size) {
  const Placement& p = g.placement;
  const bool reduced = size == PinnedLayoutSize::kReduced;
  PinnedLayout l;
  size_t staged_own_len = 0;  // the longest partition published through a staging slot
  bool staged = false;
  for (size_t u = 0; u < g.units.size(); ++u) {
    if (p.param_home(u) == Tier::kPinned)
      l.param_partitions += align_up(g.units[u].part * g.param_bytes, kIoAlignment);
    if (!host_publication_staged(g, u)) continue;
    staged = true;
    staged_own_len = std::max(staged_own_len, g.units[u].own_len);
  }
  if (p.nvme_param_units > 0) {
    l.fetch_slots = reduced ? 1
                            : static_cast<size_t>(std::max<int64_t>(
                                  1, cfg.zero_optimization.offload_param.buffer_count));
    l.fetch_slot_bytes = align_up(g.max_nvme_part * g.param_bytes, kIoAlignment);
  }
  const size_t concurrent = p.optimizer == Tier::kNvme && !reduced ? kConcurrentNvmeSteps : 1;
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
    size_t longest = 0;  // of the units whose gradients have a swap file
    for (size_t u = 0; u < g.units.size(); ++u)
      if (!grads_stay_on_device(g, device_sums, u))
        longest = std::max(longest, g.units[u].accum_len);
    if (longest > 0) {
      l.grad_slots = concurrent + 1;
      l.grad_slot_bytes = align_up(longest * sizeof(float), kIoAlignment);
    }
  }
  if (grads_come_down(g, device_sums)) {
    l.grad_copy_back_slots = reduced ? 1 : kGradCopyBackSlots;
    l.grad_copy_back_bytes = align_up(g.max_padded * sizeof(float), kIoAlignment);
  }
  if (g.host_gathers() && p.stage >= 1)
    l.param_gather_bytes = align_up(g.max_padded * g.param_bytes, kIoAlignment);
  return l;
}

uint64_t PinnedLayout::total() const {
  return param_partitions + fetch_slots * fetch_slot_bytes +
         writeback_slots * writeback_slot_bytes + concurrent_steps * optimizer_lease_bytes +
         grad_slots * grad_slot_bytes + grad_copy_back_slots * grad_copy_back_bytes +
         param_gather_bytes;
}

PinnedLayout effective_pinned_layout(const config::Config& cfg, const Geometry& g,
                                     const std::vector<bool>& device_sums) {
  const uint64_t limit = cfg.outcore.pinned_memory_mb << 20;
  PinnedLayout full = pinned_layout(cfg, g, device_sums, PinnedLayoutSize::kFull);
  if (limit == 0 || full.total() <= limit) return full;
  // Parameter fetch buffers go first: the full layout with as many as fit, unless the reduced
  // layout (one unit step at a time) holds more of them; at least one.
  auto most_fetch_slots = [&](PinnedLayout l) {
    for (size_t k = full.fetch_slots; k > 1; --k) {
      l.fetch_slots = k;
      if (l.total() <= limit) return l;
    }
    l.fetch_slots = std::min<size_t>(full.fetch_slots, 1);
    return l;
  };
  const PinnedLayout fewer = most_fetch_slots(full);
  const PinnedLayout reduced =
      most_fetch_slots(pinned_layout(cfg, g, device_sums, PinnedLayoutSize::kReduced));
  return fewer.total() <= limit && fewer.fetch_slots >= reduced.fetch_slots ? fewer : reduced;
}

}  // namespace detail

namespace {

// The plan line of the device Adam step's gradient scratch (DeviceAdamScratch::grad_bytes).
constexpr std::string_view kDeviceAdamGradScratch =
    "fp32 gradients of the unit in a device Adam step";

using detail::Geometry;
using detail::UnitGeometry;

// What make_plan counts from: the inputs, the geometry, the activation plan and the words the
// items are described with. Each tier's function adds that tier's items, in tier order.
struct PlanContext {
  const config::Config& cfg;
  const model::LlamaModel& model;
  const Geometry& g;
  model::ActivationPlan acts;
  std::string param_dtype;      // "bf16"
  std::string optimizer_state;  // "fp32 master weights + Adam moments"
  // offload_optimizer.ratio < 1: ", units 0..k-1" for the offloaded part (empty without a
  // split or with nothing offloaded).
  std::string offloaded_units;
};

// "(offload_param cpu, pinned)", or for the units offload_param.max_in_cpu keeps in host
// memory "of units 0..k-1 (max_in_cpu, pinned)".
std::string host_params_what(const Placement& p, std::string_view pinned) {
  if (p.params != Tier::kNvme) return fmt::format("(offload_param cpu, {})", pinned);
  if (p.host_param_units == 0) return "";  // nothing to describe: no such item
  return fmt::format("of units 0..{} (max_in_cpu, {})", p.host_param_units - 1, pinned);
}

std::string offloaded_units_what(const Geometry& g) {
  const size_t k = g.placement.device_optimizer_from;
  if (k >= g.units.size() || k == 0) return "";
  return fmt::format(", units 0..{}", k - 1);
}

// offload_optimizer.ratio < 1: "of units k..U-1 (ratio r)" for the state kept on the device.
std::string device_optimizer_what(const config::Config& cfg, const Geometry& g) {
  return fmt::format("of units {}..{} (ratio {})", g.placement.device_optimizer_from,
                     g.units.size() - 1, cfg.zero_optimization.offload_optimizer.ratio);
}

PlanContext plan_context(const config::Config& cfg, const model::LlamaModel& model,
                         const Geometry& g) {
  return {.cfg = cfg,
          .model = model,
          .g = g,
          .acts = model::plan_activations(model, cfg.activation_checkpointing.cpu_checkpointing,
                                          g.device_host_accessible),
          .param_dtype = std::string(dtype_name(g.placement.param_dtype)),
          .optimizer_state = g.moments == DType::BF16 ? "fp32 master weights + bf16 Adam moments"
                                                      : "fp32 master weights + Adam moments",
          .offloaded_units = offloaded_units_what(g)};
}

void add(Plan& plan, Tier tier, std::string what, uint64_t bytes, std::string key = {}) {
  if (bytes == 0) return;
  plan.items.push_back({tier, std::move(what), bytes, std::move(key)});
  plan.peak[tier] += bytes;
}

// Sum over every unit of bytes_of(unit).
template <class BytesOf>
uint64_t sum_units(const Geometry& g, BytesOf bytes_of) {
  uint64_t s = 0;
  for (const UnitGeometry& u : g.units) s += bytes_of(u);
  return s;
}

// Sum over the units whose optimizer state is homed in `tier` of bytes_of(unit).
template <class BytesOf>
uint64_t sum_optimizer_units(const Geometry& g, Tier tier, BytesOf bytes_of) {
  uint64_t s = 0;
  for (size_t u = 0; u < g.units.size(); ++u)
    if (g.placement.optimizer_home(u) == tier) s += bytes_of(g.units[u]);
  return s;
}

// The plan's header: world, batch shape and element counts.
Plan plan_counts(const PlanContext& c) {
  const Geometry& g = c.g;
  Plan plan;
  plan.placement = g.placement;
  plan.world_size = g.world;
  plan.micro_batches_per_step = c.cfg.gradient_accumulation_steps.value_or(1);
  plan.tokens_per_micro_batch = c.model.tokens();
  plan.num_parameters = c.model.config().num_parameters();
  plan.padded_elems = sum_units(g, [](const UnitGeometry& u) { return u.padded; });
  plan.checkpoint_bytes = plan.padded_elems * (3 * sizeof(float) + g.param_bytes);
  plan.optimizer_ratio = c.cfg.zero_optimization.offload_optimizer.ratio;
  plan.device_host_accessible = g.device_host_accessible;
  plan.step_in_backward = g.step_in_backward;
  plan.optimizer_elems = sum_units(g, [](const UnitGeometry& u) { return u.own_len; });
  plan.offloaded_optimizer_elems =
      plan.optimizer_elems -
      sum_optimizer_units(g, Tier::kDevice, [](const UnitGeometry& u) { return u.own_len; });
  return plan;
}

// Device items that do not depend on the budget: activations, parameters homed on the device,
// gradient slabs, optimizer state and accumulators on the device.
void plan_device_state(const PlanContext& c, Plan& plan) {
  const Geometry& g = c.g;
  const Placement& p = g.placement;
  add(plan, Tier::kDevice,
      fmt::format("activations ({}; scratch: {})",
                  c.model.options().activation_checkpointing ? "checkpointed unit inputs"
                                                             : "unit inputs, saved internals",
                  c.model.scratch_sized_by()),
      c.acts.device_bytes,
      c.model.options().activation_checkpointing
          ? "train_micro_batch_size_per_gpu and --seq-len"
          : "train_micro_batch_size_per_gpu and --seq-len (activation checkpointing keeps only "
            "each unit's input: --activation-checkpointing)");
  if (p.stage < 3)
    add(plan, Tier::kDevice, c.param_dtype + " parameters, full slabs of every unit",
        sum_units(g,
                  [&](const UnitGeometry& u) { return charged_bytes(u.padded * g.param_bytes); }));
  else if (p.params == Tier::kDevice)
    add(plan, Tier::kDevice, c.param_dtype + " parameter partitions (offload_param none)",
        sum_units(g, [&](const UnitGeometry& u) { return charged_bytes(u.part * g.param_bytes); }));
  plan.device_grad_bytes = detail::grad_slab_peak_bytes(c.model, g);
  add(plan, Tier::kDevice,
      fmt::format("fp32 gradient slabs in backward (1 computed + {} in flight)",
                  detail::kGradSlabsInFlight),
      plan.device_grad_bytes);
  add(plan, Tier::kDevice,
      p.optimizer == Tier::kDevice ? c.optimizer_state
                                   : c.optimizer_state + " " + device_optimizer_what(c.cfg, g),
      sum_optimizer_units(g, Tier::kDevice, [&](const UnitGeometry& u) {
        return charged_bytes(u.own_len * g.optimizer_elem_bytes());
      }));
  // In full here (every unit's gradients coming up); plan_device_grad_sums shrinks it to what
  // the units whose gradients do not stay on the device need.
  const detail::DeviceAdamScratch adam = detail::device_adam_scratch(g, {});
  add(plan, Tier::kDevice, std::string(kDeviceAdamGradScratch), charged_bytes(adam.grad_bytes));
  add(plan, Tier::kDevice, c.param_dtype + " new parameters of that unit (copied down)",
      charged_bytes(adam.out_bytes));
  if (p.gradients == Tier::kDevice)
    add(plan, Tier::kDevice, "fp32 gradient accumulators", sum_units(g, [](const UnitGeometry& u) {
          return charged_bytes(u.accum_len * sizeof(float));
        }));
}

// Stage 3: the device budget for gathered parameter slabs. What the limit leaves after the
// rest of the device tier (counted before this), capped by every slab, by
// stage3_max_live_parameters, and raised to the least that lets every pass run.
void plan_live_params(const PlanContext& c, uint64_t device_limit, Plan& plan) {
  const Geometry& g = c.g;
  if (g.placement.stage != 3) return;
  const uint64_t fixed_device = plan.peak.device;
  const uint64_t min_live =
      detail::live_param_min_bytes(c.model, g, detail::persistent_units(c.cfg, g));
  const uint64_t all =
      sum_units(g, [&](const UnitGeometry& u) { return charged_bytes(u.padded * g.param_bytes); });
  uint64_t budget = all;
  if (device_limit > 0) budget = device_limit > fixed_device ? device_limit - fixed_device : 0;
  const uint64_t max_live = static_cast<uint64_t>(
      std::max<int64_t>(0, c.cfg.zero_optimization.stage3_max_live_parameters));
  const uint64_t live_cap = max_live * g.param_bytes + g.units.size() * device::kAllocGranularity;
  budget = std::min({budget, all, live_cap});
  budget = std::max(budget, min_live);
  plan.device_live_param_bytes = budget;
  add(plan, Tier::kDevice, c.param_dtype + " gathered parameter slabs (stage 3 coordinator)",
      budget);
}

// "units 0, 3..7" for the units marked in `units`.
std::string unit_ranges(const std::vector<bool>& units) {
  std::string out;
  size_t marked = 0;
  for (size_t u = 0; u < units.size();) {
    if (!units[u]) {
      ++u;
      continue;
    }
    size_t end = u;
    while (end + 1 < units.size() && units[end + 1]) ++end;
    out += out.empty() ? "" : ", ";
    out += end == u ? fmt::format("{}", u) : fmt::format("{}..{}", u, end);
    marked += end - u + 1;
    u = end + 1;
  }
  return (marked > 1 ? "units " : "unit ") + out;
}

// Gradient sums on the device (detail::device_grad_sum_applies): the units whose fp32 sums fit
// in what the device limit leaves after everything counted before and `reserve` (limit 0:
// unlimited). First the units Adam steps on the device, whose sums stay there for it and save
// both copies (decision 037), with their norm's block sums; then the others (decision 024).
// Each time head first in backward order; a unit too large for what is left is skipped and
// smaller ones tried. The device Adam step's gradient scratch, counted in full before, shrinks
// to what the units whose gradients still come up need, and what it frees goes to the kept
// units first, then to the others.
void plan_device_grad_sums(const PlanContext& c, uint64_t device_limit, uint64_t reserve,
                           Plan& plan) {
  const Geometry& g = c.g;
  const size_t units = g.units.size();
  const int64_t micro_batches = plan.micro_batches_per_step;
  plan.device_grad_sums.assign(units, false);
  // What the limit leaves (unlimited: not read).
  const bool unlimited = device_limit == 0;
  int64_t left = 0;
  if (!unlimited) {
    const uint64_t used = plan.peak.device + reserve;
    left = device_limit > used ? static_cast<int64_t>(device_limit - used) : 0;
  }
  uint64_t blocks = 0;  // the kept units' norm blocks
  std::vector<bool> kept(units, false), summed(units, false);
  const auto block_bytes = [](uint64_t b) { return charged_bytes(b * sizeof(double)); };
  const auto sum_bytes = [&](size_t u) {
    return static_cast<int64_t>(charged_bytes(g.units[u].accum_len * sizeof(float)));
  };
  // The device Adam's gradient scratch, counted in full by plan_device_state: each unit kept
  // may shrink it (to the largest unit whose gradients still come up), which offsets what the
  // unit takes. Sweeps until no unit is added, since a shrink may make room for one refused.
  const uint64_t full_scratch = charged_bytes(detail::device_adam_scratch(g, {}).grad_bytes);
  uint64_t scratch = full_scratch;
  for (bool added = true; added;) {
    added = false;
    for (size_t u = units; u-- > 0;) {
      if (plan.device_grad_sums[u] || !detail::stepped_on_device(g, u) ||
          !detail::device_grad_sum_applies(g, u, micro_batches))
        continue;
      const uint64_t more_blocks = g.units[u].part / detail::kNormBlock;
      plan.device_grad_sums[u] = true;
      const uint64_t scratch_after =
          charged_bytes(detail::device_adam_scratch(g, plan.device_grad_sums).grad_bytes);
      const int64_t cost = sum_bytes(u) + static_cast<int64_t>(block_bytes(blocks + more_blocks)) -
                           static_cast<int64_t>(block_bytes(blocks)) -
                           static_cast<int64_t>(scratch - scratch_after);
      if (!unlimited && cost > left) {
        plan.device_grad_sums[u] = false;
        continue;
      }
      left -= cost;
      blocks += more_blocks;
      scratch = scratch_after;
      kept[u] = added = true;
    }
  }
  if (scratch != full_scratch) {
    for (PlanItem& item : plan.items)
      if (item.tier == Tier::kDevice && item.what == kDeviceAdamGradScratch) item.bytes = scratch;
    std::erase_if(plan.items, [](const PlanItem& i) { return i.bytes == 0; });
    plan.peak.device -= full_scratch - scratch;
  }
  // Then the others' sums, copied back once per step.
  for (size_t u = units; u-- > 0;) {
    if (detail::stepped_on_device(g, u) || !detail::device_grad_sum_applies(g, u, micro_batches))
      continue;
    if (!unlimited && sum_bytes(u) > left) continue;
    left -= sum_bytes(u);
    plan.device_grad_sums[u] = summed[u] = true;
  }
  plan.device_grad_norm_blocks = blocks;
  const auto bytes_of = [&](const std::vector<bool>& which) {
    uint64_t b = 0;
    for (size_t u = 0; u < units; ++u)
      if (which[u]) b += charged_bytes(g.units[u].accum_len * sizeof(float));
    return b;
  };
  const uint64_t kept_bytes = bytes_of(kept), summed_bytes = bytes_of(summed);
  plan.device_grad_sum_bytes = kept_bytes + summed_bytes;
  add(plan, Tier::kDevice,
      fmt::format("fp32 gradients of {}, summed and kept on the device for Adam there",
                  unit_ranges(kept)),
      kept_bytes);
  add(plan, Tier::kDevice, "the gradient norm's block sums of those units",
      charged_bytes(blocks * sizeof(double)));
  add(plan, Tier::kDevice,
      fmt::format("fp32 gradient sums of {} over {} micro-batches (copied back once per step)",
                  unit_ranges(summed), micro_batches),
      summed_bytes);
}

// The pinned pool as the engine carves it (detail::effective_pinned_layout).
void plan_pinned(const PlanContext& c, Plan& plan) {
  const detail::PinnedLayout pl =
      detail::effective_pinned_layout(c.cfg, c.g, plan.device_grad_sums);
  const detail::PinnedLayout full =
      detail::pinned_layout(c.cfg, c.g, plan.device_grad_sums, detail::PinnedLayoutSize::kFull);
  // What outcore.pinned_memory_mb takes from the full layout is said where it shows.
  auto fewer = [](size_t got, size_t asked) {
    return got < asked ? fmt::format("; {} with more outcore.pinned_memory_mb", asked)
                       : std::string();
  };
  add(plan, Tier::kPinned,
      c.param_dtype + " parameter partitions " + host_params_what(c.g.placement, "pinned"),
      pl.param_partitions);
  add(plan, Tier::kPinned,
      fmt::format("parameter fetch buffers ({} x {} B{})", pl.fetch_slots, pl.fetch_slot_bytes,
                  fewer(pl.fetch_slots, full.fetch_slots)),
      pl.fetch_slots * pl.fetch_slot_bytes, "zero_optimization.offload_param.buffer_count");
  add(plan, Tier::kPinned,
      fmt::format("parameter write-back buffers ({} x {} B{})", pl.writeback_slots,
                  pl.writeback_slot_bytes, fewer(pl.writeback_slots, full.writeback_slots)),
      pl.writeback_slots * pl.writeback_slot_bytes);
  add(plan, Tier::kPinned,
      fmt::format("optimizer swap buffers ({} unit steps x {} sub-group buffers{})",
                  pl.concurrent_steps, pl.optimizer_buffer_count,
                  fewer(pl.concurrent_steps, full.concurrent_steps)),
      pl.concurrent_steps * pl.optimizer_lease_bytes,
      "zero_optimization.offload_optimizer.buffer_count");
  add(plan, Tier::kPinned,
      fmt::format("gradient staging buffers ({} x {} B{})", pl.grad_slots, pl.grad_slot_bytes,
                  fewer(pl.grad_slots, full.grad_slots)),
      pl.grad_slots * pl.grad_slot_bytes);
  add(plan, Tier::kPinned,
      fmt::format("gradient copy-back buffers (device -> host, {} x {} B{})",
                  pl.grad_copy_back_slots, pl.grad_copy_back_bytes,
                  fewer(pl.grad_copy_back_slots, full.grad_copy_back_slots)),
      pl.grad_copy_back_slots * pl.grad_copy_back_bytes);
  add(plan, Tier::kPinned, "parameter gather buffer (ranks gather on the host, one slab)",
      pl.param_gather_bytes);
  // outcore.pinned_memory_mb caps the pool: allocated (and locked) at start, it is the layout's
  // size, never more (a 16 GiB budget once locked 16 GiB for a model that leased kilobytes).
  const uint64_t pinned_limit = c.cfg.outcore.pinned_memory_mb << 20;
  const uint64_t need = std::max<uint64_t>(pl.total(), kIoAlignment);
  plan.pinned_pool_bytes = pinned_limit > 0 ? std::min(pinned_limit, need) : need;
}

// Host memory outside the pinned pool: offloaded optimizer state, accumulators, unpinned
// parameter partitions, activation checkpoints and the scratch of state access.
void plan_host(const PlanContext& c, Plan& plan) {
  const Geometry& g = c.g;
  const Placement& p = g.placement;
  add(plan, Tier::kHost,
      c.optimizer_state + " (" +
          (c.offloaded_units.empty() ? std::string("offload_optimizer cpu")
                                     : "cpu" + c.offloaded_units) +
          ")",
      sum_optimizer_units(g, Tier::kHost, [&](const UnitGeometry& u) {
        return align_up(u.own_len * g.optimizer_elem_bytes(), kIoAlignment);
      }));
  if (p.gradients == Tier::kHost) {
    uint64_t accumulators = 0;  // none for the units whose gradients stay on the device
    for (size_t u = 0; u < g.units.size(); ++u)
      if (!detail::grads_stay_on_device(g, plan.device_grad_sums, u))
        accumulators += align_up(g.units[u].accum_len * sizeof(float), kIoAlignment);
    add(plan, Tier::kHost, "fp32 gradient accumulators", accumulators);
  }
  uint64_t host_params = 0;
  for (size_t u = 0; u < g.units.size(); ++u)
    if (p.param_home(u) == Tier::kHost)
      host_params += align_up(g.units[u].part * g.param_bytes, kIoAlignment);
  add(plan, Tier::kHost,
      c.param_dtype + " parameter partitions " + host_params_what(p, "not pinned"), host_params);
  add(plan, Tier::kHost, "activation checkpoints (cpu_checkpointing)", c.acts.host_bytes);
  add(plan, Tier::kHost, "fp32 scratch for initialisation and state access",
      align_up(g.max_own_len * sizeof(float), kIoAlignment));
  add(plan, Tier::kHost, "runtime: threads, library buffers, allocator (an estimate)",
      runtime_host_bytes(cpu_threads_for(c.cfg) + data_path_threads()));
}

// A run that saves (`piece`: PlanOptions::save_piece_elems): a save's host buffers besides the
// state, at most: the writer's staging slots of the largest fp32 segment and the read-back
// ring (ckpt::save_buffer_bytes), and what reading the state out takes: a unit's parameters
// copied from a device the host cannot read, bf16 moments widened to fp32 (a sub-group at a
// time from swap files; kWidenChunk elements of master weights, moments and raw bytes from
// device or host memory).
void plan_saves(const PlanContext& c, std::optional<uint64_t> piece, Plan& plan) {
  if (!piece) return;
  const Geometry& g = c.g;
  const uint64_t largest = g.max_own_len;
  const uint64_t elems = *piece > 0 ? *piece : ckpt::WriterOptions{}.piece_elems;
  uint64_t bytes =
      ckpt::save_buffer_bytes(ckpt::kSaveStagingSlots, std::min(largest, elems) * sizeof(float));
  if (!g.device_host_accessible) bytes += largest * g.param_bytes;
  if (g.moments != DType::F32 || !g.device_host_accessible)
    bytes += g.placement.optimizer == Tier::kNvme
                 ? 2 * sizeof(float) * std::min<uint64_t>(largest, g.sub_group_size)
                 : 4 * sizeof(float) * std::min<uint64_t>(largest, detail::kWidenChunk);
  add(plan, Tier::kHost,
      "checkpoint saves (--save-dir): staging, read-back and state-reading buffers, at most",
      bytes);
}

// Swap files: parameter partitions, optimizer state and gradient accumulators homed on NVMe.
void plan_nvme(const PlanContext& c, Plan& plan) {
  const Geometry& g = c.g;
  const Placement& p = g.placement;
  if (p.nvme_param_units > 0) {
    plan.param_nvme_path = c.cfg.zero_optimization.offload_param.nvme_path;
    const std::vector<swap::SwapFileSpec> files = detail::param_swap_files(g);
    plan.param_nvme_bytes = swap::SwapSpace::bytes_needed(files);
    plan.param_nvme_tree_bytes = swap::SwapSpace::tree_bytes_needed(files);
    add(plan, Tier::kNvme,
        p.host_param_units == 0
            ? c.param_dtype + " parameter partitions (swap files)"
            : fmt::format("{} parameter partitions of units {}..{} (swap files)", c.param_dtype,
                          p.host_param_units, g.units.size() - 1),
        plan.param_nvme_bytes);
  }
  if (p.optimizer == Tier::kNvme) {
    plan.optimizer_nvme_path = c.cfg.zero_optimization.offload_optimizer.nvme_path;
    const std::vector<swap::SwapFileSpec> files = detail::optimizer_swap_files(g);
    plan.optimizer_nvme_bytes = swap::SwapSpace::bytes_needed(files);
    plan.optimizer_nvme_tree_bytes = swap::SwapSpace::tree_bytes_needed(files);
    add(plan, Tier::kNvme,
        c.optimizer_state + " (swap files" + c.offloaded_units +
            (g.step_in_backward ? ", 2 copies" : "") + ")",
        plan.optimizer_nvme_bytes);
    uint64_t state = 0, io = 0;  // a step's bytes of the state, and those its slots move
    for (size_t u = 0; u < g.units.size(); ++u) {
      if (p.optimizer_home(u) != Tier::kNvme) continue;
      state += g.units[u].own_len * g.optimizer_elem_bytes();
      io += swap::optimizer_swap_io_bytes(g.units[u].own_len, g.sub_group_size, g.moments);
    }
    if (io * 10 > state * 11)
      plan.sub_group_padding = fmt::format(
          "zero_optimization.sub_group_size {} pads each sub-group's three parts to 4 KiB: each "
          "step reads and writes {} of swap files for {} of optimizer state ({:.1f}x), and the "
          "files are as much larger; a multiple of {} elements pads nothing",
          g.sub_group_size, format_bytes(io), format_bytes(state),
          static_cast<double>(io) / static_cast<double>(state),
          kIoAlignment / dtype_size(g.moments));
  }
  if (p.gradients == Tier::kNvme) {
    const std::vector<swap::SwapFileSpec> files = detail::grad_swap_files(g, plan.device_grad_sums);
    const uint64_t b = swap::SwapSpace::bytes_needed(files);
    plan.optimizer_nvme_bytes += b;
    plan.optimizer_nvme_tree_bytes += swap::SwapSpace::tree_bytes_needed(files);
    add(plan, Tier::kNvme, "fp32 gradient accumulators (swap files)", b);
  }
  if (plan.param_nvme_tree_bytes + plan.optimizer_nvme_tree_bytes > 0)
    add(plan, Tier::kNvme, "swap directories and their lock files (at most)",
        plan.param_nvme_tree_bytes + plan.optimizer_nvme_tree_bytes);
}

// Stage 3: the parameter fetches of one step, from the coordinator's own policy replayed over
// the step's passes (refetches after release, eviction or the max_live cap included).
void plan_fetch_traffic(const PlanContext& c, Plan& plan) {
  const Geometry& g = c.g;
  const Placement& p = g.placement;
  if (p.stage != 3) return;
  TrafficBytes& t = plan.per_step;
  const size_t fetch_buffers =
      detail::effective_pinned_layout(c.cfg, g, plan.device_grad_sums).fetch_slots;
  const auto fetches = detail::fetches_per_step(
      c.model, g, detail::coordinator_options(c.cfg, g, plan.device_live_param_bytes),
      fetch_buffers, plan.micro_batches_per_step);
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

// What this rank sends to the others besides stage 3's gathers: every micro-batch's
// gradients, stage 0's reduced gradients, stages 1-2's new parameters, the norm's partial sums.
void plan_comm_traffic(const PlanContext& c, Plan& plan) {
  const Geometry& g = c.g;
  const int stage = g.placement.stage;
  const uint64_t m = static_cast<uint64_t>(plan.micro_batches_per_step);
  const uint64_t others = static_cast<uint64_t>(g.world - 1);
  uint64_t& comm = plan.per_step.comm;
  uint64_t norm_blocks = 0;
  for (const UnitGeometry& u : g.units) {
    comm += others * m * u.part * sizeof(float);              // gradients, every micro-batch
    if (stage == 0) comm += others * u.part * sizeof(float);  // reduced gradients
    if (stage == 1 || stage == 2) comm += others * u.part * g.param_bytes;
    norm_blocks += u.part / detail::kNormBlock;
  }
  comm += others * norm_blocks * sizeof(double);
}

// Per unit: gradients copied to and accumulated in their home, optimizer state read and
// written back, new parameters written to their home after Adam.
void plan_step_traffic(const PlanContext& c, Plan& plan) {
  const Geometry& g = c.g;
  const Placement& p = g.placement;
  const uint64_t m = static_cast<uint64_t>(plan.micro_batches_per_step);
  TrafficBytes& t = plan.per_step;
  for (size_t unit = 0; unit < g.units.size(); ++unit) {
    const UnitGeometry& u = g.units[unit];
    // Every rank's contribution to this rank's partition is added on the host.
    // Summed on the device, they come back once per step; kept there for Adam there, never
    // (only their norm's block sums come down).
    const bool stay = detail::grads_stay_on_device(g, plan.device_grad_sums, unit);
    const uint64_t sent = stay ? 0 : plan.device_grad_sums[unit] ? 1 : m;
    if (stay) t.d2h += u.part / detail::kNormBlock * sizeof(double);
    const uint64_t chunk = static_cast<uint64_t>(g.world) * u.part * sizeof(float);
    if (p.gradients != Tier::kDevice) t.d2h += sent * chunk;
    if (p.gradients == Tier::kNvme) {
      const uint64_t acc = u.accum_len * sizeof(float);
      t.nvme_write += sent * acc;  // every copy back writes the sum so far
      t.nvme_read += sent * acc;   // later ones add to it; the step reads it once
    }
    if (p.optimizer_home(unit) == Tier::kNvme) {  // whole slots: sub-groups pad to 4 KiB
      const uint64_t io = swap::optimizer_swap_io_bytes(u.own_len, g.sub_group_size, g.moments);
      t.nvme_read += io;
      t.nvme_write += io;
    }
    // Adam on a device the host cannot read: the gradients go up, and new parameters bound
    // for host memory come down.
    if (detail::stepped_on_device(g, unit)) {
      if (!stay) t.h2d += u.own_len * sizeof(float);
      if (!detail::publishes_on_device(g, unit)) t.d2h += u.own_len * g.param_bytes;
    }
    // New parameters after Adam: written to the swap file, or copied to the device.
    const uint64_t lowp = u.own_len * g.param_bytes;
    if (p.param_home(unit) == Tier::kNvme) t.nvme_write += lowp;
    if (p.param_home(unit) == Tier::kDevice && detail::optimizer_publication_staged(g, unit))
      t.h2d += g.host_gathers_publications()
                   ? u.padded * g.param_bytes  // gathered in pinned memory, copied up whole
                   : lowp;
  }
}

// The device bytes the plan may use: PlanOptions' limit, else outcore.device_memory_mb (0:
// unlimited).
uint64_t device_limit_bytes(const config::Config& cfg, const PlanOptions& options) {
  return options.device_limit_bytes > 0 ? options.device_limit_bytes
                                        : cfg.outcore.device_memory_mb << 20;
}

}  // namespace

uint64_t device_reserve_bytes(uint64_t budget_left, uint64_t hardware_free) {
  if (hardware_free == 0 || (budget_left > 0 && budget_left < hardware_free)) return 0;
  return std::max<uint64_t>(uint64_t{1} << 30, hardware_free / 16);
}

Plan make_plan(const config::Config& cfg, const model::LlamaModel& model,
               const PlanOptions& options) {
  if (options.world_size < 1 || options.world_size > config::kMaxWorldSize)
    throw InvalidArgument(fmt::format("world size {}: allowed: an integer in 1..{}",
                                      options.world_size, config::kMaxWorldSize));
  const Geometry g =
      detail::make_geometry(cfg, model,
                            {.world = options.world_size,
                             .rank = 0,
                             .warn = false,
                             .gradients = options.gradients,
                             .device_host_accessible = options.device_host_accessible,
                             .host_memory_bytes = options.host_memory_bytes});
  const PlanContext c = plan_context(cfg, model, g);
  Plan plan = plan_counts(c);
  plan.device_in_host_memory = options.device_in_host_memory;
  // One tier after the other, so `items` is in tier order.
  plan_device_state(c, plan);
  add(plan, Tier::kDevice, "compute backend (cuBLASLt workspace, attention, ids, tables)",
      options.compute_workspace_bytes);
  plan_live_params(c, device_limit_bytes(cfg, options), plan);
  plan_device_grad_sums(c, device_limit_bytes(cfg, options), options.device_reserve_bytes, plan);
  plan_pinned(c, plan);
  plan_host(c, plan);
  plan_saves(c, options.save_piece_elems, plan);
  plan_nvme(c, plan);
  plan_fetch_traffic(c, plan);
  plan_comm_traffic(c, plan);
  plan_step_traffic(c, plan);
  return plan;
}

}  // namespace outcore::zero
