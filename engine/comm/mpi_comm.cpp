#include "engine/comm/mpi_comm.hpp"

#include <fmt/format.h>
#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <cstring>
#include <string>
#include <vector>

#include "common/error.hpp"

namespace outcore::comm {
namespace {

std::string mpi_error_text(int code) {
  char text[MPI_MAX_ERROR_STRING];
  int len = 0;
  if (MPI_Error_string(code, text, &len) != MPI_SUCCESS) return fmt::format("MPI error {}", code);
  return std::string(text, static_cast<size_t>(len));
}

void check(int code, std::string_view what) {
  if (code != MPI_SUCCESS) {
    throw Error(fmt::format("MPI {} failed: {}", what, mpi_error_text(code)));
  }
}

MPI_Op to_mpi(ReduceOp op) { return op == ReduceOp::kSum ? MPI_SUM : MPI_MAX; }

template <typename T>
MPI_Datatype mpi_type();
template <>
MPI_Datatype mpi_type<float>() {
  return MPI_FLOAT;
}
template <>
MPI_Datatype mpi_type<double>() {
  return MPI_DOUBLE;
}
template <>
MPI_Datatype mpi_type<std::byte>() {
  return MPI_BYTE;
}

}  // namespace

struct MpiComm::State {
  MPI_Comm comm = MPI_COMM_NULL;
  bool owns_mpi = false;
  pid_t launcher = 0;  // the parent when MPI was initialised here (mpirun, or its daemon)
  int rank = 0;
  int world = 1;
  size_t max_count = size_t{1} << 30;  // largest count handed to one MPI call

  template <typename T>
  void all_reduce(T* data, size_t n, ReduceOp op) {
    for (size_t off = 0; off < n; off += max_count) {
      int count = static_cast<int>(std::min(max_count, n - off));
      check(MPI_Allreduce(MPI_IN_PLACE, data + off, count, mpi_type<T>(), to_mpi(op), comm),
            "all_reduce");
    }
  }

  template <typename T>
  void broadcast(T* data, size_t n, int root) {
    for (size_t off = 0; off < n; off += max_count) {
      int count = static_cast<int>(std::min(max_count, n - off));
      check(MPI_Bcast(data + off, count, mpi_type<T>(), root, comm), "broadcast");
    }
  }

  template <typename T>
  void all_gather(const T* send, T* recv, size_t shard) {
    T* own = recv + static_cast<size_t>(rank) * shard;
    if (shard <= max_count) {
      const void* src = send == own ? MPI_IN_PLACE : static_cast<const void*>(send);
      int count = static_cast<int>(shard);
      check(MPI_Allgather(src, count, mpi_type<T>(), recv, count, mpi_type<T>(), comm),
            "all_gather");
      return;
    }
    // Too large for one call: every rank broadcasts its shard in pieces.
    if (send != own) std::memcpy(own, send, shard * sizeof(T));
    for (int r = 0; r < world; ++r) broadcast(recv + static_cast<size_t>(r) * shard, shard, r);
  }

  void all_to_all(float* data, size_t block) {
    if (block <= max_count) {
      check(MPI_Alltoall(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, data, static_cast<int>(block),
                         MPI_FLOAT, comm),
            "all_to_all");
      return;
    }
    // Piece by piece: piece [off, off + c) of every block gathered into a staging buffer,
    // exchanged, and put back.
    const size_t w = static_cast<size_t>(world);
    const size_t piece = std::max<size_t>(1, max_count / w);
    std::vector<float> stage(w * std::min(piece, block));
    for (size_t off = 0; off < block; off += piece) {
      const size_t c = std::min(piece, block - off);
      for (size_t r = 0; r < w; ++r)
        std::memcpy(stage.data() + r * c, data + r * block + off, c * sizeof(float));
      check(MPI_Alltoall(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, stage.data(), static_cast<int>(c),
                         MPI_FLOAT, comm),
            "all_to_all");
      for (size_t r = 0; r < w; ++r)
        std::memcpy(data + r * block + off, stage.data() + r * c, c * sizeof(float));
    }
  }

  void reduce_scatter(const float* send, float* recv, size_t shard, ReduceOp op) {
    const float* own = send + static_cast<size_t>(rank) * shard;
    if (shard <= max_count) {
      int count = static_cast<int>(shard);
      if (recv != own) {
        check(MPI_Reduce_scatter_block(send, recv, count, MPI_FLOAT, to_mpi(op), comm),
              "reduce_scatter");
        return;
      }
      std::vector<float> tmp(shard);
      check(MPI_Reduce_scatter_block(send, tmp.data(), count, MPI_FLOAT, to_mpi(op), comm),
            "reduce_scatter");
      std::memcpy(recv, tmp.data(), shard * sizeof(float));
      return;
    }
    // Too large for one call: reduce each rank's shard to it, piece by piece.
    for (int r = 0; r < world; ++r) {
      const float* src = send + static_cast<size_t>(r) * shard;
      for (size_t off = 0; off < shard; off += max_count) {
        int count = static_cast<int>(std::min(max_count, shard - off));
        if (r == rank) {
          const void* in = recv == own ? MPI_IN_PLACE : static_cast<const void*>(src + off);
          check(MPI_Reduce(in, recv + off, count, MPI_FLOAT, to_mpi(op), r, comm),
                "reduce_scatter");
        } else {
          check(MPI_Reduce(src + off, nullptr, count, MPI_FLOAT, to_mpi(op), r, comm),
                "reduce_scatter");
        }
      }
    }
  }
};

MpiComm::MpiComm(size_t max_elems_per_call) : state_(std::make_unique<State>()) {
  if (max_elems_per_call == 0 || max_elems_per_call > (size_t{1} << 30)) {
    throw InvalidArgument(
        fmt::format("MpiComm: max_elems_per_call {} is outside [1, 2^30]", max_elems_per_call));
  }
  state_->max_count = max_elems_per_call;
  int initialized = 0;
  check(MPI_Initialized(&initialized), "MPI_Initialized");
  if (!initialized) {
    int provided = 0;
    check(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided), "MPI_Init_thread");
    state_->owns_mpi = true;
    state_->launcher = ::getppid();
    if (provided < MPI_THREAD_MULTIPLE) {
      MPI_Finalize();
      throw Error(
          "MPI: the MPI library does not provide MPI_THREAD_MULTIPLE (a Comm per stream "
          "thread needs it); use an OpenMPI built with thread support");
    }
  }
  check(MPI_Comm_dup(MPI_COMM_WORLD, &state_->comm), "MPI_Comm_dup");
  check(MPI_Comm_set_errhandler(state_->comm, MPI_ERRORS_RETURN), "MPI_Comm_set_errhandler");
  check(MPI_Comm_rank(state_->comm, &state_->rank), "MPI_Comm_rank");
  check(MPI_Comm_size(state_->comm, &state_->world), "MPI_Comm_size");
}

MpiComm::~MpiComm() {
  if (state_->comm != MPI_COMM_NULL) MPI_Comm_free(&state_->comm);
  int finalized = 0;
  MPI_Finalized(&finalized);
  // MPI_Finalize waits for the launcher, which a job whose mpirun was killed no longer has: a
  // rank then ends without it (its files are already removed) instead of waiting for ever.
  if (state_->owns_mpi && !finalized && ::getppid() == state_->launcher) MPI_Finalize();
}

int MpiComm::rank() const { return state_->rank; }
int MpiComm::world_size() const { return state_->world; }

void MpiComm::all_gather(std::span<const float> send, std::span<float> recv) {
  detail::check_gather("all_gather", send.data(), send.size_bytes(), recv.data(), recv.size_bytes(),
                       state_->rank, state_->world);
  count(Kind::kAllGather, others() * send.size_bytes());
  const Timed timed(*this);
  state_->all_gather(send.data(), recv.data(), send.size());
}

void MpiComm::all_gather_bytes(std::span<const std::byte> send, std::span<std::byte> recv) {
  detail::check_gather("all_gather_bytes", send.data(), send.size_bytes(), recv.data(),
                       recv.size_bytes(), state_->rank, state_->world);
  count(Kind::kAllGather, others() * send.size_bytes());
  const Timed timed(*this);
  state_->all_gather(send.data(), recv.data(), send.size());
}

void MpiComm::reduce_scatter(std::span<const float> send, std::span<float> recv, ReduceOp op) {
  detail::check_scatter("reduce_scatter", send.data(), send.size_bytes(), recv.data(),
                        recv.size_bytes(), state_->rank, state_->world);
  count(Kind::kReduceScatter, others() * recv.size_bytes());
  const Timed timed(*this);
  state_->reduce_scatter(send.data(), recv.data(), recv.size(), op);
}

void MpiComm::all_reduce(std::span<float> data, ReduceOp op) {
  count(Kind::kAllReduce, 2 * others() * data.size_bytes() / world());
  const Timed timed(*this);
  state_->all_reduce(data.data(), data.size(), op);
}

void MpiComm::all_reduce(std::span<double> data, ReduceOp op) {
  count(Kind::kAllReduce, 2 * others() * data.size_bytes() / world());
  const Timed timed(*this);
  state_->all_reduce(data.data(), data.size(), op);
}

void MpiComm::broadcast(std::span<float> data, int root) {
  detail::check_root("broadcast", root, state_->world);
  count(Kind::kBroadcast, broadcast_bytes_sent(data.size_bytes(), root));
  const Timed timed(*this);
  state_->broadcast(data.data(), data.size(), root);
}

void MpiComm::broadcast_bytes(std::span<std::byte> data, int root) {
  detail::check_root("broadcast_bytes", root, state_->world);
  count(Kind::kBroadcast, broadcast_bytes_sent(data.size_bytes(), root));
  const Timed timed(*this);
  state_->broadcast(data.data(), data.size(), root);
}

void MpiComm::all_to_all(std::span<float> data) {
  detail::check_blocks("all_to_all", data.size(), state_->world);
  const size_t block = data.size() / static_cast<size_t>(state_->world);
  count(Kind::kAllToAll, others() * block * sizeof(float));
  const Timed timed(*this);
  state_->all_to_all(data.data(), block);
}

void MpiComm::barrier() {
  count(Kind::kBarrier, 0);
  const Timed timed(*this);
  check(MPI_Barrier(state_->comm), "barrier");
}

void MpiComm::abort(int exit_code) { MPI_Abort(MPI_COMM_WORLD, exit_code); }

uint64_t MpiComm::others() const { return static_cast<uint64_t>(state_->world - 1); }
uint64_t MpiComm::world() const { return static_cast<uint64_t>(state_->world); }

uint64_t MpiComm::broadcast_bytes_sent(uint64_t bytes, int root) const {
  return state_->rank == root ? bytes : bytes * others() / world();
}

}  // namespace outcore::comm
