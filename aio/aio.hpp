// aio: asynchronous file I/O for the swap tier, on io_uring with O_DIRECT.
//
// Where io_uring cannot be used (sysctl kernel.io_uring_disabled, a container's seccomp
// filter, an old kernel) an Engine runs on synchronous pread/pwrite threads instead, after
// one warning; request_backend("io_uring" | "sync") forces either (see resolve_backend). The
// outcore tools and the Python module pass the environment variable
// OUTCORE_AIO_BACKEND=io_uring|sync to it; this layer reads no environment.
//
// The whole public API of the aio layer. It knows nothing about training or configuration:
// callers pass plain Options (mirroring DeepSpeed's "aio" section) and open Files.
//
//   aio::File f = aio::File::open(path, {.access = aio::Access::kReadWrite, .create = true});
//   f.preallocate(bytes);                                  // ENOSPC -> IoError, now not later
//   aio::Engine engine(aio::Options{.block_size = 1 << 20, .queue_depth = 32});
//   aio::Ticket t = engine.submit_write(f, 0, buffer);    // buffer: 4 KiB aligned (O_DIRECT)
//   ...                                                    // overlap other work
//   engine.wait(t);                                        // throws IoError on failure
//
// Errors: every failure is an outcore::Error subclass (common/error.hpp). I/O failures are
// IoError naming the file, the byte offset and length of the failing piece, and errno. Bad
// arguments (misaligned direct I/O, unknown ticket) are InvalidArgument. Nothing in this
// layer calls abort or assert on an input-dependent condition.
//
// Alignment (kIoAlignment = 4096, common/aligned_buffer.hpp): on a File opened with O_DIRECT
// (File::direct() == true), every request's buffer address, file offset and length must be
// multiples of 4096; a request that is not is refused at submit time with InvalidArgument
// (nothing is queued). On a buffered File (direct() == false, e.g. after the tmpfs fallback)
// any alignment is accepted. Options::block_size must be a multiple of 4096.
//
// Completions: every request's result is checked. A short transfer is resubmitted for the
// rest; -EAGAIN and -EINTR are retried up to 8 times; zero bytes (or more than asked) fail the
// ticket with EIO. Tickets complete in any order, not in the order they were submitted.
#pragma once

#include <sys/types.h>

#include <array>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>

#include "common/aligned_buffer.hpp"
#include "common/error.hpp"

namespace outcore::aio {

// ---------------------------------------------------------------------------------------------
// Options: DeepSpeed's "aio" section, field for field. Defaults are DeepSpeed's.
struct Options {
  // Bytes per I/O request: a submitted span is split into pieces of this size (the last one
  // shorter). A multiple of 4096 from 4096 to 1 GiB. DeepSpeed default 1 MiB.
  size_t block_size = 1 << 20;
  // Requests in flight per I/O thread (each thread owns one io_uring of this depth).
  // 1..4096. DeepSpeed default 8.
  unsigned queue_depth = 8;
  // I/O threads, each with its own ring (DeepSpeed's intra_op_parallelism, formerly
  // thread_count). A span larger than one block is cut into up to thread_count contiguous
  // block-aligned slices, one per thread. 1..256. DeepSpeed default 1.
  unsigned thread_count = 1;
  // true: one io_uring_submit (syscall) per request. false: prepare a batch, submit once.
  bool single_submit = false;
  // true: keep queue_depth requests in flight, reap >= 1 completion and refill at once.
  // false: submit a batch of up to queue_depth, wait for the whole batch, then the next.
  bool overlap_events = true;
  // Use fixed (registered) buffers for requests inside buffers given to
  // Engine::register_buffers, and registered files for Files given to register_file.
  // When the kernel refuses (memlock limit), one warning is logged and plain I/O is used.
  bool use_registered = true;
};

// Throws InvalidArgument naming the field when `o` is out of range (see each field).
void validate(const Options& o);

// ---------------------------------------------------------------------------------------------
// File: an open file descriptor, move-only, closed on destruction.

enum class Access { kRead, kWrite, kReadWrite };

struct OpenOptions {
  Access access = Access::kRead;
  bool create = false;  // O_CREAT, with `mode`
  // With create: the new file's permissions before the umask (0600: the run's own files; 0666
  // for a file a user asked for, as open() in Python makes one).
  unsigned mode = 0600;
  bool truncate = false;   // O_TRUNC
  bool exclusive = false;  // O_EXCL (with create): fail with IoError(EEXIST) if it exists
  // Try O_DIRECT. If the filesystem refuses it (EINVAL, e.g. some tmpfs, ramfs, FUSE), the
  // file is opened buffered instead and one warning per filesystem is logged. false: buffered.
  bool direct = true;
};

class File {
 public:
  File() = default;  // not open
  // Opens `path`. Throws IoError(path, errno, "open") on failure (ENOENT, EACCES, ...), and
  // InvalidArgument naming the path and its type when it is neither a regular file nor a block
  // device, nor a character device opened write-only (the open does not block: a FIFO without a
  // peer is refused, not waited for).
  static File open(const std::filesystem::path& path, const OpenOptions& opts);

  File(File&& other) noexcept;
  File& operator=(File&& other) noexcept;  // closes the current file first (errors logged)
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  // Closes if open; a close error is logged (call close() to see it as an exception).
  ~File();

  bool is_open() const { return fd_ >= 0; }
  int fd() const { return fd_; }
  // Whether the file really is O_DIRECT (false after a fallback or with direct = false).
  bool direct() const { return direct_; }
  const std::string& path() const;
  // A number unique to this open file in this process (stable across moves).
  uint64_t serial() const { return serial_; }
  // Shared copy of the path, kept alive by in-flight requests for error messages.
  const std::shared_ptr<const std::string>& shared_path() const { return path_; }

  // Current size in bytes (fstat). Throws IoError.
  uint64_t size() const;
  // Reserves [0, bytes) on disk (fallocate, mode 0) so a full disk fails now: ENOSPC and
  // every other failure throw IoError(path, 0, bytes, errno, "fallocate"). Where the
  // filesystem does not support fallocate (EOPNOTSUPP), the size is set with ftruncate and
  // one warning is logged. Never shrinks the file.
  void preallocate(uint64_t bytes);
  // Sets the size (ftruncate). Throws IoError.
  void truncate(uint64_t bytes);
  // Flushes data (fdatasync) / data and metadata (fsync) to stable storage. Throws IoError.
  void fdatasync();
  void fsync();
  // Closes now. Throws IoError(path, errno, "close") if close fails; the fd is released
  // either way. No-op on a closed File.
  // REQUIRES: no request on this file is in flight in any Engine.
  void close();

 private:
  File(int fd, bool direct, std::shared_ptr<const std::string> path);
  void reset() noexcept;

  int fd_ = -1;
  bool direct_ = false;
  uint64_t serial_ = 0;
  std::shared_ptr<const std::string> path_;
};

// ---------------------------------------------------------------------------------------------
// IoBackend: the seam under the Engine. The engine does splitting, queueing, resubmission of
// short transfers and error reporting; a backend only moves single requests.

struct IoRequest {
  int fd = -1;
  int fixed_file = -1;  // index in the queue's registered file table, or -1
  int buf_index = -1;   // index in the queue's registered buffer table, or -1
  bool write = false;
  void* buf = nullptr;
  uint32_t len = 0;
  uint64_t offset = 0;
  uint64_t user_data = 0;  // returned in the completion
};

struct IoCompletion {
  uint64_t user_data = 0;
  int32_t res = 0;  // bytes transferred (may be short), or -errno
};

// One submission/completion queue, owned and used by a single I/O thread (not thread-safe).
class IoQueue {
 public:
  virtual ~IoQueue() = default;
  // Queues `r` for the next submit(). Returns false if the submission queue is full.
  virtual bool prepare(const IoRequest& r) = 0;
  // Hands prepared requests to the device. Returns how many of the requests prepared since
  // the last call are now submitted (those not yet submitted stay prepared for the next
  // call), or -errno.
  virtual int submit() = 0;
  // Reaps up to `out.size()` completions. timeout: zero = do not block; negative = block
  // until at least one completes; positive = block at most that long. Returns the number
  // reaped (0 on timeout) or -errno. Only called while requests are in flight.
  virtual int reap(std::span<IoCompletion> out, std::chrono::nanoseconds timeout) = 0;
  // Registers buffers / files for IoRequest::buf_index / fixed_file. Returns 0 or -errno
  // (-EOPNOTSUPP when the backend has no such notion). Only with nothing in flight.
  virtual int register_buffers(std::span<const std::span<std::byte>> bufs) { return -EOPNOTSUPP; }
  virtual int unregister_buffers() { return 0; }
  virtual int register_file(int slot, int fd) { return -EOPNOTSUPP; }  // fd -1 clears the slot
};

// Makes one IoQueue per I/O thread. Thread-safe (called from each I/O thread at start).
class IoBackend {
 public:
  virtual ~IoBackend() = default;
  // A queue able to hold `depth` requests in flight. Throws IoError / Error if it cannot.
  virtual std::unique_ptr<IoQueue> make_queue(unsigned depth) = 0;
  virtual std::string name() const = 0;
};

// io_uring (liburing), one ring per queue; the default where the kernel allows it.
std::unique_ptr<IoBackend> make_io_uring_backend();
// Synchronous pread/pwrite performed at submit(); a reference and a fallback.
std::unique_ptr<IoBackend> make_sync_backend();

// The backend an Engine built without one uses, decided once per process.
enum class BackendKind { kIoUring, kSync };

struct BackendChoice {
  BackendKind kind = BackendKind::kIoUring;
  // true when request_backend() named the backend; false when it was chosen automatically.
  bool forced = false;
  // When forced: the source given to request_backend() (e.g. "OUTCORE_AIO_BACKEND"). Empty
  // otherwise.
  std::string forced_by;
  // Why io_uring is not used although it was wanted: the errno of the io_uring probe and what
  // it means, e.g. "io_uring_queue_init failed with EPERM, Operation not permitted (errno 1):
  // io_uring is disabled for every process (sysctl kernel.io_uring_disabled = 2)". Empty
  // when kind is kIoUring or when sync was forced.
  std::string fallback_reason;
  // "io_uring" or "sync": IoBackend::name() of the backend make_default_backend() makes.
  std::string name() const;
};

// Records the backend the process asks for, for the first resolve_backend() to decide with:
// "io_uring", "sync", or empty (choose automatically; the default when never called).
// `source` says where the value came from and is quoted in resolve_backend()'s errors and
// warning, as "<source>=<value>" (the tools pass "OUTCORE_AIO_BACKEND"); empty means
// "aio::request_backend". The value is not checked here: resolve_backend() refuses a bad one.
// Call it before the first resolve_backend() or Engine construction (the tools do at the
// start of main); once the decision is made a later call does not change it. Thread-safe.
void request_backend(std::string value, std::string source);

// Chooses the default backend. The first call decides from the request recorded by
// request_backend(); every later call returns that decision (or rethrows its error) without
// probing again:
//   none or empty: io_uring if a ring can be created (probed once with io_uring_queue_init),
//     otherwise sync, with fallback_reason set and one warning logged that names the cause
//     and the cost (no asynchronous queue depth: each I/O thread does one request at a time).
//   "io_uring": io_uring; throws ConfigError naming the request's source and the cause if the
//     probe fails.
//   "sync": sync, without probing.
//   anything else: throws ConfigError naming the source, the value and the allowed values.
// Thread-safe: concurrent first calls wait for one decision.
BackendChoice resolve_backend();

// A new backend of the kind resolve_backend() chose. Throws what resolve_backend() throws.
std::unique_ptr<IoBackend> make_default_backend();

// Faults injected by FaultInjectingBackend. Requests are counted from 1 across all queues
// in the order they are prepared (resubmissions of a short transfer count as new requests);
// a fault fires on the request whose count equals `nth` (and, with `every`, on each
// `every`-th request after it).
struct Fault {
  enum class Kind {
    kEio,     // complete with -EIO, nothing transferred
    kEnospc,  // complete with -ENOSPC, nothing transferred
    kShort,   // really transfer only `short_bytes` (< len; default half), report that
    kDelay,   // transfer normally, complete `delay` later (completions reorder)
    kZero,    // complete with 0 bytes transferred (a read past end of file)
  };
  Kind kind = Kind::kEio;
  uint64_t nth = 1;
  uint64_t every = 0;        // 0: fire once
  int direction = -1;        // -1 any, 0 reads only, 1 writes only (count only those)
  uint32_t short_bytes = 0;  // kShort: 0 = half the request, rounded down to 4096 when
                             // the request is 4096-aligned; a request that cannot be
                             // shortened (1 byte, one aligned page) passes unchanged
  std::chrono::microseconds delay{1000};
};

// Wraps another backend and injects Faults. add_fault/requests_seen/faults_fired are
// thread-safe and may be called while I/O runs.
class FaultInjectingBackend : public IoBackend {
 public:
  explicit FaultInjectingBackend(std::unique_ptr<IoBackend> inner);
  ~FaultInjectingBackend() override;
  void add_fault(const Fault& f);
  void clear_faults();
  uint64_t requests_seen() const;
  uint64_t faults_fired() const;

  std::unique_ptr<IoQueue> make_queue(unsigned depth) override;
  std::string name() const override;

  struct State;  // internal, shared with the queues

 private:
  std::unique_ptr<IoBackend> inner_;
  std::shared_ptr<State> state_;
};

// ---------------------------------------------------------------------------------------------
// Stats

// Latency histogram in microseconds: log2 buckets, each split into 4 linear sub-buckets
// (about 19% resolution), from 1 us to about 2^40 us.
class LatencyHistogram {
 public:
  static constexpr int kSub = 4;
  static constexpr int kBuckets = 41 * kSub;
  void record(uint64_t micros);
  void merge(const LatencyHistogram& other);
  uint64_t count() const { return count_; }
  uint64_t max_us() const { return max_us_; }
  double mean_us() const { return count_ ? double(sum_us_) / double(count_) : 0.0; }
  // Upper edge of the bucket holding the p-quantile (0 < p <= 1), clamped to max_us(); 0 when
  // empty.
  uint64_t percentile_us(double p) const;
  const std::array<uint64_t, kBuckets>& buckets() const { return buckets_; }
  static int bucket_of(uint64_t micros);
  static uint64_t bucket_upper_us(int bucket);

 private:
  std::array<uint64_t, kBuckets> buckets_{};
  uint64_t count_ = 0;
  uint64_t sum_us_ = 0;
  uint64_t max_us_ = 0;
};

struct DirectionStats {
  uint64_t bytes = 0;        // bytes transferred successfully
  uint64_t requests = 0;     // requests handed to the backend (pieces, including resubmits)
  uint64_t resubmits = 0;    // of which continuations of a short transfer
  uint64_t errors = 0;       // requests that failed
  uint64_t tickets = 0;      // tickets completed
  LatencyHistogram latency;  // per request, prepare to completion
};

struct Stats {
  DirectionStats read;
  DirectionStats write;
  bool registered_buffers = false;  // fixed buffers are active on every ring
  std::string backend;
};

// ---------------------------------------------------------------------------------------------
// Engine

// A handle for one submitted span. Copyable value; valid until waited once (by wait or
// wait_all). Default-constructed = invalid.
class Ticket {
 public:
  Ticket() = default;
  bool valid() const { return id_ != 0; }
  uint64_t id() const { return id_; }
  friend bool operator==(const Ticket&, const Ticket&) = default;

 private:
  friend class Engine;
  explicit Ticket(uint64_t id) : id_(id) {}
  uint64_t id_ = 0;  // slot index and generation
};

// Threading: submit_read, submit_write, read, write, wait, is_done and stats may be called
// from any number of threads at once. wait_all waits for (and consumes) every outstanding
// ticket, including other threads': use it only when the caller owns all outstanding work.
// register_buffers, unregister_buffers, register_file and unregister_file REQUIRE that no
// request is in flight and no other call runs concurrently.
//
// Buffers and files: a span passed to submit_* must stay valid, and (for writes) unchanged,
// and its File open, until the ticket is waited. The File may be moved meanwhile. The engine
// never frees or copies caller memory and allocates nothing per request in steady state.
class Engine {
 public:
  // Starts options.thread_count I/O threads, each with a queue from `backend`
  // (nullptr: make_default_backend(), io_uring unless resolve_backend() chose sync). Throws
  // InvalidArgument on bad options, ConfigError from resolve_backend() (the requested backend
  // invalid, or io_uring forced where it cannot be used), IoError/Error if a queue cannot be
  // created.
  explicit Engine(const Options& options, std::shared_ptr<IoBackend> backend = nullptr);
  // Waits for every request in flight, then stops the threads. Failures of tickets never
  // waited are logged as one warning, not thrown.
  ~Engine();
  Engine(const Engine&) = delete;
  Engine& operator=(const Engine&) = delete;

  // Starts reading file[offset, offset + dst.size()) into dst / writing src at offset.
  // Spans of any size (zero included: completes at once); they are split into block_size
  // requests spread over the threads. Returns at once.
  // Throws InvalidArgument if the file is not open, or, on a direct file, if dst/src data,
  // offset or size is not a multiple of 4096 (the message names path, offset, length and
  // address); nothing is queued then.
  Ticket submit_read(const File& file, uint64_t offset, std::span<std::byte> dst);
  Ticket submit_write(const File& file, uint64_t offset, std::span<const std::byte> src);

  // Blocks until the ticket's requests have all completed, then releases the ticket.
  // Throws IoError for the first failed request (file, offset, length, errno; a read that
  // hits end of file reports EIO with op "read (end of file)"), and InvalidArgument for an
  // invalid or already-waited ticket.
  void wait(Ticket t);
  // true if every request of the ticket has completed (wait will not block). Does not
  // consume it. InvalidArgument for an invalid ticket.
  bool is_done(Ticket t) const;
  // Waits for every outstanding ticket and releases them all. If any failed, throws the
  // IoError of the earliest-submitted failed ticket (its message counts the others).
  void wait_all();

  // submit + wait.
  void read(const File& file, uint64_t offset, std::span<std::byte> dst);
  void write(const File& file, uint64_t offset, std::span<const std::byte> src);

  // Registers `bufs` (each 4 KiB aligned) with every ring so that requests lying wholly
  // inside one of them use fixed-buffer I/O (no page pinning per request). Replaces any
  // earlier set. Returns false, after one warning, if the kernel refuses (memlock limit);
  // I/O still works unregistered. No-op returning false when use_registered is false.
  bool register_buffers(std::span<const std::span<std::byte>> bufs);
  void unregister_buffers();
  // Registers the file's descriptor with every ring (fixed file). Returns false if the
  // table (64 slots) is full or the kernel refuses. unregister_file REQUIRES the file still
  // open; call it before closing a registered file.
  bool register_file(const File& file);
  void unregister_file(const File& file);

  // A snapshot of counters since construction or reset_stats().
  Stats stats() const;
  void reset_stats();
  const Options& options() const;
  // IoBackend::name() of the backend the I/O threads use: "io_uring", "sync", or a wrapper's
  // name such as "faults(io_uring)". Thread-safe.
  std::string backend_name() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace outcore::aio
