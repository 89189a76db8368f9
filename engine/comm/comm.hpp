// Comm: the collectives ZeRO needs between data-parallel ranks, behind one small interface.
//
// Implementations: LocalComm (world size 1, this header's companion local_comm.hpp),
// MpiComm (OpenMPI, one process per rank, mpi_comm.hpp, built when OpenMPI is found) and
// NcclComm (NCCL between CUDA devices, nccl_comm.hpp, built when CUDA and NCCL are found; its
// spans point to device memory).
//
// Contracts shared by every implementation:
// - Every call is collective: all ranks call the same functions in the same order with the
//   same sizes (and the same root). A call blocks until this rank's part is done; on return
//   the output buffer holds the result and the input buffer may be reused.
// - Sizes are in elements of the span's type. "shard" below is the per-rank size; a full
//   buffer is world_size() x shard elements, rank r's shard being elements
//   [r*shard, (r+1)*shard). Size mismatches throw InvalidArgument before anything is sent.
// - Aliasing: each call says which overlaps are allowed. Any other overlap between the
//   input and the output is an InvalidArgument.
// - Floating-point reductions are in fp32 (or fp64 for the double overload); the order of
//   summation across ranks is fixed for a given world size, so results are reproducible
//   run to run, but not bit-identical across different world sizes. Code that needs sums
//   independent of the world size moves the data with all_to_all / all_gather and adds it in
//   an order of its own (engine/zero does).
// - Threading: a Comm object is used by one thread at a time (REQUIRES external
//   serialization); different Comm objects are independent.
// - Errors: a failure of the transport throws outcore::Error naming the collective.
#pragma once

#include <atomic>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace outcore::comm {

enum class ReduceOp { kSum, kMax };

std::string_view reduce_op_name(ReduceOp op);

// Bytes this rank sent to other ranks, per collective, counted with the volumes of the
// bandwidth-optimal algorithms (ring all-gather / reduce-scatter: (world-1) shards; all-to-all:
// (world-1) blocks; all-reduce: 2 (world-1)/world of the buffer; broadcast: the buffer from
// the root, (world-1)/world of it from the others in a pipelined tree). These are the
// volumes ZeRO's analysis uses, whatever algorithm the transport picks. All zero at world 1.
struct CommTraffic {
  uint64_t all_gather = 0;
  uint64_t reduce_scatter = 0;
  uint64_t all_to_all = 0;
  uint64_t all_reduce = 0;
  uint64_t broadcast = 0;
  uint64_t calls = 0;  // collectives called (barriers included)
  double seconds = 0;  // wall time spent inside collectives (where the implementation times them)
  uint64_t total() const {
    return all_gather + reduce_scatter + all_to_all + all_reduce + broadcast;
  }
};

class Comm {
 public:
  virtual ~Comm() = default;
  Comm() = default;
  Comm(const Comm&) = delete;
  Comm& operator=(const Comm&) = delete;

  // This process's rank in [0, world_size()).
  virtual int rank() const = 0;
  // Number of data-parallel ranks, >= 1.
  virtual int world_size() const = 0;

  // all_gather: `send` is this rank's shard; on return recv[r*shard, (r+1)*shard) holds rank
  // r's shard for every r. REQUIRES recv.size() == world_size() * send.size().
  // In place: allowed when send is exactly recv's own shard
  // (send.data() == recv.data() + rank()*send.size()); no other overlap.
  virtual void all_gather(std::span<const float> send, std::span<float> recv) = 0;
  virtual void all_gather_bytes(std::span<const std::byte> send, std::span<std::byte> recv) = 0;

  // reduce_scatter: `send` is a full buffer (world x shard); on return `recv` (shard elements)
  // holds op over all ranks of their send[rank()*shard, (rank()+1)*shard).
  // REQUIRES send.size() == world_size() * recv.size().
  // In place: allowed when recv is exactly this rank's shard of send
  // (recv.data() == send.data() + rank()*recv.size()); the rest of send is then left with
  // unspecified contents. No other overlap.
  virtual void reduce_scatter(std::span<const float> send, std::span<float> recv, ReduceOp op) = 0;

  // all_reduce: in place; on return every rank's `data` holds op over all ranks' `data`.
  virtual void all_reduce(std::span<float> data, ReduceOp op) = 0;
  virtual void all_reduce(std::span<double> data, ReduceOp op) = 0;

  // broadcast: in place; on return every rank's `data` equals rank `root`'s.
  // REQUIRES 0 <= root < world_size() (else InvalidArgument) and equal sizes on all ranks.
  virtual void broadcast(std::span<float> data, int root) = 0;
  virtual void broadcast_bytes(std::span<std::byte> data, int root) = 0;

  // all_to_all: in place; `data` is world_size() blocks of b = data.size() / world_size()
  // elements, block r being what this rank sends to rank r. On return block r holds what
  // rank r sent to this rank (its block rank()). REQUIRES data.size() % world_size() == 0
  // (InvalidArgument otherwise).
  virtual void all_to_all(std::span<float> data) = 0;

  // barrier: returns once every rank has entered it.
  virtual void barrier() = 0;

  // Ends every rank of the job now with `exit_code`, for a rank that failed while the others
  // may be waiting for it in a collective. Not collective. Returns only at world size 1 (the
  // caller then exits the normal way).
  virtual void abort(int exit_code) = 0;

  // Short name of the implementation ("local", "mpi") for logs.
  virtual std::string_view name() const = 0;

  // What this rank has sent since construction (see CommTraffic). May be read from any
  // thread while collectives run.
  CommTraffic traffic() const;

 protected:
  enum class Kind { kAllGather, kReduceScatter, kAllToAll, kAllReduce, kBroadcast, kBarrier };
  // Implementations call this once per collective with the bytes this rank sends.
  void count(Kind kind, uint64_t bytes);
  // Adds the wall time from its construction to its destruction to CommTraffic::seconds.
  class Timed {
   public:
    explicit Timed(Comm& c);
    ~Timed();
    Timed(const Timed&) = delete;
    Timed& operator=(const Timed&) = delete;

   private:
    Comm& c_;
    int64_t start_ns_;
  };

 private:
  std::atomic<uint64_t> sent_[5] = {};
  std::atomic<uint64_t> calls_{0};
  std::atomic<int64_t> ns_{0};
};

// Every rank's `mine`, in rank order, on every rank (two all_gather_bytes: lengths, then the
// strings padded to the longest). Collective: every rank calls it.
std::vector<std::string> all_gather_strings(Comm& comm, const std::string& mine);

// Argument checks shared by implementations; each throws InvalidArgument naming `what`.
namespace detail {
// recv.size() == world * send.size(), and send either is recv's own shard or does not
// overlap recv.
void check_gather(std::string_view what, const void* send, size_t send_bytes, const void* recv,
                  size_t recv_bytes, int rank, int world);
// send.size() == world * recv.size(), and recv either is send's shard `rank` or does not
// overlap send.
void check_scatter(std::string_view what, const void* send, size_t send_bytes, const void* recv,
                   size_t recv_bytes, int rank, int world);
void check_root(std::string_view what, int root, int world);
// n % world == 0.
void check_blocks(std::string_view what, size_t n, int world);
// True when [a, a+an) and [b, b+bn) share a byte.
bool overlaps(const void* a, size_t an, const void* b, size_t bn);
}  // namespace detail

}  // namespace outcore::comm
