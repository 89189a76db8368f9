// Run under `mpirun -np N`: checks every MpiComm collective, once with whole transfers and
// once with transfers split into pieces of 3 elements. Prints one line per rank and exits
// non-zero when any check fails.
#include <mpi.h>

#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "engine/comm/mpi_comm.hpp"
#include "tests/comm/collective_checks.hpp"

int main(int argc, char** argv) {
  int provided = 0;
  if (MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &provided) != MPI_SUCCESS) {
    std::fprintf(stderr, "comm_mpi_worker: MPI_Init_thread failed\n");
    return 2;
  }
  int failures = 0;
  try {
    outcore::comm::MpiComm whole;
    outcore::comm::MpiComm pieces(3);
    std::printf("comm_mpi_worker: rank %d of %d started\n", whole.rank(), whole.world_size());
    std::fflush(stdout);
    for (outcore::comm::MpiComm* c : {&whole, &pieces}) {
      for (const std::string& f : outcore::comm::testing::check_all_collectives(*c)) {
        std::fprintf(stderr, "comm_mpi_worker: %s\n", f.c_str());
        ++failures;
      }
    }
    if (failures == 0) std::printf("comm_mpi_worker: rank %d passed\n", whole.rank());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "comm_mpi_worker: %s\n", e.what());
    failures = 1;
  }
  std::fflush(stdout);
  MPI_Finalize();
  return failures == 0 ? 0 : 1;
}
