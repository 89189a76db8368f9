// aio::Engine: tickets, submission (splitting spans across the I/O threads), waiting, buffer
// and file registration, stats. The I/O threads themselves are in worker.cpp.
#include <fmt/format.h>

#include <algorithm>
#include <atomic>
#include <optional>

#include "aio/engine_internal.hpp"
#include "common/log.hpp"

namespace outcore::aio {

using detail::Slice;
using detail::TicketSlot;
using detail::Worker;

void validate(const Options& o) {
  if (o.block_size == 0 || o.block_size % kIoAlignment != 0 || o.block_size > (1u << 30)) {
    throw InvalidArgument(
        fmt::format("aio.block_size: {} is not allowed (a multiple of 4096 between 4096 and 1 GiB)",
                    o.block_size));
  }
  if (o.queue_depth < 1 || o.queue_depth > 4096) {
    throw InvalidArgument(
        fmt::format("aio.queue_depth: {} is not allowed (1 to 4096)", o.queue_depth));
  }
  if (o.thread_count < 1 || o.thread_count > 256) {
    throw InvalidArgument(
        fmt::format("aio.thread_count: {} is not allowed (1 to 256)", o.thread_count));
  }
}

struct Engine::Impl final : detail::EngineCore {
  Options opt;
  std::shared_ptr<IoBackend> backend;

  mutable std::mutex mu;  // guards slots, free_slots, next_seq, tickets_done
  std::condition_variable done_cv;
  std::deque<TicketSlot> slots;
  std::vector<uint32_t> free_slots;
  uint64_t next_seq = 0;
  uint64_t tickets_done[2] = {0, 0};
  std::atomic<uint32_t> next_worker{0};

  // Registration state; changed only by the REQUIRES-exclusive register_* calls.
  std::array<uint64_t, detail::kFileSlots> file_serials{};
  bool buffers_registered = false;

  // Last, so the I/O threads stop before anything they use is destroyed.
  std::vector<std::unique_ptr<Worker>> workers;

  void slice_done(Slice* s) override {
    std::lock_guard lock(mu);
    TicketSlot* t = s->owner;
    if (--t->pending == 0) {
      ++tickets_done[t->write ? 1 : 0];
      done_cv.notify_all();
    }
  }

  uint32_t acquire() {  // REQUIRES: mu held; returns the slot index
    if (free_slots.empty()) {
      slots.emplace_back();
      slots.back().slices.resize(opt.thread_count);
      for (Slice& s : slots.back().slices) s.owner = &slots.back();
      free_slots.push_back(static_cast<uint32_t>(slots.size() - 1));
    }
    uint32_t index = free_slots.back();
    free_slots.pop_back();
    TicketSlot& t = slots[index];
    t.in_use = true;
    t.waiting = false;
    t.seq = ++next_seq;
    return index;
  }

  static uint64_t ticket_id(uint32_t index, const TicketSlot& t) {
    return (uint64_t{t.generation} << 32) | (uint64_t{index} + 1);
  }

  TicketSlot* lookup(Ticket tk, uint32_t* index_out = nullptr) {  // REQUIRES: mu held
    uint64_t id = tk.id();
    uint64_t index = (id & 0xffffffffu) - 1;
    if (id == 0 || index >= slots.size()) return nullptr;
    TicketSlot& t = slots[index];
    if (!t.in_use || t.generation != (id >> 32)) return nullptr;
    if (index_out) *index_out = static_cast<uint32_t>(index);
    return &t;
  }

  void release(TicketSlot& t, uint32_t index) {  // REQUIRES: mu held
    for (uint32_t i = 0; i < t.nslices; ++i) {
      t.slices[i].path.reset();
      t.slices[i].err = 0;
    }
    t.in_use = false;
    t.waiting = false;
    ++t.generation;
    if (t.generation == 0) t.generation = 1;
    free_slots.push_back(index);
  }

  // The ticket's failure, if any: the failed slice with the lowest offset.
  static std::optional<IoError> failure(const TicketSlot& t, const std::string& note = "") {
    const Slice* bad = nullptr;
    for (uint32_t i = 0; i < t.nslices; ++i) {
      const Slice& s = t.slices[i];
      if (s.err != 0 && (bad == nullptr || s.err_offset < bad->err_offset)) bad = &s;
    }
    if (bad == nullptr) return std::nullopt;
    std::string op = bad->write ? "write" : (bad->eof ? "read (end of file)" : "read");
    return IoError(bad->path ? *bad->path : "?", bad->err_offset, bad->err_length, bad->err,
                   "aio " + op + note);
  }

  Ticket submit(const File& f, uint64_t offset, std::byte* buf, size_t len, bool write) {
    const char* what = write ? "write" : "read";
    if (!f.is_open()) throw InvalidArgument(fmt::format("aio {}: the file is not open", what));
    auto addr = reinterpret_cast<uintptr_t>(buf);
    if (f.direct() && (offset % kIoAlignment || len % kIoAlignment || addr % kIoAlignment)) {
      throw InvalidArgument(fmt::format(
          "aio {} on {} at offset {} length {} buffer {:#x}: the file is opened with O_DIRECT, "
          "so buffer address, offset and length must all be multiples of {}",
          what, f.path(), offset, len, addr, kIoAlignment));
    }
    if (offset + len < offset) {
      throw InvalidArgument(fmt::format("aio {} on {}: offset {} + length {} overflows", what,
                                        f.path(), offset, len));
    }
    uint64_t bs = opt.block_size;
    uint64_t nblocks = (len + bs - 1) / bs;
    uint32_t nslices = static_cast<uint32_t>(std::min<uint64_t>(opt.thread_count, nblocks));

    TicketSlot* t;
    uint64_t id;
    {
      std::lock_guard lock(mu);
      uint32_t index = acquire();
      t = &slots[index];
      t->write = write;
      t->nslices = nslices;
      t->pending = nslices;
      id = ticket_id(index, *t);
      if (nslices == 0) ++tickets_done[write ? 1 : 0];
    }
    uint64_t pos = 0;
    uint64_t base = nslices ? nblocks / nslices : 0;
    uint64_t extra = nslices ? nblocks % nslices : 0;
    for (uint32_t i = 0; i < nslices; ++i) {
      Slice& s = t->slices[i];
      uint64_t bytes = std::min<uint64_t>((base + (i < extra ? 1 : 0)) * bs, len - pos);
      s.fd = f.fd();
      s.file_serial = f.serial();
      s.path = f.shared_path();
      s.write = write;
      s.buf = buf + pos;
      s.offset = offset + pos;
      s.length = bytes;
      s.issued = 0;
      s.inflight = 0;
      s.err = 0;
      s.eof = false;
      pos += bytes;
    }
    uint32_t first = next_worker.fetch_add(1, std::memory_order_relaxed);
    for (uint32_t i = 0; i < nslices; ++i) {
      workers[(first + i) % workers.size()]->enqueue(&t->slices[i]);
    }
    return Ticket(id);
  }

  bool all_done_except_waited() const {  // REQUIRES: mu held
    for (const TicketSlot& t : slots) {
      if (t.in_use && !t.waiting && t.pending > 0) return false;
    }
    return true;
  }

  // Runs `fn` on every I/O thread; returns the first non-zero result (or 0).
  int on_all_workers(const std::function<int(IoQueue&)>& fn) {
    int first = 0;
    for (auto& w : workers) {
      int rc = w->run_control(fn);
      if (rc != 0 && first == 0) first = rc;
    }
    return first;
  }
};

Engine::Engine(const Options& options, std::shared_ptr<IoBackend> backend)
    : impl_(std::make_unique<Impl>()) {
  validate(options);
  impl_->opt = options;
  impl_->backend = backend ? std::move(backend) : make_default_backend();
  static std::atomic<unsigned> engines{0};  // names this engine's tracks in a trace
  const unsigned serial = engines++;
  for (unsigned i = 0; i < options.thread_count; ++i) {
    impl_->workers.push_back(std::make_unique<Worker>(*impl_, options, *impl_->backend));
    impl_->workers.back()->trace_lanes = fmt::format("aio{} io{}", serial, i);
    impl_->workers.back()->start();  // a failure here destroys the started ones
  }
}

Engine::~Engine() {
  size_t failed = 0;
  std::optional<IoError> first;
  {
    std::unique_lock lock(impl_->mu);
    impl_->done_cv.wait(lock, [&] {
      for (const TicketSlot& t : impl_->slots) {
        if (t.in_use && t.pending > 0) return false;
      }
      return true;
    });
    for (const TicketSlot& t : impl_->slots) {
      if (!t.in_use) continue;
      if (auto e = Impl::failure(t)) {
        if (!first) first = e;
        ++failed;
      }
    }
  }
  if (failed > 0) {
    log::warn("aio: {} failed request(s) were never waited for; the first: {}", failed,
              first->what());
  }
  impl_->workers.clear();  // stops and joins the I/O threads
}

Ticket Engine::submit_read(const File& file, uint64_t offset, std::span<std::byte> dst) {
  return impl_->submit(file, offset, dst.data(), dst.size(), false);
}

Ticket Engine::submit_write(const File& file, uint64_t offset, std::span<const std::byte> src) {
  // The engine only reads from `src` for a write; the cast feeds the shared request type.
  return impl_->submit(file, offset, const_cast<std::byte*>(src.data()), src.size(), true);
}

void Engine::wait(Ticket t) {
  std::unique_lock lock(impl_->mu);
  uint32_t index = 0;
  TicketSlot* slot = impl_->lookup(t, &index);
  if (slot == nullptr) {
    throw InvalidArgument(
        fmt::format("aio wait: ticket {:#x} is invalid or already waited", t.id()));
  }
  if (slot->waiting) {
    throw InvalidArgument(
        fmt::format("aio wait: ticket {:#x} is already being waited by another thread", t.id()));
  }
  slot->waiting = true;
  impl_->done_cv.wait(lock, [&] { return slot->pending == 0; });
  std::optional<IoError> err = Impl::failure(*slot);
  impl_->release(*slot, index);
  lock.unlock();
  if (err) throw *err;
}

bool Engine::is_done(Ticket t) const {
  std::lock_guard lock(impl_->mu);
  TicketSlot* slot = impl_->lookup(t);
  if (slot == nullptr) {
    throw InvalidArgument(
        fmt::format("aio is_done: ticket {:#x} is invalid or already waited", t.id()));
  }
  return slot->pending == 0;
}

void Engine::wait_all() {
  std::unique_lock lock(impl_->mu);
  impl_->done_cv.wait(lock, [&] { return impl_->all_done_except_waited(); });
  const TicketSlot* first = nullptr;
  size_t failed = 0;
  for (const TicketSlot& t : impl_->slots) {
    if (!t.in_use || t.waiting || !Impl::failure(t)) continue;
    ++failed;
    if (first == nullptr || t.seq < first->seq) first = &t;
  }
  std::optional<IoError> err;
  if (first != nullptr) {
    err = Impl::failure(
        *first, failed > 1 ? fmt::format(" (and {} more failed)", failed - 1) : std::string());
  }
  for (uint32_t i = 0; i < impl_->slots.size(); ++i) {
    TicketSlot& t = impl_->slots[i];
    if (t.in_use && !t.waiting) impl_->release(t, i);
  }
  lock.unlock();
  if (err) throw *err;
}

void Engine::read(const File& file, uint64_t offset, std::span<std::byte> dst) {
  wait(submit_read(file, offset, dst));
}

void Engine::write(const File& file, uint64_t offset, std::span<const std::byte> src) {
  wait(submit_write(file, offset, src));
}

bool Engine::register_buffers(std::span<const std::span<std::byte>> bufs) {
  unregister_buffers();
  if (!impl_->opt.use_registered || bufs.empty()) return false;
  std::vector<Worker::BufferRange> ranges;
  for (size_t i = 0; i < bufs.size(); ++i) {
    auto b = reinterpret_cast<uintptr_t>(bufs[i].data());
    ranges.push_back({b, b + bufs[i].size(), static_cast<int>(i)});
  }
  std::sort(ranges.begin(), ranges.end(),
            [](const auto& a, const auto& b) { return a.begin < b.begin; });
  int rc = impl_->on_all_workers([&](IoQueue& q) { return q.register_buffers(bufs); });
  if (rc != 0) {
    impl_->on_all_workers([](IoQueue& q) { return q.unregister_buffers(); });
    if (rc != -EOPNOTSUPP) {
      log::warn(
          "aio: registering {} buffer(s) with the kernel failed ({}); using unregistered "
          "I/O (raise the memlock limit, ulimit -l, to allow it)",
          bufs.size(), errno_string(-rc));
    }
    return false;
  }
  for (auto& w : impl_->workers) w->buffers = ranges;  // threads idle: nothing in flight
  impl_->buffers_registered = true;
  return true;
}

void Engine::unregister_buffers() {
  if (!impl_->buffers_registered) return;
  impl_->on_all_workers([](IoQueue& q) { return q.unregister_buffers(); });
  for (auto& w : impl_->workers) w->buffers.clear();
  impl_->buffers_registered = false;
}

bool Engine::register_file(const File& file) {
  if (!impl_->opt.use_registered || !file.is_open()) return false;
  auto& serials = impl_->file_serials;
  if (std::find(serials.begin(), serials.end(), file.serial()) != serials.end()) return true;
  auto free_slot = std::find(serials.begin(), serials.end(), 0);
  if (free_slot == serials.end()) return false;
  int slot = static_cast<int>(free_slot - serials.begin());
  int fd = file.fd();
  uint64_t serial = file.serial();
  int rc = impl_->on_all_workers([&](IoQueue& q) { return q.register_file(slot, fd); });
  if (rc != 0) {
    impl_->on_all_workers([&](IoQueue& q) { return q.register_file(slot, -1); });
    return false;
  }
  serials[slot] = serial;
  for (auto& w : impl_->workers) w->file_serials[slot] = serial;
  return true;
}

void Engine::unregister_file(const File& file) {
  auto& serials = impl_->file_serials;
  auto it = std::find(serials.begin(), serials.end(), file.serial());
  if (file.serial() == 0 || it == serials.end()) return;
  int slot = static_cast<int>(it - serials.begin());
  impl_->on_all_workers([&](IoQueue& q) { return q.register_file(slot, -1); });
  *it = 0;
  for (auto& w : impl_->workers) w->file_serials[slot] = 0;
}

Stats Engine::stats() const {
  detail::DirectionCounters c;
  for (auto& w : impl_->workers) w->collect_stats(c, false);
  Stats s;
  s.read = c.read;
  s.write = c.write;
  {
    std::lock_guard lock(impl_->mu);
    s.read.tickets = impl_->tickets_done[0];
    s.write.tickets = impl_->tickets_done[1];
  }
  s.registered_buffers = impl_->buffers_registered;
  s.backend = impl_->backend->name();
  return s;
}

void Engine::reset_stats() {
  detail::DirectionCounters c;
  for (auto& w : impl_->workers) w->collect_stats(c, true);
  std::lock_guard lock(impl_->mu);
  impl_->tickets_done[0] = impl_->tickets_done[1] = 0;
}

const Options& Engine::options() const { return impl_->opt; }

std::string Engine::backend_name() const { return impl_->backend->name(); }

}  // namespace outcore::aio
