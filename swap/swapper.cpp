// Swapper: async swap_out / swap_in of named tensors through aio::Engine, with an in-memory
// table of CRC32C per block that is filled when a write completes and checked on every read.
#include <fmt/format.h>

#include <atomic>
#include <chrono>
#include <map>
#include <mutex>
#include <tuple>
#include <unordered_map>

#include "common/log.hpp"
#include "swap/checksum.hpp"
#include "swap/swap.hpp"

namespace outcore::swap {
namespace {

using Key = std::tuple<uint32_t, uint8_t, uint32_t>;
Key key_of(TensorId id) { return {id.unit, static_cast<uint8_t>(id.kind), id.index}; }

struct TensorState {
  std::vector<uint32_t> crcs;  // of the data on disk, valid when has_data
  bool has_data = false;
  bool writing = false;
  int readers = 0;
};

struct Pending {
  aio::Ticket io;
  TensorId id;
  bool read = false;
  const std::byte* data = nullptr;
  uint64_t bytes = 0;
  std::vector<uint32_t> crcs;  // a write's new CRCs
};

std::string describe(const SwapSpace& space, TensorId id) {
  return fmt::format("tensor '{}' of {}", space.info(id).name,
                     space.file_path(id.unit, id.kind).string());
}

}  // namespace

struct Swapper::Impl {
  SwapSpace& space;
  aio::Engine& engine;
  SwapperOptions options;
  const cpu_adam::Executor* executor;

  mutable std::mutex mu;
  std::map<Key, TensorState> states;              // GUARDED_BY(mu); nodes are stable
  std::unordered_map<uint64_t, Pending> pending;  // GUARDED_BY(mu)
  uint64_t next_ticket = 1;                       // GUARDED_BY(mu)
  SwapperStats stats;                             // GUARDED_BY(mu), except checksum time
  std::atomic<uint64_t> checksum_ns{0};

  Impl(SwapSpace& s, aio::Engine& e, const SwapperOptions& o, const cpu_adam::Executor* ex)
      : space(s), engine(e), options(o), executor(ex) {}

  // Checks size and alignment; returns the tensor's layout.
  const TensorInfo& check_buffer(TensorId id, const void* data, size_t size, const char* op) {
    const TensorInfo& info = space.info(id);
    if (size != info.bytes) {
      throw InvalidArgument(
          fmt::format("swap: {} of {} with a buffer of {} bytes; the tensor has {}", op,
                      describe(space, id), size, info.bytes));
    }
    if (reinterpret_cast<uintptr_t>(data) % kIoAlignment != 0) {
      throw InvalidArgument(fmt::format("swap: {} of {}: buffer address {} is not 4096-aligned", op,
                                        describe(space, id), data));
    }
    return info;
  }

  std::vector<uint32_t> crcs_of(const std::byte* data, uint64_t bytes) {
    std::vector<uint32_t> out(internal::block_count(bytes, options.checksum_block_bytes));
    auto t0 = std::chrono::steady_clock::now();
    internal::block_crcs({data, bytes}, options.checksum_block_bytes, out, executor);
    checksum_ns +=
        std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0)
            .count();
    return out;
  }

  SwapTicket add_pending(Pending p) {
    std::lock_guard lock(mu);
    uint64_t t = next_ticket++;
    pending.emplace(t, std::move(p));
    return SwapTicket(t);
  }

  // Verifies a completed read against the recorded CRCs; throws CorruptData.
  void verify(const Pending& p, const TensorState& st) {
    std::vector<uint32_t> got = crcs_of(p.data, p.bytes);
    for (size_t i = 0; i < got.size(); ++i) {
      if (got[i] == st.crcs[i]) continue;
      const TensorInfo& info = space.info(p.id);
      uint64_t begin = uint64_t(i) * options.checksum_block_bytes;
      uint64_t len = std::min<uint64_t>(options.checksum_block_bytes, p.bytes - begin);
      throw CorruptData(fmt::format(
          "swap: checksum mismatch in {} at offset {} length {} (block {} of tensor '{}'): "
          "crc32c written {:08x}, read {:08x}",
          space.file_path(p.id.unit, p.id.kind).string(), info.offset + begin, len, i, info.name,
          st.crcs[i], got[i]));
    }
  }
};

Swapper::Swapper(SwapSpace& space, aio::Engine& engine, const SwapperOptions& options,
                 const cpu_adam::Executor* executor) {
  if (options.checksum_block_bytes == 0 || options.checksum_block_bytes % kIoAlignment != 0 ||
      options.checksum_block_bytes > (size_t{1} << 30)) {
    throw InvalidArgument(
        fmt::format("swap: checksum_block_bytes {} must be a positive multiple of 4096 up to 1 GiB",
                    options.checksum_block_bytes));
  }
  impl_ = std::make_unique<Impl>(space, engine, options, executor);
}

Swapper::~Swapper() {
  std::unordered_map<uint64_t, Pending> left;
  {
    std::lock_guard lock(impl_->mu);
    left.swap(impl_->pending);
  }
  if (!left.empty()) log::warn("swap: {} swap operation(s) never waited", left.size());
  for (auto& [t, p] : left) {
    try {
      impl_->engine.wait(p.io);
    } catch (const std::exception& e) {
      log::warn("swap: an operation never waited failed: {}", e.what());
    }
  }
}

SwapTicket Swapper::swap_out(TensorId id, std::span<const std::byte> src) {
  Impl& m = *impl_;
  const TensorInfo& info = m.check_buffer(id, src.data(), src.size(), "swap_out");
  TensorState* st;
  {
    std::lock_guard lock(m.mu);
    st = &m.states[key_of(id)];
    if (st->writing || st->readers > 0) {
      throw InvalidArgument(
          fmt::format("swap: swap_out of {} while another operation on it is in flight",
                      describe(m.space, id)));
    }
    st->writing = true;
  }
  try {
    Pending p;
    p.id = id;
    p.data = src.data();
    p.bytes = info.bytes;
    if (m.options.verify_checksums) p.crcs = m.crcs_of(src.data(), info.bytes);
    p.io = m.engine.submit_write(m.space.file(id), info.offset, {src.data(), info.slot_bytes()});
    return m.add_pending(std::move(p));
  } catch (...) {
    std::lock_guard lock(m.mu);
    st->writing = false;
    throw;
  }
}

SwapTicket Swapper::swap_in(TensorId id, std::span<std::byte> dst) {
  Impl& m = *impl_;
  const TensorInfo& info = m.check_buffer(id, dst.data(), dst.size(), "swap_in");
  TensorState* st;
  {
    std::lock_guard lock(m.mu);
    st = &m.states[key_of(id)];
    if (st->writing) {
      throw InvalidArgument(fmt::format("swap: swap_in of {} while a swap_out of it is in flight",
                                        describe(m.space, id)));
    }
    if (!st->has_data) {
      throw InvalidArgument(fmt::format(
          "swap: swap_in of {}, which holds no data (never written, or its last write failed)",
          describe(m.space, id)));
    }
    ++st->readers;
  }
  try {
    Pending p;
    p.id = id;
    p.read = true;
    p.data = dst.data();
    p.bytes = info.bytes;
    p.io = m.engine.submit_read(m.space.file(id), info.offset, {dst.data(), info.slot_bytes()});
    return m.add_pending(std::move(p));
  } catch (...) {
    std::lock_guard lock(m.mu);
    --st->readers;
    throw;
  }
}

void Swapper::wait(SwapTicket t) {
  Impl& m = *impl_;
  Pending p;
  TensorState* st;
  {
    std::lock_guard lock(m.mu);
    auto it = m.pending.find(t.id());
    if (it == m.pending.end()) {
      throw InvalidArgument(
          fmt::format("swap: wait on an invalid or already-waited ticket {}", t.id()));
    }
    p = std::move(it->second);
    m.pending.erase(it);
    st = &m.states[key_of(p.id)];
  }
  try {
    m.engine.wait(p.io);
    // No write of this tensor can start while we are a reader, so st->crcs is stable here.
    if (p.read && m.options.verify_checksums) m.verify(p, *st);
  } catch (...) {
    std::lock_guard lock(m.mu);
    if (p.read) {
      --st->readers;
    } else {
      st->writing = false;
      st->has_data = false;
      st->crcs.clear();
    }
    throw;
  }
  std::lock_guard lock(m.mu);
  if (p.read) {
    --st->readers;
    m.stats.bytes_in += p.bytes;
    m.stats.drive_bytes_in += align_up(p.bytes, kIoAlignment);
    ++m.stats.swaps_in;
  } else {
    st->crcs = std::move(p.crcs);
    st->has_data = true;
    st->writing = false;
    m.stats.bytes_out += p.bytes;
    m.stats.drive_bytes_out += align_up(p.bytes, kIoAlignment);
    ++m.stats.swaps_out;
  }
}

bool Swapper::is_done(SwapTicket t) const {
  std::lock_guard lock(impl_->mu);
  auto it = impl_->pending.find(t.id());
  if (it == impl_->pending.end()) {
    throw InvalidArgument(
        fmt::format("swap: is_done on an invalid or already-waited ticket {}", t.id()));
  }
  return impl_->engine.is_done(it->second.io);
}

bool Swapper::has_data(TensorId id) const {
  impl_->space.info(id);  // validates
  std::lock_guard lock(impl_->mu);
  auto it = impl_->states.find(key_of(id));
  return it != impl_->states.end() && it->second.has_data;
}

const SwapSpace& Swapper::space() const { return impl_->space; }
const SwapperOptions& Swapper::options() const { return impl_->options; }

SwapperStats Swapper::stats() const {
  std::lock_guard lock(impl_->mu);
  SwapperStats s = impl_->stats;
  s.checksum_seconds = double(impl_->checksum_ns.load()) * 1e-9;
  return s;
}

}  // namespace outcore::swap
