#include "engine/comm/comm.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "common/error.hpp"

namespace outcore::comm {

std::string_view reduce_op_name(ReduceOp op) { return op == ReduceOp::kSum ? "sum" : "max"; }

CommTraffic Comm::traffic() const {
  CommTraffic t;
  t.all_gather = sent_[0].load(std::memory_order_relaxed);
  t.reduce_scatter = sent_[1].load(std::memory_order_relaxed);
  t.all_to_all = sent_[2].load(std::memory_order_relaxed);
  t.all_reduce = sent_[3].load(std::memory_order_relaxed);
  t.broadcast = sent_[4].load(std::memory_order_relaxed);
  t.calls = calls_.load(std::memory_order_relaxed);
  t.seconds = static_cast<double>(ns_.load(std::memory_order_relaxed)) * 1e-9;
  return t;
}

namespace {
int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}
}  // namespace

Comm::Timed::Timed(Comm& c) : c_(c), start_ns_(now_ns()) {}
Comm::Timed::~Timed() { c_.ns_.fetch_add(now_ns() - start_ns_, std::memory_order_relaxed); }

void Comm::count(Kind kind, uint64_t bytes) {
  calls_.fetch_add(1, std::memory_order_relaxed);
  if (kind == Kind::kBarrier) return;
  sent_[static_cast<int>(kind)].fetch_add(bytes, std::memory_order_relaxed);
}

std::vector<std::string> all_gather_strings(Comm& comm, const std::string& mine) {
  const size_t w = static_cast<size_t>(comm.world_size());
  uint64_t len = mine.size();
  std::vector<uint64_t> lens(w);
  comm.all_gather_bytes(std::as_bytes(std::span<const uint64_t>(&len, 1)),
                        std::as_writable_bytes(std::span<uint64_t>(lens)));
  const size_t longest = *std::max_element(lens.begin(), lens.end());
  std::string padded = mine;
  padded.resize(longest);
  std::vector<std::byte> all(w * longest);
  comm.all_gather_bytes(std::as_bytes(std::span<const char>(padded.data(), longest)), all);
  std::vector<std::string> out;
  for (size_t r = 0; r < w; ++r)
    out.emplace_back(reinterpret_cast<const char*>(all.data()) + r * longest, lens[r]);
  return out;
}

namespace detail {

bool overlaps(const void* a, size_t an, const void* b, size_t bn) {
  if (an == 0 || bn == 0) return false;
  auto pa = reinterpret_cast<uintptr_t>(a);
  auto pb = reinterpret_cast<uintptr_t>(b);
  return pa < pb + bn && pb < pa + an;
}

void check_gather(std::string_view what, const void* send, size_t send_bytes, const void* recv,
                  size_t recv_bytes, int rank, int world) {
  if (recv_bytes != send_bytes * static_cast<size_t>(world)) {
    throw InvalidArgument(
        fmt::format("{}: receive buffer is {} bytes but world size {} x shard {} bytes needs {}",
                    what, recv_bytes, world, send_bytes, send_bytes * static_cast<size_t>(world)));
  }
  const auto* own = static_cast<const std::byte*>(recv) + static_cast<size_t>(rank) * send_bytes;
  if (send == own) return;
  if (overlaps(send, send_bytes, recv, recv_bytes)) {
    throw InvalidArgument(fmt::format(
        "{}: send buffer overlaps the receive buffer but is not this rank's shard of it", what));
  }
}

void check_scatter(std::string_view what, const void* send, size_t send_bytes, const void* recv,
                   size_t recv_bytes, int rank, int world) {
  if (send_bytes != recv_bytes * static_cast<size_t>(world)) {
    throw InvalidArgument(
        fmt::format("{}: send buffer is {} bytes but world size {} x shard {} bytes needs {}", what,
                    send_bytes, world, recv_bytes, recv_bytes * static_cast<size_t>(world)));
  }
  const auto* own = static_cast<const std::byte*>(send) + static_cast<size_t>(rank) * recv_bytes;
  if (recv == own) return;
  if (overlaps(send, send_bytes, recv, recv_bytes)) {
    throw InvalidArgument(fmt::format(
        "{}: receive buffer overlaps the send buffer but is not this rank's shard of it", what));
  }
}

void check_root(std::string_view what, int root, int world) {
  if (root < 0 || root >= world) {
    throw InvalidArgument(
        fmt::format("{}: root rank {} is outside the world of {} ranks", what, root, world));
  }
}

void check_blocks(std::string_view what, size_t n, int world) {
  if (n % static_cast<size_t>(world) != 0) {
    throw InvalidArgument(fmt::format(
        "{}: buffer of {} elements does not split into {} equal blocks", what, n, world));
  }
}

}  // namespace detail
}  // namespace outcore::comm
