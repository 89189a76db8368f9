// ThreadComm: a Comm between threads of one process, for tests that run several ranks in one
// process (on a GPU machine without mpirun, several engines on one GPU). Not a transport for
// training: outcore's ranks exchange through MPI or NCCL.
//
// The ranks of one ThreadGroup each hold a ThreadComm. A collective deposits this rank's
// buffer (with the collective's name and size), meets the other ranks, checks that they called
// the same collective with the same size (InvalidArgument on every rank otherwise), reads what
// it needs from theirs, and meets them again before returning, so no buffer is reused while
// another rank reads it. Sums go in rank order (the
// same bits on every rank, run to run). Sizes, aliasing and roots are checked as comm.hpp says;
// traffic is counted as MpiComm counts it.
//
// A rank that fails calls abort(): the group is broken, and the other ranks' collectives throw
// outcore::Error instead of waiting for it (except in a collective's second meeting, which every
// rank reaches once all have passed the first). `before`, when set, is called with the collective's
// name at the start of every collective (a test's check of the calling thread).
#pragma once

#include <fmt/format.h>

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string_view>
#include <vector>

#include "common/error.hpp"
#include "engine/comm/comm.hpp"

namespace outcore::comm::testing {

// memcpy of n bytes, nothing for none (empty spans may hold null pointers).
inline void copy_bytes(void* dst, const void* src, size_t n) {
  if (n != 0) std::memcpy(dst, src, n);
}

class ThreadGroup {
 public:
  explicit ThreadGroup(int world) : world_(world), slots_(static_cast<size_t>(world)) {
    if (world < 1) throw InvalidArgument(fmt::format("ThreadGroup: world {} < 1", world));
  }
  int world() const { return world_; }

  // What a rank deposits for one collective: its buffer (read by the others after meet()), and
  // what it called, to be checked against the others'.
  struct Slot {
    const void* ptr = nullptr;
    std::string_view what;
    size_t bytes = 0;
    int root = 0;
  };
  void deposit(int rank, Slot slot) { slots_[static_cast<size_t>(rank)] = slot; }
  const Slot& slot(int rank) const { return slots_[static_cast<size_t>(rank)]; }

  // Returns once every rank has called it as often as this one. `interruptible`: throws Error
  // naming `what` when the group is broken (else it waits for the others regardless).
  void meet(std::string_view what, bool interruptible = true) {
    std::unique_lock lock(mu_);
    if (interruptible && broken_)
      throw Error(fmt::format("thread comm: {}: another rank failed", what));
    const uint64_t gen = generation_;
    if (++arrived_ == world_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return;
    }
    cv_.wait(lock, [&] { return generation_ != gen || (interruptible && broken_); });
    if (generation_ == gen) throw Error(fmt::format("thread comm: {}: another rank failed", what));
  }
  void break_group() {
    std::lock_guard lock(mu_);
    broken_ = true;
    cv_.notify_all();
  }

 private:
  const int world_;
  std::vector<Slot> slots_;  // written before a meet(), read after it
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;          // GUARDED_BY(mu_)
  uint64_t generation_ = 0;  // GUARDED_BY(mu_)
  bool broken_ = false;      // GUARDED_BY(mu_)
};

class ThreadComm final : public Comm {
 public:
  ThreadComm(std::shared_ptr<ThreadGroup> group, int rank,
             std::function<void(std::string_view)> before = {})
      : g_(std::move(group)), rank_(rank), before_(std::move(before)) {}
  ~ThreadComm() override = default;

  int rank() const override { return rank_; }
  int world_size() const override { return g_->world(); }

  void all_gather(std::span<const float> send, std::span<float> recv) override {
    gather("all_gather", send.data(), send.size_bytes(), recv.data(), recv.size_bytes());
  }
  void all_gather_bytes(std::span<const std::byte> send, std::span<std::byte> recv) override {
    gather("all_gather_bytes", send.data(), send.size_bytes(), recv.data(), recv.size_bytes());
  }
  void reduce_scatter(std::span<const float> send, std::span<float> recv, ReduceOp op) override {
    detail::check_scatter("reduce_scatter", send.data(), send.size_bytes(), recv.data(),
                          recv.size_bytes(), rank_, world_size());
    count(Kind::kReduceScatter, others() * recv.size_bytes());
    std::vector<float> out(recv.size());
    exchange("reduce_scatter", send.data(), recv.size_bytes(), [&] {
      for (size_t i = 0; i < out.size(); ++i) out[i] = reduce(op, i + recv.size() * rank_, 0.0f);
    });
    copy_bytes(recv.data(), out.data(), recv.size_bytes());
  }
  void all_reduce(std::span<float> data, ReduceOp op) override { reduce_all(data, op); }
  void all_reduce(std::span<double> data, ReduceOp op) override { reduce_all(data, op); }
  void broadcast(std::span<float> data, int root) override {
    cast("broadcast", data.data(), data.size_bytes(), root);
  }
  void broadcast_bytes(std::span<std::byte> data, int root) override {
    cast("broadcast_bytes", data.data(), data.size_bytes(), root);
  }
  void all_to_all(std::span<float> data) override {
    detail::check_blocks("all_to_all", data.size(), world_size());
    const size_t block = data.size() / static_cast<size_t>(world_size());
    count(Kind::kAllToAll, others() * block * sizeof(float));
    std::vector<float> out(data.size());
    exchange("all_to_all", data.data(), data.size_bytes(), [&] {
      for (int r = 0; r < world_size(); ++r)
        copy_bytes(out.data() + r * block,
                   static_cast<const float*>(g_->slot(r).ptr) + rank_ * block,
                   block * sizeof(float));
    });
    copy_bytes(data.data(), out.data(), data.size_bytes());
  }
  void barrier() override {
    if (before_) before_("barrier");
    count(Kind::kBarrier, 0);
    g_->meet("barrier");
  }
  // Breaks the group (the other ranks' collectives throw) and returns: the caller ends its
  // thread the normal way.
  void abort(int) override { g_->break_group(); }
  std::string_view name() const override { return "thread"; }

 private:
  uint64_t others() const { return static_cast<uint64_t>(world_size() - 1); }

  // Deposits `mine` (`bytes`: the size every rank must pass alike), meets the others, checks
  // that they called the same, runs `read` (which reads their deposits), and meets them again:
  // after that no rank reads `mine`.
  template <typename Read>
  void exchange(std::string_view what, const void* mine, size_t bytes, Read&& read, int root = 0) {
    if (before_) before_(what);
    g_->deposit(rank_, {mine, what, bytes, root});
    g_->meet(what);
    for (int r = 0; r < world_size(); ++r) {
      const ThreadGroup::Slot& o = g_->slot(r);
      if (o.what != what || o.bytes != bytes || o.root != root)
        throw InvalidArgument(fmt::format(
            "thread comm: rank {} called {} of {} bytes (root {}), rank {} {} of {} (root {})",
            rank_, what, bytes, root, r, o.what, o.bytes, o.root));
    }
    read();
    g_->meet(what, /*interruptible=*/false);
  }

  void gather(std::string_view what, const void* send, size_t send_bytes, void* recv,
              size_t recv_bytes) {
    detail::check_gather(what, send, send_bytes, recv, recv_bytes, rank_, world_size());
    count(Kind::kAllGather, others() * send_bytes);
    exchange(what, send, send_bytes, [&] {
      for (int r = 0; r < world_size(); ++r) {
        std::byte* dst = static_cast<std::byte*>(recv) + static_cast<size_t>(r) * send_bytes;
        if (dst != g_->slot(r).ptr && send_bytes != 0) copy_bytes(dst, g_->slot(r).ptr, send_bytes);
      }
    });
  }

  template <typename T>
  T reduce(ReduceOp op, size_t i, T) const {
    T acc = static_cast<const T*>(g_->slot(0).ptr)[i];
    for (int r = 1; r < world_size(); ++r) {
      const T v = static_cast<const T*>(g_->slot(r).ptr)[i];
      acc = op == ReduceOp::kSum ? acc + v : (v > acc ? v : acc);
    }
    return acc;
  }

  template <typename T>
  void reduce_all(std::span<T> data, ReduceOp op) {
    count(Kind::kAllReduce, 2 * others() * data.size_bytes() / world_size());
    std::vector<T> out(data.size());
    exchange("all_reduce", data.data(), data.size_bytes(), [&] {
      for (size_t i = 0; i < out.size(); ++i) out[i] = reduce(op, i, T{});
    });
    copy_bytes(data.data(), out.data(), data.size_bytes());
  }

  void cast(std::string_view what, void* data, size_t bytes, int root) {
    detail::check_root(what, root, world_size());
    // MpiComm's count: the buffer from the root, (world-1)/world of it from the others.
    count(Kind::kBroadcast,
          rank_ == root ? bytes : bytes * others() / static_cast<uint64_t>(world_size()));
    exchange(
        what, data, bytes,
        [&] {
          if (rank_ != root && bytes != 0) copy_bytes(data, g_->slot(root).ptr, bytes);
        },
        root);
  }

  std::shared_ptr<ThreadGroup> g_;
  const int rank_;
  const std::function<void(std::string_view)> before_;
};

}  // namespace outcore::comm::testing
