// Data-parallel launch: the Comms a training command runs on, chosen from how the process
// was started (one process per rank under OpenMPI's mpirun) or forced with --comm.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "engine/comm/comm.hpp"
#include "engine/device/device.hpp"

namespace outcore::cli {

// The engine's Comm and the trainer's control Comm over the same ranks (the first one
// created owns MPI's lifetime and is destroyed last). With NCCL the engine's Comm is an
// NcclComm started through `bootstrap`, an MpiComm created first and destroyed last.
struct Ranks {
  std::unique_ptr<comm::Comm> bootstrap;  // null unless the engine's Comm is an NcclComm
  std::unique_ptr<comm::Comm> engine;
  std::unique_ptr<comm::Comm> control;
  int rank() const { return engine->rank(); }
  int world() const { return engine->world_size(); }
};

// True when an MPI launcher started this process (OpenMPI's OMPI_COMM_WORLD_SIZE, or the
// PMI/PMIx variables of other launchers).
bool started_by_mpi_launcher();

// `choice`: "auto" (MPI when started by an MPI launcher, else a world of one; NCCL for the
// engine instead when the ranks compute on CUDA devices and NCCL is built in), "local", "mpi"
// or "nccl". `cuda_device`: the engine's collectives run on CUDA device buffers, which NCCL
// needs. Training's collectives run on pinned host memory in this release, on a GPU too, so it
// passes false and --comm nccl is refused. Prints one "error: --comm ..." line on stderr and
// returns nullopt when the choice cannot be had (MPI or NCCL not built in, NCCL with host buffers,
// MPI or NCCL failing to start).
std::optional<Ranks> open_ranks(const std::string& choice, bool cuda_device = false);

// Where this process's model computes.
struct DeviceChoice {
  device::DeviceKind kind = device::DeviceKind::Cpu;
  int gpu = 0;              // the GPU's ordinal (Cuda)
  std::string description;  // "cuda:1 (NVIDIA H100 ...)" or "the simulated device (...)"
};

// `choice`: "auto" (a GPU when this build has CUDA and the machine has one, else the simulated
// device), "cpu" (the simulated device) or "cuda" (a GPU, or an error). Under an MPI launcher
// each rank takes GPU (local rank mod GPU count), the local rank read from the launcher's
// environment (OMPI_COMM_WORLD_LOCAL_RANK, MPI_LOCALRANKID, SLURM_LOCALID, LOCAL_RANK).
// Prints one "error: --device ..." line on stderr and returns nullopt when it cannot be had.
std::optional<DeviceChoice> choose_device(const std::string& choice);

// The settings every data-parallel rank must share, as (name, value) pairs: the resolved
// config and the model config key by key, the sequence length, the data files with their
// sizes, the save directory, the build's version, ... Collective over `control` before
// anything is allocated: every rank gathers every rank's pairs. Returns true when all ranks
// have the same; otherwise rank 0 prints one "error:" line naming the first settings that
// differ with each rank's value, and every rank returns false (exit 2 everywhere, no hang).
bool ranks_agree(comm::Comm& control, const std::vector<std::pair<std::string, std::string>>& mine);

// outcore's version, as the build defines it.
const char* outcore_version();

}  // namespace outcore::cli
