#include "tools/outcore/launch.hpp"

#include <algorithm>
#include <cstdio>
#include <cstdlib>

#include "common/error.hpp"
#include "engine/comm/local_comm.hpp"
#ifdef OUTCORE_HAVE_MPI
#include "engine/comm/mpi_comm.hpp"
#endif
#if defined(OUTCORE_HAVE_NCCL_COMM) && defined(OUTCORE_HAVE_MPI)
#include "engine/comm/nccl_comm.hpp"
#define OUTCORE_LAUNCH_NCCL 1
#endif

namespace outcore::cli {

std::optional<DeviceChoice> choose_device(const std::string& choice) {
  if (choice != "auto" && choice != "cpu" && choice != "cuda") {
    std::fprintf(stderr, "error: --device: got \"%s\"; allowed: auto, cpu, cuda\n", choice.c_str());
    return std::nullopt;
  }
  const device::ProbeResult probe = device::probe();
  if (choice == "cpu") return DeviceChoice{.description = "the simulated device"};
  if (choice == "auto" && !probe.available)
    return DeviceChoice{.description = "the simulated device (" + probe.summary() + ")"};
  if (!probe.available) {
    std::fprintf(stderr, "error: --device cuda: %s\n", probe.summary().c_str());
    return std::nullopt;
  }
  int local_rank = 0;
  for (const char* var :
       {"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID", "LOCAL_RANK"}) {
    if (const char* v = std::getenv(var); v != nullptr) {
      local_rank = std::max(0, std::atoi(v));
      break;
    }
  }
  const device::GpuInfo& gpu = probe.gpus[local_rank % probe.gpus.size()];
  return DeviceChoice{.kind = device::DeviceKind::Cuda,
                      .gpu = gpu.ordinal,
                      .description = "cuda:" + std::to_string(gpu.ordinal) + " (" + gpu.name + ")"};
}

bool started_by_mpi_launcher() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"})
    if (std::getenv(var) != nullptr) return true;
  return false;
}

namespace {

// NcclComm for the engine, bootstrapped through an MpiComm; the control Comm stays MpiComm.
std::optional<Ranks> open_nccl_ranks() {
#ifdef OUTCORE_LAUNCH_NCCL
  Ranks r;
  try {
    r.bootstrap = std::make_unique<comm::MpiComm>();
    r.engine = std::make_unique<comm::NcclComm>(*r.bootstrap);
    r.control = std::make_unique<comm::MpiComm>();
  } catch (const Error& e) {
    std::fprintf(stderr, "error: --comm nccl: %s\n", e.what());
    return std::nullopt;
  }
  return r;
#else
  std::fprintf(stderr,
               "error: --comm nccl: this outcore was built without NCCL (it needs the CUDA "
               "toolkit with NCCL and OpenMPI at build time)\n");
  return std::nullopt;
#endif
}

}  // namespace

std::optional<Ranks> open_ranks(const std::string& choice, bool cuda_device) {
  if (choice != "auto" && choice != "local" && choice != "mpi" && choice != "nccl") {
    std::fprintf(stderr, "error: --comm: got \"%s\"; allowed: auto, local, mpi, nccl\n",
                 choice.c_str());
    return std::nullopt;
  }
  if (choice == "nccl" && !cuda_device) {
    std::fprintf(stderr,
                 "error: --comm nccl: NCCL needs device buffers, and the model computes on the "
                 "host in this release; use --comm mpi\n");
    return std::nullopt;
  }
#ifdef OUTCORE_LAUNCH_NCCL
  const bool nccl_built = true;
#else
  const bool nccl_built = false;
#endif
  if (choice == "nccl" || (choice == "auto" && cuda_device && nccl_built)) {
    return open_nccl_ranks();
  }
  const bool mpi = choice == "mpi" || (choice == "auto" && started_by_mpi_launcher());
  Ranks r;
  if (!mpi) {
    r.engine = std::make_unique<comm::LocalComm>();
    r.control = std::make_unique<comm::LocalComm>();
    return r;
  }
#ifdef OUTCORE_HAVE_MPI
  try {
    r.engine = std::make_unique<comm::MpiComm>();
    r.control = std::make_unique<comm::MpiComm>();
  } catch (const Error& e) {
    std::fprintf(stderr, "error: --comm mpi: %s\n", e.what());
    return std::nullopt;
  }
  return r;
#else
  std::fprintf(stderr,
               "error: --comm %s: this outcore was built without MPI (install libopenmpi-dev and "
               "rebuild)%s\n",
               choice.c_str(),
               choice == "auto" ? "; it was started by an MPI launcher (force --comm local to "
                                  "run each process alone)"
                                : "");
  return std::nullopt;
#endif
}

}  // namespace outcore::cli
