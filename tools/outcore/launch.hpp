// Data-parallel launch: the Comms a training command runs on, chosen from how the process
// was started (one process per rank under OpenMPI's mpirun) or forced with --comm.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "engine/comm/comm.hpp"

namespace outcore::cli {

// The engine's Comm and the trainer's control Comm over the same ranks (the first one
// created owns MPI's lifetime and is destroyed last).
struct Ranks {
  std::unique_ptr<comm::Comm> engine;
  std::unique_ptr<comm::Comm> control;
  int rank() const { return engine->rank(); }
  int world() const { return engine->world_size(); }
};

// True when an MPI launcher started this process (OpenMPI's OMPI_COMM_WORLD_SIZE, or the
// PMI/PMIx variables of other launchers).
bool started_by_mpi_launcher();

// `choice`: "auto" (MPI when started by an MPI launcher, else a world of one), "local", "mpi"
// or "nccl". Prints one "error: --comm ..." line on stderr and returns nullopt when the
// choice cannot be had (MPI not built in, NCCL without CUDA devices, MPI failing to start).
std::optional<Ranks> open_ranks(const std::string& choice);

}  // namespace outcore::cli
