// NcclComm: Comm over NCCL between CUDA devices, one process (and one GPU) per rank.
//
// Built only when CUDA and NCCL are found (target outcore_comm_nccl, OUTCORE_HAVE_NCCL); NCCL
// comes from the CUDA toolkit. The collectives keep comm.hpp's contracts with one difference:
// every span points to DEVICE memory (cudaMalloc or managed memory on this comm's device);
// a host pointer is an InvalidArgument. Each call enqueues NCCL work on the comm's own CUDA
// stream and blocks until it is complete, so on return the result is in place, as comm.hpp
// says. Traffic is counted with the same volumes as MpiComm.
#pragma once

#include <cstddef>
#include <memory>

#include "engine/comm/comm.hpp"

namespace outcore::comm {

struct NcclCommOptions {
  // CUDA device ordinal of this rank. -1 (default): this rank's local rank modulo the number
  // of devices, the local rank being its index among the ranks on the same host (found by
  // exchanging host names over the bootstrap; the same value as OMPI_COMM_WORLD_LOCAL_RANK).
  // NCCL allows one rank per GPU: two ranks of a communicator on one device fail to start.
  int device = -1;
  // Largest count of one NCCL call, in elements; larger transfers go in pieces. NCCL counts
  // are size_t, so the default only bounds one call's staging; tests lower it to exercise the
  // piecewise paths. REQUIRES 0 < max_elems_per_call <= 2^31.
  size_t max_elems_per_call = size_t{1} << 31;
};

class NcclComm final : public Comm {
 public:
  // Collective over `bootstrap`'s ranks (the NCCL communicator gets the same ranks and world
  // size): picks and selects this rank's device, creates a CUDA stream on it, and starts NCCL
  // with a unique id made on rank 0 and sent with bootstrap.broadcast_bytes. A rank whose
  // device cannot be used tells the others over the bootstrap before the id is sent, so every
  // rank throws instead of waiting. Throws outcore::Error naming the CUDA or NCCL error (no
  // usable GPU, no driver, an invalid device ordinal, NCCL failing to start), InvalidArgument
  // for bad options. REQUIRES: `bootstrap` outlives this object (abort() uses it).
  explicit NcclComm(Comm& bootstrap, NcclCommOptions options = {});
  // Destroys the NCCL communicator, the stream and the staging buffers.
  ~NcclComm() override;

  int rank() const override;
  int world_size() const override;
  // CUDA device ordinal this rank uses.
  int device() const;

  void all_gather(std::span<const float> send, std::span<float> recv) override;
  void all_gather_bytes(std::span<const std::byte> send, std::span<std::byte> recv) override;
  void reduce_scatter(std::span<const float> send, std::span<float> recv, ReduceOp op) override;
  void all_reduce(std::span<float> data, ReduceOp op) override;
  void all_reduce(std::span<double> data, ReduceOp op) override;
  void broadcast(std::span<float> data, int root) override;
  void broadcast_bytes(std::span<std::byte> data, int root) override;
  // NCCL has no in-place all-to-all: each piece of every block is copied into a device staging
  // buffer (world x piece elements, kept between calls) and exchanged with grouped
  // ncclSend/ncclRecv into place.
  void all_to_all(std::span<float> data) override;
  // An all-reduce of one device element.
  void barrier() override;
  // ncclCommAbort, then the bootstrap's abort (which ends the job under mpirun).
  void abort(int exit_code) override;
  std::string_view name() const override { return "nccl"; }

 private:
  uint64_t others() const;  // world - 1
  uint64_t world() const;

  struct State;
  std::unique_ptr<State> state_;
};

}  // namespace outcore::comm
