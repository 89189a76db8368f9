#include "engine/comm/nccl_comm.hpp"

#include <cuda_runtime.h>
#include <fmt/format.h>
#include <nccl.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cstring>
#include <exception>
#include <string>
#include <thread>
#include <vector>

#include "common/error.hpp"

namespace outcore::comm {
namespace {

[[noreturn]] void throw_cuda(cudaError_t err, std::string_view what, const char* stmt,
                             const char* file, int line) {
  throw Error(fmt::format("NcclComm {}: CUDA error {} ({}) in `{}` at {}:{}", what,
                          cudaGetErrorName(err), cudaGetErrorString(err), stmt, file, line));
}

[[noreturn]] void throw_nccl(ncclResult_t res, ncclComm_t comm, std::string_view what,
                             const char* stmt, const char* file, int line) {
  const char* last = ncclGetLastError(comm);
  throw Error(fmt::format("NcclComm {}: NCCL error {}{}{} in `{}` at {}:{}", what,
                          ncclGetErrorString(res), last != nullptr && *last ? ": " : "",
                          last != nullptr ? last : "", stmt, file, line));
}

// Each CUDA and NCCL call names the collective, the statement, the file and the line.
#define NCCL_COMM_CUDA(what, stmt)                                              \
  do {                                                                          \
    cudaError_t err_ = (stmt);                                                  \
    if (err_ != cudaSuccess) throw_cuda(err_, what, #stmt, __FILE__, __LINE__); \
  } while (0)

#define NCCL_COMM_NCCL(what, comm, stmt)                                              \
  do {                                                                                \
    ncclResult_t res_ = (stmt);                                                       \
    if (res_ != ncclSuccess) throw_nccl(res_, comm, what, #stmt, __FILE__, __LINE__); \
  } while (0)

struct StreamDestroy {
  void operator()(cudaStream_t s) const { cudaStreamDestroy(s); }
};
struct NcclDestroy {
  void operator()(ncclComm_t c) const { ncclCommDestroy(c); }
};
struct DeviceFree {
  void operator()(void* p) const { cudaFree(p); }
};
using StreamPtr = std::unique_ptr<CUstream_st, StreamDestroy>;
using NcclPtr = std::unique_ptr<ncclComm, NcclDestroy>;
using DevicePtr = std::unique_ptr<void, DeviceFree>;

ncclRedOp_t to_nccl(ReduceOp op) { return op == ReduceOp::kSum ? ncclSum : ncclMax; }

template <typename T>
ncclDataType_t nccl_type();
template <>
ncclDataType_t nccl_type<float>() {
  return ncclFloat32;
}
template <>
ncclDataType_t nccl_type<double>() {
  return ncclFloat64;
}
template <>
ncclDataType_t nccl_type<std::byte>() {
  return ncclUint8;
}

// Largest all_to_all staging buffer, in elements (256 MiB of floats): larger exchanges go in
// pieces so that the staging never doubles a large buffer.
constexpr size_t kMaxStageElems = size_t{1} << 26;

// Throws InvalidArgument unless [p, p + bytes) is device (or managed) memory of `device`.
void check_device_memory(std::string_view what, const void* p, size_t bytes, int device) {
  if (bytes == 0) return;
  cudaPointerAttributes a{};
  cudaError_t err = cudaPointerGetAttributes(&a, p);
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear the error so that a later CUDA call does not report it
    throw InvalidArgument(
        fmt::format("{}: cannot tell what memory {} is: {}", what, p, cudaGetErrorString(err)));
  }
  if (a.type == cudaMemoryTypeManaged) return;
  if (a.type != cudaMemoryTypeDevice) {
    throw InvalidArgument(fmt::format(
        "{}: buffer at {} is not device memory; NcclComm collectives take device pointers", what,
        p));
  }
  if (a.device != device) {
    throw InvalidArgument(fmt::format("{}: buffer at {} is on CUDA device {}, this rank uses {}",
                                      what, p, a.device, device));
  }
}

// This rank's index among the ranks on its host. Collective over `bootstrap`.
int local_rank(Comm& bootstrap) {
  constexpr size_t kName = 256;
  std::array<char, kName> host{};
  if (gethostname(host.data(), kName - 1) != 0) std::strcpy(host.data(), "?");
  std::vector<std::byte> all(kName * static_cast<size_t>(bootstrap.world_size()));
  bootstrap.all_gather_bytes(std::as_bytes(std::span(host)), all);
  int local = 0;
  for (int r = 0; r < bootstrap.rank(); ++r)
    if (std::memcmp(all.data() + kName * static_cast<size_t>(r), host.data(), kName) == 0) ++local;
  return local;
}

}  // namespace

struct NcclComm::State {
  Comm* bootstrap = nullptr;
  int rank = 0;
  int world = 1;
  int device = 0;
  size_t max_count = size_t{1} << 31;
  StreamPtr stream;
  DevicePtr one;  // one float for barrier()
  DevicePtr stage;
  size_t stage_bytes = 0;
  NcclPtr comm;  // destroyed first (declared last)

  cudaStream_t st() const { return stream.get(); }
  ncclComm_t nc() const { return comm.get(); }

  // Opens this rank's device and stream; on rank 0 also makes the NCCL id.
  void open_device(int requested, int local, ncclUniqueId* id) {
    int count = 0;
    NCCL_COMM_CUDA("setup", cudaGetDeviceCount(&count));
    if (count == 0) throw Error("NcclComm setup: the CUDA runtime reports no device");
    device = requested >= 0 ? requested : local % count;
    if (device >= count) {
      throw InvalidArgument(fmt::format("NcclComm setup: CUDA device {} does not exist ({} {})",
                                        device, count, count == 1 ? "device" : "devices"));
    }
    NCCL_COMM_CUDA("setup", cudaSetDevice(device));
    cudaStream_t raw = nullptr;
    NCCL_COMM_CUDA("setup", cudaStreamCreateWithFlags(&raw, cudaStreamNonBlocking));
    stream.reset(raw);
    void* p = nullptr;
    NCCL_COMM_CUDA("setup", cudaMalloc(&p, sizeof(float)));
    one.reset(p);
    if (rank == 0) NCCL_COMM_NCCL("setup", nullptr, ncclGetUniqueId(id));
  }

  // Waits for the stream, watching for an asynchronous NCCL error (a peer that died) so that
  // a broken communicator throws instead of hanging.
  void wait(std::string_view what) {
    for (;;) {
      cudaError_t err = cudaStreamQuery(st());
      if (err == cudaSuccess) return;
      if (err != cudaErrorNotReady) throw_cuda(err, what, "cudaStreamQuery", __FILE__, __LINE__);
      (void)cudaGetLastError();  // not a failure: the next check on this thread must not see it
      ncclResult_t async = ncclSuccess;
      NCCL_COMM_NCCL(what, nc(), ncclCommGetAsyncError(nc(), &async));
      if (async != ncclSuccess) throw_nccl(async, nc(), what, "(asynchronous)", __FILE__, __LINE__);
      std::this_thread::yield();
    }
  }

  float* staging(size_t elems) {
    const size_t bytes = elems * sizeof(float);
    if (bytes > stage_bytes) {
      stage.reset();
      stage_bytes = 0;
      void* p = nullptr;
      NCCL_COMM_CUDA("all_to_all", cudaSetDevice(device));
      NCCL_COMM_CUDA("all_to_all", cudaMalloc(&p, bytes));
      stage.reset(p);
      stage_bytes = bytes;
    }
    return static_cast<float*>(stage.get());
  }

  template <typename T>
  void enqueue_broadcast(T* data, size_t n, int root, std::string_view what) {
    for (size_t off = 0; off < n; off += max_count) {
      const size_t c = std::min(max_count, n - off);
      NCCL_COMM_NCCL(what, nc(),
                     ncclBroadcast(data + off, data + off, c, nccl_type<T>(), root, nc(), st()));
    }
  }

  template <typename T>
  void all_reduce(T* data, size_t n, ReduceOp op) {
    for (size_t off = 0; off < n; off += max_count) {
      const size_t c = std::min(max_count, n - off);
      NCCL_COMM_NCCL(
          "all_reduce", nc(),
          ncclAllReduce(data + off, data + off, c, nccl_type<T>(), to_nccl(op), nc(), st()));
    }
    wait("all_reduce");
  }

  template <typename T>
  void broadcast(T* data, size_t n, int root, std::string_view what) {
    enqueue_broadcast(data, n, root, what);
    wait(what);
  }

  // In place (send == own shard) is NCCL's own in-place all-gather.
  template <typename T>
  void all_gather(const T* send, T* recv, size_t shard, std::string_view what) {
    if (shard == 0) return;
    T* own = recv + static_cast<size_t>(rank) * shard;
    if (shard <= max_count) {
      NCCL_COMM_NCCL(what, nc(), ncclAllGather(send, recv, shard, nccl_type<T>(), nc(), st()));
    } else {
      // Too large for one call: every rank broadcasts its shard in pieces.
      if (send != own) {
        NCCL_COMM_CUDA(
            what, cudaMemcpyAsync(own, send, shard * sizeof(T), cudaMemcpyDeviceToDevice, st()));
      }
      for (int r = 0; r < world; ++r)
        enqueue_broadcast(recv + static_cast<size_t>(r) * shard, shard, r, what);
    }
    wait(what);
  }

  // In place (recv == own shard of send) is NCCL's own in-place reduce-scatter.
  void reduce_scatter(const float* send, float* recv, size_t shard, ReduceOp op) {
    if (shard == 0) return;
    if (shard <= max_count) {
      NCCL_COMM_NCCL("reduce_scatter", nc(),
                     ncclReduceScatter(send, recv, shard, ncclFloat32, to_nccl(op), nc(), st()));
    } else {
      // Too large for one call: reduce each rank's shard to it, piece by piece (in place at
      // the root when recv is its own shard of send).
      for (int r = 0; r < world; ++r) {
        const float* src = send + static_cast<size_t>(r) * shard;
        for (size_t off = 0; off < shard; off += max_count) {
          const size_t c = std::min(max_count, shard - off);
          NCCL_COMM_NCCL(
              "reduce_scatter", nc(),
              ncclReduce(src + off, recv + off, c, ncclFloat32, to_nccl(op), r, nc(), st()));
        }
      }
    }
    wait("reduce_scatter");
  }

  // Piece [off, off + c) of every block is copied into the staging buffer (one 2-D copy), then
  // sent from there to its rank while the same piece from each rank lands in place.
  void all_to_all(float* data, size_t block) {
    if (block == 0) return;
    const size_t w = static_cast<size_t>(world);
    const size_t piece = std::min({block, max_count, std::max<size_t>(1, kMaxStageElems / w)});
    float* stage_buf = staging(w * piece);
    for (size_t off = 0; off < block; off += piece) {
      const size_t c = std::min(piece, block - off);
      NCCL_COMM_CUDA("all_to_all", cudaMemcpy2DAsync(stage_buf, c * sizeof(float), data + off,
                                                     block * sizeof(float), c * sizeof(float), w,
                                                     cudaMemcpyDeviceToDevice, st()));
      NCCL_COMM_NCCL("all_to_all", nc(), ncclGroupStart());
      for (int r = 0; r < world; ++r) {
        const size_t ur = static_cast<size_t>(r);
        NCCL_COMM_NCCL("all_to_all", nc(),
                       ncclSend(stage_buf + ur * c, c, ncclFloat32, r, nc(), st()));
        NCCL_COMM_NCCL("all_to_all", nc(),
                       ncclRecv(data + ur * block + off, c, ncclFloat32, r, nc(), st()));
      }
      NCCL_COMM_NCCL("all_to_all", nc(), ncclGroupEnd());
    }
    wait("all_to_all");
  }
};

NcclComm::NcclComm(Comm& bootstrap, NcclCommOptions options) : state_(std::make_unique<State>()) {
  if (options.max_elems_per_call == 0 || options.max_elems_per_call > (size_t{1} << 31)) {
    throw InvalidArgument(fmt::format("NcclComm: max_elems_per_call {} is outside [1, 2^31]",
                                      options.max_elems_per_call));
  }
  if (options.device < -1) {
    throw InvalidArgument(fmt::format("NcclComm: device {} is negative", options.device));
  }
  State& s = *state_;
  s.bootstrap = &bootstrap;
  s.rank = bootstrap.rank();
  s.world = bootstrap.world_size();
  s.max_count = options.max_elems_per_call;
  const int local = local_rank(bootstrap);
  ncclUniqueId id{};
  std::exception_ptr failure;
  try {
    s.open_device(options.device, local, &id);
  } catch (const Error&) {
    failure = std::current_exception();
  }
  // Every rank learns whether one failed before rank 0 sends the id, so none waits forever.
  double failed = failure ? 1.0 : 0.0;
  bootstrap.all_reduce(std::span<double>(&failed, 1), ReduceOp::kMax);
  if (failure) std::rethrow_exception(failure);
  if (failed != 0.0) throw Error("NcclComm setup: another rank could not open its CUDA device");
  bootstrap.broadcast_bytes(std::as_writable_bytes(std::span(&id, 1)), 0);
  ncclComm_t raw = nullptr;
  NCCL_COMM_CUDA("setup", cudaSetDevice(s.device));
  NCCL_COMM_NCCL("setup", nullptr, ncclCommInitRank(&raw, s.world, id, s.rank));
  s.comm.reset(raw);
}

NcclComm::~NcclComm() = default;

int NcclComm::rank() const { return state_->rank; }
int NcclComm::world_size() const { return state_->world; }
int NcclComm::device() const { return state_->device; }

void NcclComm::all_gather(std::span<const float> send, std::span<float> recv) {
  detail::check_gather("all_gather", send.data(), send.size_bytes(), recv.data(), recv.size_bytes(),
                       state_->rank, state_->world);
  check_device_memory("all_gather", send.data(), send.size_bytes(), state_->device);
  check_device_memory("all_gather", recv.data(), recv.size_bytes(), state_->device);
  count(Kind::kAllGather, others() * send.size_bytes());
  state_->all_gather(send.data(), recv.data(), send.size(), "all_gather");
}

void NcclComm::all_gather_bytes(std::span<const std::byte> send, std::span<std::byte> recv) {
  detail::check_gather("all_gather_bytes", send.data(), send.size_bytes(), recv.data(),
                       recv.size_bytes(), state_->rank, state_->world);
  check_device_memory("all_gather_bytes", send.data(), send.size_bytes(), state_->device);
  check_device_memory("all_gather_bytes", recv.data(), recv.size_bytes(), state_->device);
  count(Kind::kAllGather, others() * send.size_bytes());
  state_->all_gather(send.data(), recv.data(), send.size(), "all_gather_bytes");
}

void NcclComm::reduce_scatter(std::span<const float> send, std::span<float> recv, ReduceOp op) {
  detail::check_scatter("reduce_scatter", send.data(), send.size_bytes(), recv.data(),
                        recv.size_bytes(), state_->rank, state_->world);
  check_device_memory("reduce_scatter", send.data(), send.size_bytes(), state_->device);
  check_device_memory("reduce_scatter", recv.data(), recv.size_bytes(), state_->device);
  count(Kind::kReduceScatter, others() * recv.size_bytes());
  state_->reduce_scatter(send.data(), recv.data(), recv.size(), op);
}

void NcclComm::all_reduce(std::span<float> data, ReduceOp op) {
  check_device_memory("all_reduce", data.data(), data.size_bytes(), state_->device);
  count(Kind::kAllReduce, 2 * others() * data.size_bytes() / world());
  state_->all_reduce(data.data(), data.size(), op);
}

void NcclComm::all_reduce(std::span<double> data, ReduceOp op) {
  check_device_memory("all_reduce", data.data(), data.size_bytes(), state_->device);
  count(Kind::kAllReduce, 2 * others() * data.size_bytes() / world());
  state_->all_reduce(data.data(), data.size(), op);
}

void NcclComm::broadcast(std::span<float> data, int root) {
  detail::check_root("broadcast", root, state_->world);
  check_device_memory("broadcast", data.data(), data.size_bytes(), state_->device);
  const uint64_t bytes = data.size_bytes();
  count(Kind::kBroadcast, state_->rank == root ? bytes : bytes * others() / world());
  state_->broadcast(data.data(), data.size(), root, "broadcast");
}

void NcclComm::broadcast_bytes(std::span<std::byte> data, int root) {
  detail::check_root("broadcast_bytes", root, state_->world);
  check_device_memory("broadcast_bytes", data.data(), data.size_bytes(), state_->device);
  const uint64_t bytes = data.size_bytes();
  count(Kind::kBroadcast, state_->rank == root ? bytes : bytes * others() / world());
  state_->broadcast(data.data(), data.size(), root, "broadcast_bytes");
}

void NcclComm::all_to_all(std::span<float> data) {
  detail::check_blocks("all_to_all", data.size(), state_->world);
  check_device_memory("all_to_all", data.data(), data.size_bytes(), state_->device);
  const size_t block = data.size() / static_cast<size_t>(state_->world);
  count(Kind::kAllToAll, others() * block * sizeof(float));
  state_->all_to_all(data.data(), block);
}

void NcclComm::barrier() {
  count(Kind::kBarrier, 0);
  float* one = static_cast<float*>(state_->one.get());
  NCCL_COMM_NCCL("barrier", state_->nc(),
                 ncclAllReduce(one, one, 1, ncclFloat32, ncclSum, state_->nc(), state_->st()));
  state_->wait("barrier");
}

void NcclComm::abort(int exit_code) {
  if (state_->comm) ncclCommAbort(state_->comm.release());
  state_->bootstrap->abort(exit_code);
}

uint64_t NcclComm::others() const { return static_cast<uint64_t>(state_->world - 1); }
uint64_t NcclComm::world() const { return static_cast<uint64_t>(state_->world); }

}  // namespace outcore::comm
