// Internal to engine/zero: every per-unit decision (each unit's sizes, the home of each kind
// of its state, its swap files) and the unit schedule, shared by the planner and the engine so
// that the plan's byte counts are exactly what the engine allocates. Below plan.hpp: it
// includes placement.hpp, never the planner.
//
// Threading: pure functions (host_memory_available reads /proc/meminfo and the memory
// cgroup's files); thread-safe.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>
#include <vector>

#include "common/dtype.hpp"
#include "engine/config/config.hpp"
#include "engine/model/model.hpp"
#include "engine/zero/placement.hpp"
#include "swap/swap.hpp"

namespace outcore::zero::detail {

// One unit's slab and what this rank owns of it.
struct UnitGeometry {
  size_t padded = 0;     // elements of the full slab
  size_t part = 0;       // elements of one rank's partition (padded / world)
  size_t own_off = 0;    // first element this rank owns (stage 0: 0)
  size_t own_len = 0;    // elements this rank owns (stage 0: the whole slab)
  size_t accum_len = 0;  // elements of its fp32 gradient accumulator (full below stage 2)
  // Where this rank's reduced partition (part elements) sits in the accumulator: rank*part
  // below stage 2 (the accumulator is the full slab), 0 from stage 2 (it is the partition).
  size_t red_off = 0;
};

struct Geometry {
  Placement placement;
  int world = 1;
  int rank = 0;
  size_t param_bytes = 4;  // bytes per low-precision parameter element
  std::vector<UnitGeometry> units;
  size_t max_own_len = 0;
  size_t max_part = 0;
  size_t max_padded = 0;
  size_t max_nvme_part = 0;     // the largest partition homed in a swap file (0: none)
  uint64_t sub_group_size = 0;  // optimizer sub-group elements (zero sub_group_size)
  DType moments = DType::F32;   // Adam moments: F32 or BF16 (config::adam_moments_bf16)
  // False for a device whose memory the host cannot read (a GPU): gradient slabs come back to
  // host memory through a pinned copy-back buffer before they are accumulated.
  bool device_host_accessible = true;
  // outcore.step_in_backward where it applies: units whose optimizer state is on NVMe may step
  // during the last backward into a spare copy of that state (optimizer files hold two).
  bool step_in_backward = false;
  // Parameters are all-gathered in pinned host memory and copied to the device whole (several
  // ranks on a device the host cannot read: the collectives run on host memory).
  bool host_gathers() const { return !device_host_accessible && world > 1; }
  // Stages 1-2 under host_gathers: new parameters are gathered in pinned memory after Adam and
  // the whole slab is copied up (the engine does it, the plan counts it).
  bool host_gathers_publications() const {
    return host_gathers() && (placement.stage == 1 || placement.stage == 2);
  }

  // Bytes of optimizer state per owned element: fp32 master + two moments (12 or 8).
  size_t optimizer_elem_bytes() const { return sizeof(float) + 2 * dtype_size(moments); }
};

// Whether the pinned pool (and so the parameters it holds in host memory) is page-locked: when
// every section that offloads asks for it with pin_memory (a section that does not offload has
// no say; config key_effects warns when the two disagree).
bool pool_page_locked(const config::ZeroConfig& z);

// Resolves the placement (stage, tiers) from the config and the model. Throws ConfigError for
// an inconsistent precision. Offload sections a stage ignores, as DeepSpeed does, are said by
// the config's parse.
Placement resolve_placement(const config::Config& cfg, const model::LlamaModel& model);

// Whose geometry make_geometry computes, and how.
struct GeometryOptions {
  int world = 1;  // data-parallel ranks; the model's layout must be padded for it
  int rank = 0;   // 0..world-1
  // Log the DeepSpeed-compatible warnings (keys ignored or without effect). The engine warns
  // once; the planner, which may run many times, does not.
  bool warn = false;
  // Where the gradient accumulators go when the optimizer state is on NVMe (kAuto reads
  // host_memory_available(), or takes host_memory_bytes where given).
  GradientPlacement gradients = GradientPlacement::kHost;
  // Device::host_accessible() of the device the engine runs on (false for a GPU).
  bool device_host_accessible = true;
  // The host memory of the machine planned for when it is not this one (PlanOptions::
  // host_memory_bytes); 0: this machine's.
  uint64_t host_memory_bytes = 0;
};

// The placement and every unit's sizes for rank `options.rank` of `options.world`. At stage 3
// with offload_param nvme it splits the units between host memory and swap files by
// offload_param.max_in_cpu and throws ConfigError naming offload_param.buffer_size when that is
// smaller than the largest partition in a swap file. With offload_optimizer.ratio < 1 at stage
// 3 (offload cpu or nvme, DeepSpeed's partial offload) the optimizer state of the units after
// the longest prefix whose own elements are at most ratio x all own elements stays on the
// device (Placement::device_optimizer_from). With `warn`, logs the warnings for keys that have
// no effect in this geometry (offload_param.buffer_size,
// max_in_cpu, offload_optimizer.ratio, outcore.step_in_backward). Throws InvalidArgument for a
// rank outside the world or a model padded for another world size.
Geometry make_geometry(const config::Config& cfg, const model::LlamaModel& model,
                       const GeometryOptions& options);

// Whether new low-precision parameters of `unit` go through a pinned staging slot after Adam
// (then copied host-to-device or written to the unit's swap file) rather than being written
// by the optimizer straight into their home.
bool staged_publication(const Placement& p, size_t unit);

// Whether the optimizer's new parameters of `unit` go through a staging slot: where
// staged_publication says, and for several ranks at stages 1-2 on a device the host cannot read
// also where the unit is stepped on the device (its partition is all-gathered in host memory).
bool optimizer_publication_staged(const Geometry& g, size_t unit);

// Whether the optimizer writes new parameters of `unit` straight into device memory: not
// staged, and homed on the device (every full slab below stage 3, the partition at stage 3 with
// offload_param none).
bool publishes_on_device(const Geometry& g, size_t unit);

// Whether a producer on the host (initialisation, a checkpoint's load, a restore after a
// tentative step) writes `unit`'s parameters through a staging slot: where the optimizer's are
// staged, and on a device the host cannot read, also where the optimizer writes them in place
// on the device (Adam on the device).
bool host_publication_staged(const Geometry& g, size_t unit);

// Whether Adam steps `unit` on a device the host cannot read: its optimizer state lives there
// (stage 0, offload_optimizer none, or the last units by a ratio < 1; decision 036).
inline bool stepped_on_device(const Geometry& g, size_t unit) {
  return !g.device_host_accessible && g.placement.optimizer_home(unit) == Tier::kDevice;
}

// Whether `unit`'s gradients stay on the device through its Adam step there (decision 037):
// stepped there and summed there (`device_sums`: Plan::device_grad_sums; empty: none). They
// never cross PCIe, and their norm's block sums are taken on the device.
inline bool grads_stay_on_device(const Geometry& g, const std::vector<bool>& device_sums,
                                 size_t unit) {
  return !device_sums.empty() && device_sums[unit] && stepped_on_device(g, unit);
}

// Whether some unit's gradients come down to the host: on a device the host cannot read, through
// the copy-back buffers (every unit whose gradients do not stay on the device).
bool grads_come_down(const Geometry& g, const std::vector<bool>& device_sums);

// Adam on a device the host cannot read (stepped_on_device): device scratch for the largest
// such unit's fp32 gradients when they come up for its step (not those that stay on the device,
// grads_stay_on_device with `device_sums`), and for its new low-precision parameters when they
// are bound for host memory (brought down after it; fp32 ones come down from the master
// weights). Zero where no unit needs it.
struct DeviceAdamScratch {
  size_t grad_bytes = 0;
  size_t out_bytes = 0;
};
DeviceAdamScratch device_adam_scratch(const Geometry& g, const std::vector<bool>& device_sums);

// The memory cgroup (v2 or v1) that leaves this process the least memory, among its own and its
// ancestors' under `root`: its limit less its usage that cannot be reclaimed (the usage less
// its file pages, active and inactive). nullopt when no level has a limit (or none can be read).
// `proc_cgroup` and `root` are /proc/self/cgroup and /sys/fs/cgroup but in tests.
struct CgroupMemory {
  uint64_t available_bytes = 0;
  uint64_t limit_bytes = 0;
  std::string limit_file;  // the file whose limit it is: memory.max (v2), memory.limit_in_bytes
};
std::optional<CgroupMemory> cgroup_memory(
    const std::filesystem::path& proc_cgroup = "/proc/self/cgroup",
    const std::filesystem::path& root = "/sys/fs/cgroup");

// The host memory this process can still take: MemAvailable from /proc/meminfo, or what its
// memory cgroup leaves where that is less (a container's limit), or what an address-space limit
// (ulimit -v) leaves once the address space its threads map beyond their use is set aside,
// where that is less; with what set it.
struct HostMemory {
  uint64_t bytes = 0;  // 0 when unknown
  std::string by = "MemAvailable";
};
HostMemory host_memory_available();

// One step of a pass over the units: the unit that computes, and every unit whose parameters
// it needs resident on the device (empty for the embedding's backward, which needs none).
struct PassStep {
  int unit = 0;
  bool backward = false;
  std::vector<int> needs;
};

// Training: forward 0..L (the head's forward is fused into its backward), backward L+1..0.
std::vector<PassStep> train_schedule(const model::LlamaModel& model);
// Evaluation: forward 0..L+1.
std::vector<PassStep> eval_schedule(const model::LlamaModel& model);

// Units whose slabs stay gathered once fetched (stage3_param_persistence_threshold, capped in
// total by stage3_model_persistence_threshold), in unit order.
std::vector<bool> persistent_units(const config::Config& cfg, const Geometry& g);

// Device gradient slabs: the most charged bytes alive at once during backward (two
// consecutive units' slabs, plus the embedding's from the head to its own backward when tied).
uint64_t grad_slab_peak_bytes(const model::LlamaModel& model, const Geometry& g);

// Stage 3: the smallest device byte budget (charged bytes) for gathered slabs that lets every
// step of the training and evaluation passes run: the `persistent` units' slabs plus the most
// that one step needs of the others.
uint64_t live_param_min_bytes(const model::LlamaModel& model, const Geometry& g,
                              const std::vector<bool>& persistent);

// The swap files of the units whose parameter partitions are homed on NVMe (one tensor "p" of
// part low-precision elements per unit), of those whose optimizer state is
// (swap::optimizer_file_spec, with a spare copy under step_in_backward), and of the gradient
// accumulators on NVMe (one tensor "g" of accum_len fp32 per unit, every unit whose gradients
// do not stay on the device, grads_stay_on_device with `device_sums`).
std::vector<swap::SwapFileSpec> param_swap_files(const Geometry& g);
std::vector<swap::SwapFileSpec> optimizer_swap_files(const Geometry& g);
std::vector<swap::SwapFileSpec> grad_swap_files(const Geometry& g,
                                                const std::vector<bool>& device_sums);

// Elements per partial sum of the gradient norm: every partition (part) is a multiple of it
// at any world size (model::kPartitionAlignElems), so ranks cut the slab at block boundaries.
inline constexpr size_t kNormBlock = model::kPartitionAlignElems;

// Gradient slabs in flight beyond the one being computed.
inline constexpr size_t kGradSlabsInFlight = 1;

// A device the host cannot read: pinned buffers gradient slabs are copied down to, so that one
// slab's copy (its own stream) runs while the host adds the one before.
inline constexpr size_t kGradCopyBackSlots = 2;

// Whether `unit`'s gradients may be summed on the device across a step's micro-batches
// (Plan::device_grad_sums, GradientPath): a device the host cannot read, one rank, the
// accumulators in host memory or swap files, and either several micro-batches per step (the sum
// is copied back once per step, decision 024) or Adam on the device for the unit (the sum stays
// there for it, decision 037). At several ranks each micro-batch is reduced on its own
// (all_to_all, then the ranks' shares added in rank order), the order that keeps W ranks x G
// micro-batches bit-identical to one rank x W*G; a sum over micro-batches first would change it.
inline bool device_grad_sum_applies(const Geometry& g, size_t unit, int64_t micro_batches) {
  return !g.device_host_accessible && g.world == 1 && g.placement.gradients != Tier::kDevice &&
         (micro_batches > 1 || stepped_on_device(g, unit));
}

}  // namespace outcore::zero::detail
