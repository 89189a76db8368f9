// DeviceStagedComm: a Comm over host buffers that runs each collective of a device Comm
// (NcclComm) on device copies of them, so that the host-side collective checks
// (collective_checks.hpp) test a device transport. Buffers that overlap on the host overlap
// the same way on the device, so the in-place forms and the misplaced-shard errors reach the
// device Comm unchanged. Traffic is the device Comm's, counted again here.
#pragma once

#include "engine/comm/comm.hpp"

namespace outcore::comm::testing {

class DeviceStagedComm final : public Comm {
 public:
  // REQUIRES: `device_comm` outlives this object and the current CUDA device is its device.
  explicit DeviceStagedComm(Comm& device_comm) : d_(device_comm) {}

  int rank() const override { return d_.rank(); }
  int world_size() const override { return d_.world_size(); }
  void all_gather(std::span<const float> send, std::span<float> recv) override;
  void all_gather_bytes(std::span<const std::byte> send, std::span<std::byte> recv) override;
  void reduce_scatter(std::span<const float> send, std::span<float> recv, ReduceOp op) override;
  void all_reduce(std::span<float> data, ReduceOp op) override;
  void all_reduce(std::span<double> data, ReduceOp op) override;
  void broadcast(std::span<float> data, int root) override;
  void broadcast_bytes(std::span<std::byte> data, int root) override;
  void all_to_all(std::span<float> data) override;
  void barrier() override;
  void abort(int exit_code) override { d_.abort(exit_code); }
  std::string_view name() const override { return d_.name(); }

 private:
  // Counts, as `kind`, what the device Comm counted since `before`.
  void forward(Kind kind, const CommTraffic& before);

  Comm& d_;
};

}  // namespace outcore::comm::testing
