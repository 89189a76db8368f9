// outcore._outcore.AioHandle and PinnedMemory: aio::Engine requests on caller memory given as
// an address and a length (the Python layer, outcore/aio.py, takes them from a tensor).
#include <fmt/format.h>
#include <pthread.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <condition_variable>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <system_error>
#include <tuple>
#include <vector>

#include "aio/aio.hpp"
#include "common/error.hpp"
#include "common/log.hpp"
#include "common/open_file.hpp"
#include "python/bindings/bindings.hpp"
#include "swap/swap.hpp"

namespace outcore::python {
namespace py = pybind11;

namespace {

// When a request opens its file with O_DIRECT.
enum class DirectMode { kAuto, kAlways, kNever };

DirectMode parse_direct(const std::string& s) {
  if (s == "auto") return DirectMode::kAuto;
  if (s == "always") return DirectMode::kAlways;
  if (s == "never") return DirectMode::kNever;
  throw InvalidArgument("o_direct: got \"" + s + "\"; allowed: \"auto\", \"always\", \"never\"");
}

aio::Fault::Kind parse_fault_kind(const std::string& s) {
  if (s == "eio") return aio::Fault::Kind::kEio;
  if (s == "enospc") return aio::Fault::Kind::kEnospc;
  if (s == "short") return aio::Fault::Kind::kShort;
  if (s == "delay") return aio::Fault::Kind::kDelay;
  if (s == "zero") return aio::Fault::Kind::kZero;
  throw InvalidArgument("fault kind: got \"" + s + "\"; allowed: eio, enospc, short, delay, zero");
}

// (kind, nth, every, direction) as FaultInjectingBackend takes them; for tests only.
using FaultSpec = std::tuple<std::string, uint64_t, uint64_t, int>;

std::shared_ptr<aio::IoBackend> make_backend(const std::vector<FaultSpec>& faults) {
  if (faults.empty()) return nullptr;  // the engine's default backend
  auto b = std::make_shared<aio::FaultInjectingBackend>(aio::make_default_backend());
  for (const auto& [kind, nth, every, direction] : faults) {
    aio::Fault f;
    f.kind = parse_fault_kind(kind);
    f.nth = nth;
    f.every = every;
    f.direction = direction;
    b->add_fault(f);
  }
  return b;
}

// An open file and whether the open created it.
struct Opened {
  aio::File file;
  bool created = false;
};

// Opens `path` as `oo` says (its create and exclusive are ignored). A write creates the file
// (mode 0666 less the umask, as Python's open() does) when it is missing, first with O_EXCL, so
// that `created` says whether this open made it even where another process creates it at the same
// moment. A write's whole open runs with `registry` locked and is passed to `record` (the open
// file, whether it created it) before the lock goes: a failed write of another thread, which
// removes the file it created under the same lock, either sees this open recorded (the file is
// shared, and kept) or removed the file before this open, which then creates it anew (see
// CreatedFiles). The opens are quick (a regular file; a FIFO or directory is refused without
// waiting). An open failure is reported with the offset and length of the request.
Opened open_file(const std::string& path, aio::OpenOptions oo, uint64_t offset, uint64_t bytes,
                 std::mutex& registry, const std::function<void(const Opened&)>& record) {
  const bool write = oo.access == aio::Access::kWrite;
  oo.create = oo.exclusive = false;
  try {
    if (!write) return {aio::File::open(path, oo), false};
    const std::lock_guard lock(registry);
    Opened o;
    try {
      o = {aio::File::open(path, oo), false};
    } catch (const IoError& e) {
      if (e.error_number() != ENOENT) throw;
      oo.create = oo.exclusive = true;
      oo.mode = 0666;
      try {
        o = {aio::File::open(path, oo), true};
      } catch (const IoError& e2) {
        if (e2.error_number() != EEXIST) throw;
        // A dangling symbolic link (O_EXCL does not follow it): opened as before, with
        // O_CREAT, and not counted as created by this open.
        oo.exclusive = false;
        o = {aio::File::open(path, oo), false};
      }
    }
    record(o);
    return o;
  } catch (const IoError& e) {
    throw IoError(path, offset, bytes, e.error_number(),
                  write ? "open for writing" : "open for reading");
  }
}

// Device and inode of an open file (common/open_file's FileId): what a path must still name for
// the file to be removed.
std::optional<FileId> file_id(const aio::File& file) {
  FileId id;
  if (!file_id_of(file.fd(), id)) return std::nullopt;
  return id;
}

// Removes `path` if it still names file `id`: the file a write created before it failed. A
// failure to remove it is logged.
void remove_created(const std::string& path, const FileId& id) {
  FileId now;
  if (!file_id_of(path, now) || now != id) return;
  if (::unlink(path.c_str()) != 0) {
    log::warn("outcore.aio: {}: the file a failed write created could not be removed: {}", path,
              errno_string(errno));
  }
}

// The writes not yet waited (or being waited) whose open created their file, of every handle in
// the process, by (handle serial, request id). A write of any handle that opens such a file later
// marks it shared: a failed write then keeps the file another one wrote. Guarded by its mutex (a
// handle's destructor uses it without the GIL).
struct CreatedFile {
  std::string path;
  FileId file;
  bool shared = false;
};
struct CreatedFiles {
  std::mutex mutex;
  std::map<std::pair<uint64_t, uint64_t>, CreatedFile> writes;
  std::atomic<uint64_t> next_handle{1};  // serials: a handle's address may be a later one's
};
// The registry, made at first use. A fork waits until no thread holds its mutex, and the
// child starts with it free: a thread of the parent holding it across a write's open would
// otherwise leave it locked forever in the child, whose first write would then hang.
CreatedFiles& created_files() {
  static CreatedFiles* files = [] {
    auto* f = new CreatedFiles;  // never destroyed: used by handles at exit
    const auto lock = [] { created_files().mutex.lock(); };
    const auto unlock = [] { created_files().mutex.unlock(); };
    if (const int rc = ::pthread_atfork(lock, unlock, unlock); rc != 0)
      throw std::system_error(rc, std::generic_category(), "outcore.aio: pthread_atfork");
    return f;
  }();
  return *files;
}

// The registry's lock. Taken by threads that do not hold the GIL (a thread may hold it across a
// write's open, open_file), and by a fork (the handlers above), whose thread may hold the GIL: a
// holder never waits for the GIL, so the two never deadlock; a fork waits for the open.
std::unique_lock<std::mutex> lock_registry() { return std::unique_lock(created_files().mutex); }

// For a read waited at once: throws the end-of-file IoError its wait would raise, before
// anything is read, when `file` is a regular file that ends before offset + bytes (the engine
// would store the bytes before the end of the file first).
void refuse_read_past_end(const aio::File& file, uint64_t offset, uint64_t bytes) {
  struct stat st;
  if (bytes == 0 || ::fstat(file.fd(), &st) != 0 || !S_ISREG(st.st_mode)) return;
  const auto size = static_cast<uint64_t>(st.st_size);
  if (offset <= size && bytes <= size - offset) return;
  const uint64_t end = std::max(offset, size);  // where the engine finds the end of the file
  throw IoError(file.path(), end, bytes - (end - offset), EIO, "aio read (end of file)");
}

// One Engine and the requests submitted to it that are not waited yet. Each pending request
// owns its open File and a reference to the Python object that owns the memory it reads or
// writes, so neither goes away before the request completes. Called with the GIL held; the GIL
// is released only while blocking on I/O.
class AioHandle {
 public:
  AioHandle(const aio::Options& options, const std::string& o_direct,
            const std::vector<FaultSpec>& faults)
      : direct_(parse_direct(o_direct)),
        engine_(std::make_unique<aio::Engine>(options, make_backend(faults))),
        pid_(::getpid()) {
    serial_ = created_files().next_handle.fetch_add(1);
  }

  // Waits for every request still in flight (errors logged, not raised; a file a failed write
  // created removed) before the memory they use is released; their on_complete callbacks are
  // not called. In a process forked from the one that made it, the engine is left as it is: its
  // I/O threads are not there, and destroying it would wait for them forever.
  ~AioHandle() {
    if (forked()) {
      (void)engine_.release();
      pending_.clear();
      return;
    }
    {
      py::gil_scoped_release nogil;
      for (auto& [id, p] : pending_) {
        try {
          if (!p.completed) engine_->wait(p.ticket);
        } catch (const std::exception& e) {
          log::warn("outcore.aio: request on {} at offset {} never waited and failed: {}",
                    p.file.path(), p.offset, e.what());
          remove_if_created(id);
        }
      }
      // Writes that succeeded but were never waited: their files are no longer this handle's.
      CreatedFiles& all = created_files();
      const auto lock = lock_registry();
      all.writes.erase(all.writes.lower_bound({serial_, 0}),
                       all.writes.lower_bound({serial_ + 1, 0}));
    }
    pending_.clear();
  }
  AioHandle(const AioHandle&) = delete;
  AioHandle& operator=(const AioHandle&) = delete;

  // Starts reading (write false) file `path` at `offset` into [address, address + bytes), or
  // writing it there; `keep` (the owner of that memory) is held until the request is waited.
  // `on_complete` (None, or a callable taking no arguments) is called with the GIL held by the
  // wait that sees the request succeed; what it raises is that wait's error. Returns the
  // request's id. Files are opened per request: for reading, O_RDONLY; for writing, created
  // (mode 0666 less the umask) if missing and never truncated; if the request fails, a file it
  // created is removed unless a request of any handle of this process opened it for writing since.
  // O_DIRECT as DirectMode says. `sync`: the caller waits at once; a read past the end of a regular
  // file then raises here, before it stores any byte. InvalidArgument for a path holding a null
  // byte.
  uint64_t submit(bool write, py::object keep, uintptr_t address, uint64_t bytes,
                  const std::string& path, uint64_t offset, py::object on_complete, bool sync) {
    refuse_if_forked();
    checked_path(path, "path");
    const bool aligned =
        address % kIoAlignment == 0 && offset % kIoAlignment == 0 && bytes % kIoAlignment == 0;
    if (direct_ == DirectMode::kAlways && !aligned) {
      throw InvalidArgument(fmt::format(
          "{}: offset {}: O_DIRECT needs the buffer address ({:#x}), the file offset and the "
          "length ({} bytes) to be multiples of {} (o_direct=\"always\")",
          path, offset, address, bytes, kIoAlignment));
    }
    aio::OpenOptions oo;
    oo.access = write ? aio::Access::kWrite : aio::Access::kRead;
    oo.direct = direct_ == DirectMode::kAlways || (direct_ == DirectMode::kAuto && aligned);
    Opened opened;
    const uint64_t id = next_id_++;
    {
      py::gil_scoped_release nogil;  // open may block (network filesystems, FIFOs)
      opened = open_file(path, oo, offset, bytes, created_files().mutex,
                         [&](const Opened& o) { track_write(id, path, o); });
      if (sync && !write) refuse_read_past_end(opened.file, offset, bytes);
    }
    Pending p{aio::Ticket{}, std::move(opened.file), std::move(keep), std::move(on_complete),
              offset};
    p.sync = sync;
    auto* data = reinterpret_cast<std::byte*>(address);
    try {
      p.ticket = write ? engine_->submit_write(p.file, offset, {data, bytes})
                       : engine_->submit_read(p.file, offset, {data, bytes});
    } catch (...) {
      {
        py::gil_scoped_release nogil;  // the registry is touched without the GIL
        remove_if_created(id);
      }
      throw;
    }
    pending_.emplace(id, std::move(p));
    return id;
  }

  // Blocks (GIL released) until request `id` completes, calls its on_complete, then releases
  // it and returns true; raises the request's error (or on_complete's). Returns false for an id
  // that is not pending (already waited): once the wait of another thread on it has ended (its
  // bytes stored), never while the I/O runs. When on_complete is interrupted (a
  // KeyboardInterrupt while it stores a read), the request stays pending, completed: the next
  // wait calls it again.
  bool wait(uint64_t id) {
    refuse_if_forked();
    auto it = pending_.find(id);
    while (it == pending_.end()) {
      if (!being_waited(id)) return false;
      wait_released(id);  // another thread's wait: its end (the request may be pending again)
      it = pending_.find(id);
    }
    Pending p = std::move(it->second);
    pending_.erase(it);
    {
      const std::lock_guard lock(waits_mu_);
      in_wait_.emplace(id, p.sync);
    }
    // Whatever happens below, other waiters of `id` are woken once this wait has ended.
    struct Release {
      AioHandle& h;
      uint64_t id;
      ~Release() {
        {
          const std::lock_guard lock(h.waits_mu_);
          h.in_wait_.erase(id);
        }
        h.waits_cv_.notify_all();
      }
    } release{*this, id};
    if (!p.completed) {
      std::exception_ptr failed;
      {
        py::gil_scoped_release nogil;  // the registry too is touched without the GIL
        try {
          engine_->wait(p.ticket);
          forget_created(id);
        } catch (...) {
          failed = std::current_exception();
          remove_if_created(id);
        }
      }
      if (failed) std::rethrow_exception(failed);
      p.completed = true;
    }
    if (!p.on_complete.is_none()) {
      try {
        p.on_complete();
      } catch (py::error_already_set& e) {
        // Interrupted (Ctrl-C) before it stored the bytes: pending still, for the next wait.
        // Any other error (a storage shrunk under the read) is final, as documented.
        if (e.matches(PyExc_KeyboardInterrupt)) pending_.emplace(id, std::move(p));
        throw;
      }
    }
    return true;  // p (file, keep, on_complete) is released with the GIL held
  }

  // Whether wait(id) would not block: false while another thread's wait on it runs.
  bool done(uint64_t id) const {
    refuse_if_forked();
    auto it = pending_.find(id);
    if (it == pending_.end()) return !being_waited(id);
    return it->second.completed || engine_->is_done(it->second.ticket);
  }

  // Waits for every pending request, oldest first. Returns how many completed; if any
  // failed, raises the error of the oldest failed one once all are done.
  size_t wait_all() {
    refuse_if_forked();
    size_t completed = 0;
    std::exception_ptr first;
    // Each request once, oldest first (one that failed is released). A Ctrl-C stops the wait
    // at once: the requests not waited yet stay pending.
    for (uint64_t next = 0;;) {
      auto it = pending_.lower_bound(next);
      // A synchronous request is its caller's, who waits for it at once (its error is theirs).
      while (it != pending_.end() && it->second.sync) ++it;
      if (it == pending_.end()) break;
      const uint64_t id = it->first;
      next = id + 1;
      try {
        completed += wait(id) ? 1 : 0;
      } catch (py::error_already_set& e) {
        if (e.matches(PyExc_KeyboardInterrupt)) throw;
        if (!first) first = std::current_exception();
      } catch (const std::exception&) {
        if (!first) first = std::current_exception();
      }
    }
    // And the asynchronous requests other threads are waiting for, until their waits end.
    {
      py::gil_scoped_release nogil;
      std::unique_lock lock(waits_mu_);
      waits_cv_.wait(lock, [&] {
        return std::none_of(in_wait_.begin(), in_wait_.end(),
                            [](const auto& w) { return !w.second; });
      });
    }
    if (first) std::rethrow_exception(first);
    return completed;
  }

  // Requests submitted and not yet released by a wait (those being waited included).
  size_t pending() const {
    const std::lock_guard lock(waits_mu_);
    return pending_.size() + in_wait_.size();
  }
  const aio::Options& options() const { return engine_->options(); }
  std::string backend() const { return engine_->backend_name(); }

 private:
  struct Pending {
    aio::Ticket ticket;
    aio::File file;
    py::object keep;
    py::object on_complete;  // None or a callable
    uint64_t offset = 0;
    bool completed = false;  // its I/O succeeded (waited); on_complete is still to run
    bool sync = false;       // its caller waits at once: never waited by wait_all
  };

  bool being_waited(uint64_t id) const {
    const std::lock_guard lock(waits_mu_);
    return in_wait_.count(id) != 0;
  }
  // Blocks (GIL released) until no wait on `id` runs.
  void wait_released(uint64_t id) {
    py::gil_scoped_release nogil;
    std::unique_lock lock(waits_mu_);
    waits_cv_.wait(lock, [&] { return in_wait_.count(id) == 0; });
  }

  bool forked() const { return ::getpid() != pid_; }
  // A forked child has the handle's memory but not its I/O threads: a request there would wait
  // forever.
  void refuse_if_forked() const {
    if (forked())
      throw Error(fmt::format(
          "outcore.aio: this handle was made in process {}, and process {} is a fork of it, "
          "without its I/O threads: make a new Handle in this process",
          pid_, ::getpid()));
  }

  // Records write `id`: the file it created, or, for a file it did not create, that the file
  // is no longer only that of the write (of any handle) that created it. Called with
  // created_files().mutex held (open_file).
  void track_write(uint64_t id, const std::string& path, const Opened& opened) {
    const std::optional<FileId> file = file_id(opened.file);
    if (!file) return;  // unknown identity: never removed
    CreatedFiles& all = created_files();
    if (opened.created) {
      all.writes.emplace(std::pair{serial_, id}, CreatedFile{path, *file});
      return;
    }
    for (auto& [key, c] : all.writes) {
      if (c.file == *file) c.shared = true;
    }
  }

  // After request `id` succeeded: the file it created is no longer one to remove.
  void forget_created(uint64_t id) {
    CreatedFiles& all = created_files();
    const auto lock = lock_registry();
    all.writes.erase({serial_, id});
  }

  // After request `id` failed: removes the file it created, if any and not shared.
  void remove_if_created(uint64_t id) {
    CreatedFiles& all = created_files();
    const auto lock = lock_registry();
    auto it = all.writes.find({serial_, id});
    if (it == all.writes.end()) return;
    if (!it->second.shared) remove_created(it->second.path, it->second.file);
    all.writes.erase(it);
  }

  DirectMode direct_;
  std::unique_ptr<aio::Engine> engine_;
  pid_t pid_;                            // the process that made it
  std::map<uint64_t, Pending> pending_;  // by id: submission order
  uint64_t next_id_ = 1;
  // Requests moved out of pending_ by a wait still running (GIL released), with their sync flag;
  // other waits on them block on waits_cv_ until it ends.
  mutable std::mutex waits_mu_;
  std::condition_variable waits_cv_;
  std::map<uint64_t, bool> in_wait_;  // GUARDED_BY(waits_mu_)
  uint64_t serial_ = 0;               // this handle's key in created_files()
};

// Bytes and buffers of PinnedMemory alive in this process (for leak checks).
std::atomic<uint64_t> g_pinned_bytes{0};
std::atomic<uint64_t> g_pinned_buffers{0};

// `bytes` of 4096-aligned host memory, page-locked where the kernel allows (swap::PinnedPool:
// otherwise one warning and pageable memory), exposed through the buffer protocol so that
// torch.frombuffer can view it; freed when the last view is gone.
class PinnedMemory {
 public:
  explicit PinnedMemory(size_t bytes)
      : pool_(swap::PinnedPoolOptions{.budget_bytes = bytes}), lease_(pool_.acquire(bytes)) {
    g_pinned_bytes += lease_.capacity();
    ++g_pinned_buffers;
  }
  ~PinnedMemory() {
    g_pinned_bytes -= lease_.capacity();
    --g_pinned_buffers;
  }
  PinnedMemory(const PinnedMemory&) = delete;
  PinnedMemory& operator=(const PinnedMemory&) = delete;

  std::byte* data() const { return lease_.data(); }
  size_t size() const { return lease_.size(); }
  bool locked() const { return pool_.locked(); }

 private:
  swap::PinnedPool pool_;
  swap::PinnedBuffer lease_;
};

}  // namespace

void bind_aio(py::module_& m) {
  py::class_<AioHandle>(m, "AioHandle")
      .def(py::init([](size_t block_size, unsigned queue_depth, unsigned threads,
                       bool single_submit, bool overlap_events, const std::string& o_direct,
                       const std::vector<FaultSpec>& faults) {
             aio::Options o;
             o.block_size = block_size;
             o.queue_depth = queue_depth;
             o.thread_count = threads;
             o.single_submit = single_submit;
             o.overlap_events = overlap_events;
             return std::make_unique<AioHandle>(o, o_direct, faults);
           }),
           py::arg("block_size"), py::arg("queue_depth"), py::arg("threads"),
           py::arg("single_submit"), py::arg("overlap_events"), py::arg("o_direct"),
           py::arg("faults"))
      .def("submit", &AioHandle::submit, py::arg("write"), py::arg("keep"), py::arg("address"),
           py::arg("bytes"), py::arg("path"), py::arg("offset"),
           py::arg("on_complete") = py::none(), py::arg("sync") = false)
      .def("wait", &AioHandle::wait, py::arg("id"))
      .def("done", &AioHandle::done, py::arg("id"))
      .def("wait_all", &AioHandle::wait_all)
      .def("pending", &AioHandle::pending)
      .def("backend", &AioHandle::backend)
      .def_property_readonly("block_size",
                             [](const AioHandle& h) { return h.options().block_size; })
      .def_property_readonly("queue_depth",
                             [](const AioHandle& h) { return h.options().queue_depth; })
      .def_property_readonly("threads", [](const AioHandle& h) { return h.options().thread_count; })
      .def_property_readonly("single_submit",
                             [](const AioHandle& h) { return h.options().single_submit; })
      .def_property_readonly("overlap_events",
                             [](const AioHandle& h) { return h.options().overlap_events; });

  py::class_<PinnedMemory>(m, "PinnedMemory", py::buffer_protocol())
      .def(py::init<size_t>(), py::arg("bytes"))
      .def_property_readonly(
          "address", [](const PinnedMemory& p) { return reinterpret_cast<uintptr_t>(p.data()); })
      .def_property_readonly("nbytes", &PinnedMemory::size)
      .def_property_readonly("locked", &PinnedMemory::locked)
      .def_buffer([](PinnedMemory& p) {
        return py::buffer_info(p.data(), 1, py::format_descriptor<uint8_t>::format(), 1,
                               {static_cast<py::ssize_t>(p.size())}, {py::ssize_t{1}});
      });
  m.def(
      "pinned_bytes", [] { return g_pinned_bytes.load(); },
      "Bytes of pinned memory (new_pinned_tensor) alive in this process.");
  m.def(
      "pinned_buffers", [] { return g_pinned_buffers.load(); },
      "Pinned buffers (new_pinned_tensor) alive in this process.");
  m.def("io_alignment", [] { return kIoAlignment; });
}

}  // namespace outcore::python
