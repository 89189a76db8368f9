// Internal to engine/zero: where each unit's optimizer state lives (fp32 master weights and
// Adam moments, fp32 or bf16 per Geometry::moments, of the elements this rank owns) and the
// Adam step over it. Every call takes and gives moments as fp32: bf16 ones are widened exactly
// on the way out and rounded to nearest even on the way in.
//
//   MemoryOptimizerStore  one [master | exp_avg | exp_avg_sq] array per unit, in device
//                         memory (offload none) or host memory (offload cpu)
//   NvmeOptimizerStore    swap::OptimizerSwapper over the unit's optimizer swap file
//
// Which tier holds a unit's state is Placement::optimizer_home(unit): with
// offload_optimizer.ratio < 1 (partial offload) the last units' state is in device memory
// whatever offload_optimizer.device says; the NVMe store keeps those in a memory store of its
// own. Every store runs the same cpu_adam kernel over the same element ranges, so results are
// bit-identical wherever the state lives. Steps of different units may run concurrently on an NVMe
// store (concurrent_steps() > 1); other calls are made by one thread at a time.
#pragma once

#include <memory>
#include <span>

#include "common/dtype.hpp"
#include "cpu_adam/cpu_adam.hpp"
#include "engine/device/device.hpp"
#include "engine/zero/geometry.hpp"
#include "engine/zero/param_coordinator.hpp"
#include "engine/zero/zero.hpp"
#include "swap/swap.hpp"

namespace outcore::zero::detail {

// Elements per fp32 scratch range when the optimizer state in device or host memory is read or
// written through host buffers (bf16 moments widened, or a device the host cannot read).
inline constexpr size_t kWidenChunk = size_t{1} << 20;

class OptimizerStore {
 public:
  virtual ~OptimizerStore() = default;
  // master: own_len elements; moments start at zero. Reads `master` before it returns, but the
  // state may still be being written (NVMe): flush() waits for it.
  virtual void init(int unit, std::span<const float> master) = 0;
  // Waits until every init has reached its tier; rethrows a failed write.
  virtual void flush() {}
  // One Adam step over the unit's own elements with fp32 gradients `grads` (own_len; in host
  // memory, or device memory for a unit whose gradients stay on the device, see
  // make_memory_store).
  // `out` (nullable) receives own_len elements of `out_dtype`: rounded copies of the new
  // master weights (F32: the master weights themselves).
  virtual void step(int unit, const float* grads, const cpu_adam::AdamParams& hp, void* out,
                    DType out_dtype) = 0;
  virtual void read(int unit, StateKind kind, std::span<float> out) = 0;
  virtual void write(int unit, StateKind kind, std::span<const float> in) = 0;
  // Streaming access to all three arrays (checkpoints): fn is called for consecutive ranges
  // [first, first + n) of the unit's own elements, in order, with pointers valid during the
  // call (the whole arrays in memory; one sub-group at a time on NVMe). fill starts from zero
  // moments; fn writes every element of the range.
  virtual void visit(int unit, const swap::OptimizerSwapper::StateVisitor& fn) = 0;
  virtual void fill(int unit, const swap::OptimizerSwapper::StateFiller& fn) = 0;
  // How many unit steps may usefully run at once.
  virtual size_t concurrent_steps() const = 0;
  // Tentative steps (Geometry::step_in_backward): the step written beside the unit's state,
  // which stays current until commit (the new state replaces it) or discard. Only for units
  // where can_step_tentatively(unit); other calls on a unit with a pending tentative step
  // throw InvalidArgument.
  virtual bool can_step_tentatively(int /*unit*/) const { return false; }
  virtual void step_tentative(int unit, const float* grads, const cpu_adam::AdamParams& hp,
                              void* out, DType out_dtype);
  virtual void commit(int unit);
  virtual void discard(int unit);
};

// Arrays in device memory (charged to `device`'s budget) for the units whose optimizer home is
// the device, in host memory for those homed in host memory. `device` may be null when no unit
// is homed on the device (else InvalidArgument). `device_sums`: Plan::device_grad_sums; step()
// of a unit whose gradients stay on the device (grads_stay_on_device) takes them in device
// memory, every other unit's in host memory.
std::unique_ptr<OptimizerStore> make_memory_store(const Geometry& g, device::Device* device,
                                                  const cpu_adam::Executor& ex,
                                                  TrafficCounters& traffic,
                                                  const std::vector<bool>& device_sums);

// Swap files (`swapper`'s space holds detail::optimizer_swap_files(g)) for the units homed on
// NVMe; device memory from `device` for the units partial offload keeps there (`device_sums` as
// for make_memory_store).
std::unique_ptr<OptimizerStore> make_nvme_store(
    const Geometry& g, swap::Swapper& swapper, swap::PinnedPool& pool,
    const swap::OptimizerSwapperOptions& options, size_t concurrent_steps, device::Device* device,
    const cpu_adam::Executor& ex, TrafficCounters& traffic, const std::vector<bool>& device_sums);

}  // namespace outcore::zero::detail
