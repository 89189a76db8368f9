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
#include "engine/device/compute_backend.hpp"
#include "engine/zero/geometry.hpp"
#include "engine/zero/host_lane.hpp"
#include "engine/zero/param_coordinator.hpp"
#include "engine/zero/plan_internal.hpp"
#include "swap/swap.hpp"

namespace outcore::zero::detail {

// Owns: the gradient slabs in flight, the accumulators (device, host memory or a swap file
// per unit, GradientPlacement; in host memory, registered with a device the host cannot read
// where Adam on that device reads them), the gradient swap space and its staging slots, the
// copy-back buffers of a device the host cannot read, the device sums of the units
// Plan::device_grad_sums names, the norm's block sums of squares, and the host lane (host_lane.hpp,
// thread "zero-grad") that adds the gradients, reads and writes their swap files and runs
// when_final. Borrows (must outlive it): the geometry, device, backend, comm, the engine's comm
// lane (its collectives, in issue order), the d2h stream, the executor and the traffic counters.
//
// A device the host cannot read: each slab is copied down on the d2h stream into one of the
// layout's copy-back buffers (taking turns; a buffer is reused once the lane has added what it
// held), and the device slab is free once its copy is done, so the next slab's copy runs while
// the host adds this one. The host work runs on the lane and the all_to_all on the comm lane,
// never as host functions of a device stream (on a GPU those share the CUDA runtime's one
// callback thread with every other stream).
//
// Device sums: a unit's first slab of a step becomes its sum on the device and the next ones
// are added into it by the backend (add_inplace, the same fp32 additions in the same order as
// the host's); the sum goes down once, after the step's last micro-batch (by the count of
// gradient_accumulation_steps, or earlier for an armed pass, or at finish()), and lands in the
// accumulator as a first micro-batch would. Micro-batches beyond the count go the host way.
// A unit whose gradients stay on the device (Adam steps it there, grads_stay_on_device) keeps
// its sum through the step instead: no accumulator on the host, the norm's block sums taken on
// the device (the host's bits) and copied down, load() gives the device sum.
//
// Threads: the driving thread calls everything except load(); the lane, the comm lane and the
// d2h stream run what submit() hands on; load() runs on the step worker (or its async unit tasks)
// and reads grad slot `slot` only: slot 0 belongs to submit() (the accumulation of a pass),
// slots 1.. to a tentative step running beside that pass, and the accumulators are not written
// while a step reads them (every backward waits for the running step's units first). No lock:
// the lane orders the accumulation; drain()/finish() are the fences.
class GradientPath {
 public:
  // Acquires the staging slots and copy-back buffer from `pool` and allocates the
  // accumulators (device or host memory) or opens their swap files under `nvme_path`.
  // `device_sums`: Plan::device_grad_sums (one entry per unit); `micro_batches`: the step's
  // count (gradient_accumulation_steps).
  // `comm_lane`: the engine's lane for collectives (all_to_all at world > 1); `d2h`: the
  // copy-back stream (used only on a device the host cannot read).
  GradientPath(const Geometry& g, device::Device& device, device::ComputeBackend& backend,
               comm::Comm& comm, HostLane& comm_lane, device::Stream& d2h,
               const cpu_adam::Executor& executor, TrafficCounters& traffic, swap::PinnedPool& pool,
               aio::Engine* aio, const swap::SwapperOptions& swapper_options,
               const std::string& nvme_path, const PinnedLayout& layout,
               std::vector<bool> device_sums, int64_t micro_batches);

  // A training pass begins: the step's first micro-batch, or the next one.
  void begin_pass(bool first);

  // A device slab for `unit`'s gradients, after waiting until at most kGradSlabsInFlight
  // earlier slabs are still in flight.
  device::DeviceBuffer alloc_slab(int unit);
  // Hands `unit`'s freshly computed slab to the streams (its compute may still be queued on
  // the backend's stream: what reads the slab waits for an event recorded there now; a slab
  // added into a device sum stays in flight until the addition has run): all_to_all in place
  // (world > 1),
  // then the world's contributions added rank by rank into this rank's accumulator (written
  // on the first micro-batch of a step, added otherwise). `when_final`, if set, runs on the
  // lane right after that accumulation (the step during backward posts the unit). Blocks while
  // the copy-back buffer it takes still holds a slab the lane has not added.
  void submit(int unit, device::DeviceBuffer slab, bool first,
              std::function<void()> when_final = {});
  // Waits until at most `keep` slabs are in flight (a slab leaves the flight once the host
  // holds it: copied down on a device the host cannot read, else added; or once it is added
  // into a device sum).
  void drain(size_t keep);
  // Sends down the device sums still held (not those that stay on the device), then waits for
  // every accumulation and collective of the pass: the accumulators are final.
  void finish();
  // Waits for the lane's tasks and logs their error, if any (before the engine's other parts
  // go: a task may post a unit to the step scheduler).
  void quiesce() noexcept;

  // Stage 0 at world > 1: all-gathers the partitions reduced per micro-batch into every
  // rank's full slabs (collective). Other stages: nothing.
  void gather_full_slabs();
  // The step's global sum of squares of the reduced gradients (collective: all_gather_bytes
  // of every rank's block sums, added unit by unit, rank by rank, block by block).
  double sum_of_squares();
  // The unit's reduced fp32 gradients for its Adam step (read from NVMe into grad slot
  // `slot` when they live there; device memory for a unit whose gradients stay there).
  const float* load(int unit, size_t slot);
  // Staging slots for load() (0 unless the gradients live on NVMe).
  size_t slot_count() const { return grad_buffers_.size(); }
  // The gradient swap files' swapper (null unless the gradients of some unit live on NVMe).
  const swap::Swapper* swapper() const { return grad_swapper_.get(); }

 private:
  float* accumulator(int unit);
  float* partition(int unit);
  // The host side of submit(): `slab` (all_to_all at world > 1) into the accumulator.
  // `computed`: recorded on the backend's stream after the slab's last write (null: the
  // backend's operations have finished); the copy down waits for it.
  void send_down(int unit, device::DeviceBuffer slab, bool first, std::function<void()> when_final,
                 const std::shared_ptr<device::Event>& computed);
  // An event recorded now on the backend's stream (null when it has none).
  std::shared_ptr<device::Event> computed();
  // The norm's block sums of the units whose gradients stay on the device, taken there and
  // copied down into norm_blocks_ (waits for them).
  void device_norm_blocks();

  struct InFlight {
    device::DeviceBuffer slab;
    // Set on a device the host cannot read: the slab is in host memory, or added into a device
    // sum, once it is (and free then). Null: the lane's task `added` reads the slab itself.
    std::shared_ptr<device::Event> copied;
    uint64_t added = 0;  // the lane's task that adds it
  };

  const Geometry& g_;
  device::Device& device_;
  comm::Comm& comm_;
  HostLane& comm_lane_;
  const cpu_adam::Executor& executor_;
  TrafficCounters& traffic_;
  device::Stream& d2h_;

  std::unique_ptr<swap::SwapSpace> grad_space_;  // accumulators on NVMe
  std::unique_ptr<swap::Swapper> grad_swapper_;
  std::vector<swap::TensorId> grad_ids_;
  std::vector<swap::PinnedBuffer> grad_buffers_;  // [0]: accumulation; [k]: unit steps
  // Slabs of a device the host cannot read come down here, taking turns; buffer k is free once
  // the lane's task copy_back_added_[k] has run.
  std::vector<swap::PinnedBuffer> copy_back_;
  std::vector<uint64_t> copy_back_added_;
  size_t next_copy_back_ = 0;
  // The norm's partial sums of squares, one per kNormBlock elements of this rank's reduced
  // partitions, unit after unit (norm_block_off_[u]: unit u's first).
  std::vector<double> norm_blocks_;
  std::vector<size_t> norm_block_off_;
  std::vector<device::DeviceBuffer> device_accum_;  // gradients on the device
  std::vector<AlignedBuffer> host_accum_;           // gradients in host memory
  // The host accumulators registered with the device (those of units stepped by Adam on a
  // device the host cannot read); unregistered before the accumulators go.
  struct Unregister {
    device::Device* device;
    void operator()(void* p) const noexcept { device->unregister_host(p); }
  };
  std::vector<std::unique_ptr<void, Unregister>> registered_;
  std::deque<InFlight> in_flight_;

  device::ComputeBackend& backend_;
  const std::vector<bool> summed_on_device_;  // Plan::device_grad_sums
  std::vector<device::DeviceBuffer> sums_;    // held device sums (empty: none this step)
  std::vector<uint64_t> sum_step_;            // the step_ each sum belongs to
  // Per unit: its gradients stay on the device (grads_stay_on_device): the sum is kept for the
  // step's norm and Adam until the unit's next backward allocates a slab.
  std::vector<bool> stays_;
  // The norm's block sums of those units, taken on the device (device_norm_off_[u]: unit u's
  // first), then copied down into norm_blocks_.
  device::DeviceBuffer device_norm_blocks_;
  std::vector<size_t> device_norm_off_;
  std::vector<double> device_norm_down_;  // their copy in host memory
  const int64_t micro_batches_;
  int64_t micro_batch_ = 0;  // of the running pass within its step
  uint64_t step_ = 0;        // steps begun (passes with `first`)

  HostLane lane_{"zero-grad"};  // last: its tasks use the fields above; joined first
};

}  // namespace outcore::zero::detail
