#include "tools/outcore/launch.hpp"

#include <cstdio>
#include <cstdlib>

#include "common/error.hpp"
#include "engine/comm/local_comm.hpp"
#ifdef OUTCORE_HAVE_MPI
#include "engine/comm/mpi_comm.hpp"
#endif

namespace outcore::cli {

bool started_by_mpi_launcher() {
  for (const char* var : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"})
    if (std::getenv(var) != nullptr) return true;
  return false;
}

std::optional<Ranks> open_ranks(const std::string& choice) {
  if (choice != "auto" && choice != "local" && choice != "mpi" && choice != "nccl") {
    std::fprintf(stderr, "error: --comm: got \"%s\"; allowed: auto, local, mpi, nccl\n",
                 choice.c_str());
    return std::nullopt;
  }
  if (choice == "nccl") {
    std::fprintf(stderr,
                 "error: --comm nccl: NCCL carries collectives between CUDA devices, and "
                 "training runs on the host device in this build; use --comm mpi\n");
    return std::nullopt;
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
