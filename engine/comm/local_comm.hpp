// LocalComm: the Comm of a single process (world size 1).
//
// Every collective still moves the data it would move at world size > 1 (all_gather copies
// the shard into the full buffer, reduce_scatter copies the rank's shard out), so code
// written against Comm runs the same path at world 1 as it will under MpiComm. Sizes and
// aliasing are checked exactly as in comm.hpp. Nothing crosses between ranks, so traffic()
// stays zero.
#pragma once

#include "engine/comm/comm.hpp"

namespace outcore::comm {

class LocalComm final : public Comm {
 public:
  int rank() const override { return 0; }
  int world_size() const override { return 1; }

  void all_gather(std::span<const float> send, std::span<float> recv) override;
  void all_gather_bytes(std::span<const std::byte> send, std::span<std::byte> recv) override;
  void reduce_scatter(std::span<const float> send, std::span<float> recv, ReduceOp op) override;
  // Over one rank sum and max are the identity: data is left unchanged.
  void all_reduce(std::span<float> data, ReduceOp op) override;
  void all_reduce(std::span<double> data, ReduceOp op) override;
  // root must be 0.
  void broadcast(std::span<float> data, int root) override;
  void broadcast_bytes(std::span<std::byte> data, int root) override;
  // One block: left unchanged.
  void all_to_all(std::span<float> data) override;
  void barrier() override {}
  void abort(int) override {}
  std::string_view name() const override { return "local"; }
};

}  // namespace outcore::comm
