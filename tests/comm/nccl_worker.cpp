// Run under `mpirun -np N` (one GPU per rank: NCCL refuses two ranks on one device): checks
// every NcclComm collective on device buffers, once with whole transfers and once with
// transfers split into pieces of 3 elements, then that host buffers are refused. Prints one
// line per rank and exits non-zero when any check fails.
#include <mpi.h>

#include <cstdio>
#include <exception>
#include <string>
#include <vector>

#include "common/error.hpp"
#include "engine/comm/mpi_comm.hpp"
#include "engine/comm/nccl_comm.hpp"
#include "tests/comm/collective_checks.hpp"
#include "tests/comm/device_staged_comm.hpp"

int main(int argc, char** argv) {
  int provided = 0;
  if (MPI_Init_thread(&argc, &argv, MPI_THREAD_SERIALIZED, &provided) != MPI_SUCCESS) {
    std::fprintf(stderr, "nccl_worker: MPI_Init_thread failed\n");
    return 2;
  }
  int failures = 0;
  try {
    outcore::comm::MpiComm bootstrap;
    std::printf("nccl_worker: rank %d of %d started\n", bootstrap.rank(), bootstrap.world_size());
    std::fflush(stdout);
    outcore::comm::NcclComm whole(bootstrap);
    outcore::comm::NcclComm pieces(bootstrap, {.max_elems_per_call = 3});
    std::printf("nccl_worker: rank %d on CUDA device %d\n", whole.rank(), whole.device());
    for (outcore::comm::NcclComm* c : {&whole, &pieces}) {
      outcore::comm::testing::DeviceStagedComm staged(*c);
      for (const std::string& f : outcore::comm::testing::check_all_collectives(staged)) {
        std::fprintf(stderr, "nccl_worker: %s\n", f.c_str());
        ++failures;
      }
    }
    std::vector<float> host(4 * static_cast<size_t>(whole.world_size()));
    try {
      whole.all_reduce(std::span<float>(host), outcore::comm::ReduceOp::kSum);
      std::fprintf(stderr, "nccl_worker: all_reduce of host memory did not throw\n");
      ++failures;
    } catch (const outcore::InvalidArgument&) {
    }
    whole.barrier();
    if (failures == 0) std::printf("nccl_worker: rank %d passed\n", whole.rank());
  } catch (const std::exception& e) {
    std::fprintf(stderr, "nccl_worker: %s\n", e.what());
    failures = 1;
  }
  std::fflush(stdout);
  MPI_Finalize();
  return failures == 0 ? 0 : 1;
}
