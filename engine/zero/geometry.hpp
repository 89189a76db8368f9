// Internal to engine/zero: the sizes and the unit schedule that the planner and the engine
// share, so that the plan's byte counts are exactly what the engine allocates.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "common/dtype.hpp"
#include "engine/config/config.hpp"
#include "engine/model/model.hpp"
#include "engine/zero/plan.hpp"

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

// Resolves the placement (stage, tiers) from the config and the model. Throws ConfigError for
// an inconsistent precision, logs the DeepSpeed-compatible warnings (offload_param below
// stage 3 ignored; nvme optimizer below stage 3).
Placement resolve_placement(const config::Config& cfg, const model::LlamaModel& model, bool warn);

// The placement and every unit's sizes for rank `rank` of `world`. At stage 3 with
// offload_param nvme it splits the units between host memory and swap files by
// offload_param.max_in_cpu and throws ConfigError naming offload_param.buffer_size when that is
// smaller than the largest partition in a swap file. With `warn`, logs the warnings of
// resolve_placement and one for an offload_param.buffer_size that has no further effect.
Geometry make_geometry(const config::Config& cfg, const model::LlamaModel& model, int world,
                       int rank, bool warn, GradientPlacement gradients = GradientPlacement::kHost,
                       bool device_host_accessible = true);

// Whether new low-precision parameters of `unit` go through a pinned staging slot after Adam
// (then copied host-to-device or written to the unit's swap file) rather than being written
// by the optimizer straight into their home.
bool staged_publication(const Placement& p, size_t unit);

// MemAvailable from /proc/meminfo in bytes (0 when unknown).
uint64_t mem_available_bytes();

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

// Elements per partial sum of the gradient norm: every partition (part) is a multiple of it
// at any world size (model::kPartitionAlignElems), so ranks cut the slab at block boundaries.
inline constexpr size_t kNormBlock = model::kPartitionAlignElems;

// Gradient slabs in flight beyond the one being computed.
inline constexpr size_t kGradSlabsInFlight = 1;

}  // namespace outcore::zero::detail
