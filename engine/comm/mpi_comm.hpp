// MpiComm: Comm over OpenMPI, one process per rank (host buffers; nccl_comm.hpp is the GPU one).
//
// Built only when OpenMPI is found (target outcore_comm_mpi, OUTCORE_HAVE_MPI). The
// collectives keep comm.hpp's contracts; counts above 2^30 elements are sent in pieces, so
// any size that fits in memory works.
#pragma once

#include <cstdint>
#include <memory>

#include "engine/comm/comm.hpp"

namespace outcore::comm {

class MpiComm final : public Comm {
 public:
  // Initializes MPI (thread level MPI_THREAD_MULTIPLE: different MpiComm objects may be used
  // from different threads at once, one thread per object) unless the process already did,
  // and works on a duplicate of MPI_COMM_WORLD with errors returned, not fatal. A process
  // not started by mpirun is a world of one. Throws outcore::Error when MPI cannot start.
  // `max_elems_per_call` caps the count of one MPI call (MPI counts are int); larger
  // transfers go in pieces. Tests lower it to exercise the piecewise paths.
  // When the caller initialized MPI itself, any number of MpiComm may exist and the caller
  // finalizes; otherwise the first MpiComm initializes and its destruction finalizes, after
  // which MPI cannot start again in this process.
  // REQUIRES: used from the thread that created it; 0 < max_elems_per_call <= 2^30.
  explicit MpiComm(size_t max_elems_per_call = size_t{1} << 30);
  // Frees the communicator; finalizes MPI if this object initialized it.
  ~MpiComm() override;

  int rank() const override;
  int world_size() const override;

  void all_gather(std::span<const float> send, std::span<float> recv) override;
  void all_gather_bytes(std::span<const std::byte> send, std::span<std::byte> recv) override;
  // The in-place form reduces into a temporary of one shard, then copies it into place.
  void reduce_scatter(std::span<const float> send, std::span<float> recv, ReduceOp op) override;
  void all_reduce(std::span<float> data, ReduceOp op) override;
  void all_reduce(std::span<double> data, ReduceOp op) override;
  void broadcast(std::span<float> data, int root) override;
  void broadcast_bytes(std::span<std::byte> data, int root) override;
  // Pieces of more than max_elems_per_call elements go through a staging buffer of
  // world x piece elements, one MPI_Alltoall per piece.
  void all_to_all(std::span<float> data) override;
  void barrier() override;
  // MPI_Abort on MPI_COMM_WORLD: the launcher (mpirun) ends every process of the job.
  void abort(int exit_code) override;
  std::string_view name() const override { return "mpi"; }

 private:
  uint64_t others() const;  // world - 1
  uint64_t world() const;
  uint64_t broadcast_bytes_sent(uint64_t bytes, int root) const;

  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace outcore::comm
