// Internal to engine/zero: the gradient path of one rank. Each backward's fresh fp32 gradient
// slab goes through all_to_all (world > 1, every stage; decision 003) and is added rank by
// rank into this rank's accumulator; step() then reads the accumulated gradients, their norm
// (decision 003's block sums, gathered and added in slab order) and, at stage 0, the gathered
// full slabs.
#pragma once

#include <cstddef>
#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "aio/aio.hpp"
#include "common/aligned_buffer.hpp"
#include "cpu_adam/cpu_adam.hpp"
#include "engine/zero/geometry.hpp"
#include "engine/zero/param_coordinator.hpp"
#include "engine/zero/plan_internal.hpp"
#include "swap/swap.hpp"

namespace outcore::zero::detail {

// Owns: the gradient slabs in flight, the accumulators (device, host memory or a swap file
// per unit, GradientPlacement), the gradient swap space and its staging slots, the copy-back
// buffer of a device the host cannot read, and the norm's block sums of squares.
// Borrows (must outlive it): the geometry, device, comm, the grad and comm streams, the
// executor and the traffic counters.
//
// Threads: the driving thread calls everything except load(); the grad and comm streams run
// what submit() enqueues; load() runs on the step worker (or its async unit tasks) and reads
// grad slot `slot` only: slot 0 belongs to submit() (the accumulation of a pass), slots 1..
// to a tentative step running beside that pass, and the accumulators are not written while
// a step reads them (every backward waits for the running step's units first). No lock: the
// streams order the accumulation; drain()/finish() are the fences.
class GradientPath {
 public:
  // Acquires the staging slots and copy-back buffer from `pool` and allocates the
  // accumulators (device or host memory) or opens their swap files under `nvme_path`.
  GradientPath(const Geometry& g, device::Device& device, comm::Comm& comm, device::Stream& grad,
               device::Stream& comm_stream, const cpu_adam::Executor& executor,
               TrafficCounters& traffic, swap::PinnedPool& pool, aio::Engine* aio,
               const swap::SwapperOptions& swapper_options, const std::string& nvme_path,
               const PinnedLayout& layout);

  // A device slab for `unit`'s gradients, after waiting until at most kGradSlabsInFlight
  // earlier slabs are still in flight.
  device::DeviceBuffer alloc_slab(int unit);
  // Hands `unit`'s freshly computed slab to the streams: all_to_all in place (world > 1),
  // then the world's contributions added rank by rank into this rank's accumulator (written
  // on the first micro-batch of a step, added otherwise). `when_final`, if set, runs on the
  // grad stream right after that accumulation (the step during backward posts the unit).
  void submit(int unit, device::DeviceBuffer slab, bool first,
              std::function<void()> when_final = {});
  // Waits until at most `keep` slabs are in flight.
  void drain(size_t keep);
  // Waits for every accumulation and collective of the pass: the accumulators are final.
  void finish();

  // Stage 0 at world > 1: all-gathers the partitions reduced per micro-batch into every
  // rank's full slabs (collective). Other stages: nothing.
  void gather_full_slabs();
  // The step's global sum of squares of the reduced gradients (collective: all_gather_bytes
  // of every rank's block sums, added unit by unit, rank by rank, block by block).
  double sum_of_squares();
  // The unit's reduced fp32 gradients for its Adam step (read from NVMe into grad slot
  // `slot` when they live there).
  const float* load(int unit, size_t slot);
  // Staging slots for load() (0 unless the gradients live on NVMe).
  size_t slot_count() const { return grad_buffers_.size(); }
  // The gradient swap files' swapper (null unless the gradients live on NVMe).
  const swap::Swapper* swapper() const { return grad_swapper_.get(); }

 private:
  float* accumulator(int unit);
  float* partition(int unit);

  struct InFlight {
    device::DeviceBuffer slab;
    std::unique_ptr<device::Event> reduced, done;
    std::unique_ptr<device::Event> copied;  // back in host memory (device the host cannot read)
  };

  const Geometry& g_;
  device::Device& device_;
  comm::Comm& comm_;
  device::Stream& grad_;
  device::Stream& comm_stream_;
  const cpu_adam::Executor& executor_;
  TrafficCounters& traffic_;

  std::unique_ptr<swap::SwapSpace> grad_space_;  // accumulators on NVMe
  std::unique_ptr<swap::Swapper> grad_swapper_;
  std::vector<swap::TensorId> grad_ids_;
  std::vector<swap::PinnedBuffer> grad_buffers_;  // [0]: accumulation; [k]: unit steps
  swap::PinnedBuffer copy_back_;                  // slabs of a device the host cannot read
  // The norm's partial sums of squares, one per kNormBlock elements of this rank's reduced
  // partitions, unit after unit (norm_block_off_[u]: unit u's first).
  std::vector<double> norm_blocks_;
  std::vector<size_t> norm_block_off_;
  std::vector<device::DeviceBuffer> device_accum_;  // gradients on the device
  std::vector<AlignedBuffer> host_accum_;           // gradients in host memory
  std::deque<InFlight> in_flight_;
};

}  // namespace outcore::zero::detail
