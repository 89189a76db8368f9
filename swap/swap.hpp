// swap: tensors in NVMe swap files, a bounded pinned host pool, CRC32C per block, and an Adam
// step streamed from NVMe.
//
// The whole public API of the swap layer. It sits on aio/ (I/O) and cpu_adam/ (the step) and
// knows nothing of models or configs: callers pass plain options and a plan of files.
//
//   swap::PinnedPool pool({.budget_bytes = 1 << 30});
//   std::vector<swap::SwapFileSpec> plan = {
//       {.unit = 0, .kind = swap::SwapKind::kParam, .tensors = {{"w", 4 << 20}}},
//       swap::optimizer_file_spec(0, numel, sub_group_size)};
//   swap::SwapSpace space({.nvme_path = "/nvme", .rank = 0}, plan);  // preallocates all
//   aio::Engine engine(aio_options);
//   swap::Swapper swapper(space, engine);
//   swap::PinnedBuffer buf = pool.acquire(4 << 20);
//   swapper.wait(swapper.swap_out(space.find(0, swap::SwapKind::kParam, "w"), buf.bytes()));
//   swap::OptimizerSwapper opt(swapper, pool, {.sub_group_size = sub_group_size});
//   opt.init_state(0, master_fp32);
//   opt.step(0, grads_fp32, adam_params, {bf16_out, DType::BF16});
//
// Errors (common/error.hpp): I/O failures are IoError (file, offset, length, errno); a block
// whose CRC32C does not match on read is CorruptData naming the file and the byte offset; a
// budget that cannot be met is OutOfMemory naming the request and the budget; misuse (wrong
// sizes, misaligned buffers, unknown names, overlapping use of one tensor) is InvalidArgument.
// Nothing here asserts or aborts on an input-dependent condition.
//
// On-disk layout (one file per (rank, kind, unit)):
//   <nvme_path>/outcore_swap/rank<r>/<kind>/<unit>.bin     kind: param | grad | optimizer
//   header     bytes [0, H), H = align_up(64 + 64 * tensor_count, 4096): a 64-byte preamble
//              (magic "OCSWAP\0\1", format version, kind, unit, tensor count, a per-run random
//              nonce, file size) and one 64-byte entry per tensor (name up to 47 bytes
//              NUL-padded, offset, bytes), little-endian.
//   tensors    in plan order from offset H, each at a 4096-aligned offset, occupying
//              align_up(bytes, 4096) bytes. The file is preallocated to its full size, so
//              every request is 4 KiB aligned (O_DIRECT) and never extends the file.
// Checksums are not stored in the file: files are never trusted across runs (a leftover
// directory from a crashed run is cleared at start), so the CRC table lives in memory.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "aio/aio.hpp"
#include "common/aligned_buffer.hpp"
#include "common/dtype.hpp"
#include "common/error.hpp"
#include "cpu_adam/cpu_adam.hpp"

namespace outcore::swap {

// =============================================================================================
// PinnedPool: aligned, page-locked host buffers under a hard byte budget.

// on_register is called once with the pool's whole region after it is allocated and locked;
// if it is set and succeeded, on_unregister is called once with the same region before it is
// freed (e.g. cudaHostRegister / cudaHostUnregister). `on_register` may throw: the pool
// constructor then fails with that error. `on_unregister` must not throw (an exception from
// it is caught and logged).
struct RegistrationHook {
  std::function<void(std::span<std::byte>)> on_register;
  std::function<void(std::span<std::byte>)> on_unregister;
};

struct PinnedPoolOptions {
  // Hard limit on the bytes handed out at once (rounded up to 4096). The pool allocates one
  // region of exactly this size at construction and never allocates again. > 0.
  size_t budget_bytes = 0;
  // mlock the region. When the kernel refuses (RLIMIT_MEMLOCK, no CAP_IPC_LOCK), one warning
  // is logged and the pool works unlocked (locked() == false).
  bool lock = true;
  // Optional; empty functions are skipped.
  RegistrationHook hook{};
};

class PinnedPool;

// A lease on `size()` bytes of the pool, 4096-aligned, whose capacity is
// align_up(size(), 4096) bytes (so a 4 KiB-aligned O_DIRECT request covering it is valid).
// Contents are unspecified (not zeroed). Move-only; returns its bytes to the pool when
// destroyed or reset. The pool's memory stays valid while any lease exists (even past the
// PinnedPool object's destruction). A lease may be moved to and released from any thread.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  PinnedBuffer(PinnedBuffer&& other) noexcept;
  PinnedBuffer& operator=(PinnedBuffer&& other) noexcept;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  ~PinnedBuffer();

  bool valid() const { return data_ != nullptr; }
  std::byte* data() const { return data_; }
  size_t size() const { return size_; }
  size_t capacity() const { return align_up(size_, kIoAlignment); }
  std::span<std::byte> bytes() const { return {data_, size_}; }
  template <typename T>
  std::span<T> as() const {
    return {reinterpret_cast<T*>(data_), size_ / sizeof(T)};
  }
  // Returns the bytes to the pool now (no-op if not valid).
  void reset();

 private:
  friend class PinnedPool;
  struct Owner;  // the pool's shared state
  PinnedBuffer(std::shared_ptr<Owner> owner, std::byte* data, size_t size);
  std::shared_ptr<Owner> owner_;
  std::byte* data_ = nullptr;
  size_t size_ = 0;
};

// Leases are placed first fit in the one region (freed extents coalesce), so a request waits
// for contiguous space. Thread-safe: every member may be called from any number of threads at
// once.
class PinnedPool {
 public:
  // Allocates and (optionally) locks and registers the region. Throws InvalidArgument for
  // budget 0, OutOfMemory if the host cannot allocate it, or the hook's error.
  explicit PinnedPool(const PinnedPoolOptions& options);
  // Unregisters and frees the region once the last outstanding lease is released (leases may
  // outlive the pool object; a warning is logged when they do).
  ~PinnedPool();
  PinnedPool(const PinnedPool&) = delete;
  PinnedPool& operator=(const PinnedPool&) = delete;

  // A lease of `bytes` (> 0), blocking until that much contiguous space is free or `timeout`
  // passes. Throws OutOfMemory at once, without waiting, if align_up(bytes, 4096) exceeds
  // the whole budget (message names the request and the budget); OutOfMemory after
  // `timeout` otherwise (naming the request, the budget and the bytes in use);
  // InvalidArgument for bytes == 0.
  PinnedBuffer acquire(size_t bytes,
                       std::chrono::milliseconds timeout = std::chrono::milliseconds(60'000));
  // A lease if the space is free now, else nullopt. Throws like acquire for bytes == 0 or a
  // request larger than the budget.
  std::optional<PinnedBuffer> try_acquire(size_t bytes);

  size_t budget_bytes() const;
  // Bytes currently leased (each lease counted at its capacity) and the highest value ever.
  size_t in_use_bytes() const;
  size_t peak_bytes() const;
  size_t leases() const;  // leases currently outstanding
  bool locked() const;    // whether mlock succeeded
  // The whole region (for Engine::register_buffers, which wants it once at start).
  std::span<std::byte> region() const;

 private:
  std::shared_ptr<PinnedBuffer::Owner> owner_;
};

// =============================================================================================
// SwapSpace: the swap files of one rank, preallocated at start, removed at destruction.

enum class SwapKind : uint8_t { kParam, kGrad, kOptimizer };
// "param", "grad", "optimizer" (the directory names).
std::string_view swap_kind_name(SwapKind kind);

struct TensorSpec {
  std::string name;    // unique within its file, 1..47 bytes
  uint64_t bytes = 0;  // exact payload size; > 0
};

// One file: the tensors of one unit's partition of one kind.
struct SwapFileSpec {
  uint32_t unit = 0;
  SwapKind kind = SwapKind::kParam;
  std::vector<TensorSpec> tensors;  // at least one
};

// Names one tensor: (unit, kind, index into its SwapFileSpec::tensors).
struct TensorId {
  uint32_t unit = 0;
  SwapKind kind = SwapKind::kParam;
  uint32_t index = 0;
  friend bool operator==(const TensorId&, const TensorId&) = default;
};

struct TensorInfo {
  std::string name;
  uint64_t offset = 0;  // byte offset in the file, a multiple of 4096
  uint64_t bytes = 0;   // payload bytes (TensorSpec::bytes)
  uint64_t slot_bytes() const { return align_up(bytes, kIoAlignment); }
};

// The directory a SwapSpace makes under nvme_path; everything in it is a run's, removed when the
// run ends.
inline constexpr std::string_view kSwapTreeName = "outcore_swap";
// The swap tree (a directory named kSwapTreeName) `path` lies in, made absolute, or nullopt.
// Outputs there are refused: a run's swap files of those names would replace them, and the
// run's exit would remove them.
std::optional<std::filesystem::path> swap_tree_holding(const std::filesystem::path& path);

struct SwapSpaceOptions {
  std::filesystem::path nvme_path;  // must exist; the outcore_swap/ tree is made below it
  int rank = 0;                     // >= 0
  // > 0 on rank 0: the run's ranks. The swap files that ranks at or beyond it left under
  // nvme_path (an earlier run at a larger world size, killed) are removed too, from each kind
  // directory no live run holds. 0: other ranks' directories are not looked at.
  int world_size = 0;
  bool direct = true;  // O_DIRECT (falls back to buffered per aio::File)
};

// Thread-safety: construction and destruction are single-threaded; every const member may be
// called from any number of threads at once.
class SwapSpace {
 public:
  // Creates <nvme_path>/outcore_swap/rank<r>/<kind>/ for each kind in `files`, removes the
  // swap files an earlier run left there (<unit>.bin starting with the swap header, or empty:
  // never trusted; one warning; any other file, zeros included, is left), takes an
  // exclusive lock on each kind directory (its .lock holds a marker: a user's file of that name
  // is locked, never written or removed; a second SwapSpace, in this or another process,
  // on the same rank and kind fails with PathBusy), then creates every file, writes
  // its header and preallocates it.
  // Throws InvalidArgument for a malformed plan (duplicate (unit, kind), duplicate or empty
  // names, zero-byte tensors, empty files) or a file that is not a swap file at a name one of
  // them needs (naming it), IoError(ENOSPC) naming the directory, the
  // bytes needed and the bytes free (statvfs) when the plan does not fit, checked before
  // anything is written, and IoError for any other failure. On any failure every file and
  // directory made so far is removed.
  SwapSpace(const SwapSpaceOptions& options, std::span<const SwapFileSpec> files);
  // Closes and removes every file that is still its own (a file put at one's name since, a
  // user's output renamed there, is left, with a warning), then each of its directories that is
  // now empty. Errors are logged, never thrown. REQUIRES: no I/O on these files is in flight.
  ~SwapSpace();
  SwapSpace(const SwapSpace&) = delete;
  SwapSpace& operator=(const SwapSpace&) = delete;

  // Bytes the plan occupies on disk (headers, tensors, alignment padding).
  static uint64_t bytes_needed(std::span<const SwapFileSpec> files);
  // At most the bytes the swap tree's directories and lock files take besides on a filesystem
  // of 4 KiB blocks (outcore_swap/, rank<r>/, each kind's directory with room for its files'
  // entries, and its .lock): taken from the free space before bytes_needed() is checked.
  static uint64_t tree_bytes_needed(std::span<const SwapFileSpec> files);

  // The id of tensor `name` in file (unit, kind). Throws InvalidArgument if there is none.
  TensorId find(uint32_t unit, SwapKind kind, std::string_view name) const;
  // Whether file (unit, kind) exists in the plan, and its tensor count (0 if not).
  size_t tensor_count(uint32_t unit, SwapKind kind) const;
  // Layout of a tensor. Throws InvalidArgument for an unknown id.
  const TensorInfo& info(TensorId id) const;
  const aio::File& file(TensorId id) const;
  std::filesystem::path file_path(uint32_t unit, SwapKind kind) const;
  // <nvme_path>/outcore_swap/rank<r>
  const std::filesystem::path& root() const;
  uint64_t total_bytes() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// =============================================================================================
// Swapper: async swap_out / swap_in of named tensors through one aio::Engine, CRC32C per block.

struct SwapperOptions {
  // CRC32C (ISA-L crc32_iscsi) of every block is computed on swap_out and checked when a
  // swap_in is waited. false: neither (no cost, no protection).
  bool verify_checksums = true;
  // Bytes per checksummed block, counted from the tensor's start (the last block of a tensor
  // is shorter). A positive multiple of 4096. A mismatch is reported at this granularity.
  size_t checksum_block_bytes = 1 << 20;
};

// A handle for one swap_out/swap_in. Copyable value; valid until waited once.
class SwapTicket {
 public:
  SwapTicket() = default;
  bool valid() const { return id_ != 0; }
  uint64_t id() const { return id_; }
  friend bool operator==(const SwapTicket&, const SwapTicket&) = default;

 private:
  friend class Swapper;
  explicit SwapTicket(uint64_t id) : id_(id) {}
  uint64_t id_ = 0;
};

struct SwapperStats {
  uint64_t bytes_out = 0, bytes_in = 0;  // payload bytes of completed swaps
  // The bytes the drive moved for them: each tensor's whole 4 KiB slot.
  uint64_t drive_bytes_out = 0, drive_bytes_in = 0;
  uint64_t swaps_out = 0, swaps_in = 0;
  double checksum_seconds = 0;  // time spent computing/verifying CRCs (all threads summed)
};

// Threading: swap_out, swap_in, wait, is_done, has_data and stats may be called from any
// number of threads at once, and a ticket may be waited on a thread other than the one that
// submitted it. Two operations on the same tensor must not be in flight together (a swap_in
// while a swap_out of it, or two swap_outs): the second call throws InvalidArgument; several
// swap_ins of one tensor at once are fine. A ticket never waited is drained (errors logged)
// by the destructor.
class Swapper {
 public:
  // `space` and `engine` must outlive the Swapper. `executor` (optional, must outlive it)
  // spreads CRC work over its threads; null: the calling thread.
  Swapper(SwapSpace& space, aio::Engine& engine, const SwapperOptions& options = {},
          const cpu_adam::Executor* executor = nullptr);
  ~Swapper();
  Swapper(const Swapper&) = delete;
  Swapper& operator=(const Swapper&) = delete;

  // Starts writing `src` (exactly info(id).bytes bytes) to the tensor's slot. src.data() must
  // be 4096-aligned and the memory must extend to align_up(bytes, 4096) (a PinnedBuffer or
  // AlignedBuffer of that size does); the padding bytes are written too, unchecked. The CRCs
  // are computed on the calling thread before submission. src must stay valid and unchanged
  // until the ticket is waited. Throws InvalidArgument (wrong size, misalignment, unknown id,
  // a conflicting operation in flight); nothing is queued then.
  SwapTicket swap_out(TensorId id, std::span<const std::byte> src);
  // Starts reading the tensor into `dst` (exactly info(id).bytes bytes, 4096-aligned,
  // memory extending to align_up(bytes, 4096), whose padding is overwritten). Throws
  // InvalidArgument as swap_out, and if the tensor holds no data (never written, or its last
  // write failed).
  SwapTicket swap_in(TensorId id, std::span<std::byte> dst);

  // Blocks until the operation completes and releases the ticket. For a swap_in, verifies
  // every block's CRC on the calling thread (when enabled). Throws IoError for a failed
  // transfer (a failed swap_out leaves the tensor without data until it is written again),
  // CorruptData naming the file, the block's byte offset and length, the tensor and both CRCs
  // on a mismatch, InvalidArgument for an invalid or already-waited ticket.
  void wait(SwapTicket t);
  // Whether wait would not block. InvalidArgument for an invalid ticket.
  bool is_done(SwapTicket t) const;

  // Convenience: submit and wait.
  void write(TensorId id, std::span<const std::byte> src) { wait(swap_out(id, src)); }
  void read(TensorId id, std::span<std::byte> dst) { wait(swap_in(id, dst)); }

  // Whether the tensor's slot holds data from a completed swap_out.
  bool has_data(TensorId id) const;
  const SwapSpace& space() const;
  const SwapperOptions& options() const;
  SwapperStats stats() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// =============================================================================================
// OptimizerSwapper: Adam over optimizer state that lives on NVMe, pipelined by sub-group.
//
// A unit's optimizer partition of `numel` elements is cut into sub-groups of sub_group_size
// elements (the last one shorter). Sub-group k is one tensor "sg<k>" in the unit's optimizer
// file holding [fp32 master | exp_avg | exp_avg_sq], each part starting 4096-aligned, so one
// read and one write move a sub-group. The moments are fp32 or bf16 (options.moments): 12 or 8
// bytes per element each way per step. Every call taking or giving moments as fp32 arrays
// converts: bf16 moments are widened exactly on the way out and rounded to nearest even on the
// way in. A step reads sub-group k, runs cpu_adam::adam_step on
// it with the caller's gradient slice, and writes it back in place.
//
// Failure semantics: state is updated in place. If a step fails (I/O error, CorruptData)
// after any sub-group's write was submitted, the unit's state on disk is a mix of old and new
// sub-groups: the unit is marked poisoned, every later call on it (except init_state /
// load_state, which rewrite it) throws InvalidArgument, and the engine must treat the error
// as fatal for the run (or restore from a checkpoint). A step that fails before any write was
// submitted leaves the state intact. Either way the step is not counted (steps_done unchanged)
// and the output buffer's contents are unspecified. All I/O of a failed step is drained
// before the error is thrown, so no buffer is released while a transfer is in flight.
//
// Spare copy (options.spare_copy, files laid out with copies = 2): every sub-group has a
// second slot "sg<k>.spare", and which of the two holds the unit's state flips per unit. A
// tentative step (step_tentative) reads the current copy and writes the other, leaving the
// current one intact until commit() makes the new state current (and counts the step) or
// discard() forgets it. A failed tentative step never poisons the unit. Used to start a step
// before it is known whether its gradient multiplier holds (the engine's step during
// backward), and to redo it from the old state when it did not.

// The optimizer file of one unit for the SwapSpace plan. numel > 0, sub_group_size > 0,
// moments F32 or BF16, copies 1 or 2 (2: a spare slot per sub-group, see above; else
// InvalidArgument).
SwapFileSpec optimizer_file_spec(uint32_t unit, uint64_t numel, uint64_t sub_group_size,
                                 DType moments = DType::F32, unsigned copies = 1);
// The bytes one step reads (and writes) of such a file: every sub-group's slot of one copy, in
// whole 4 KiB blocks. Each sub-group's three parts start on 4 KiB, so a sub_group_size that is
// not a multiple of 1024 elements (2048 with bf16 moments) moves more than the state's bytes (at
// 16 elements, 64 times).
uint64_t optimizer_swap_io_bytes(uint64_t numel, uint64_t sub_group_size, DType moments);

struct OptimizerSwapperOptions {
  // Elements per sub-group (zero_optimization.sub_group_size). > 0.
  uint64_t sub_group_size = 1'000'000'000;
  // Sub-group buffers taken from the pool for one step (offload_optimizer.buffer_count), as
  // one lease of buffer_count * (bytes of the largest sub-group). >= 1; full overlap with
  // both pipeline flags needs >= 3 (current, next being read, previous being written).
  unsigned buffer_count = 4;
  // Read sub-group k+1 (and further ahead, buffers permitting) while k is being stepped.
  bool pipeline_read = false;
  // Leave sub-group k's write in flight while k+1 is being stepped.
  bool pipeline_write = false;
  // How long a step waits for its buffers from the pool before OutOfMemory.
  std::chrono::milliseconds buffer_timeout{60'000};
  // dtype of exp_avg and exp_avg_sq in the files: F32 or BF16 (cpu_adam::Moments). The swap
  // space must be laid out with the same (optimizer_file_spec).
  DType moments = DType::F32;
  // A spare slot per sub-group for tentative steps; the files must be laid out with
  // optimizer_file_spec(..., copies = 2).
  bool spare_copy = false;
};

// Where the step puts the updated parameters. dtype BF16/F16: rounded copies (cpu_adam's
// ParamsOut); F32: the fp32 master values themselves. data == nullptr: no output.
struct ParamsOut {
  void* data = nullptr;
  DType dtype = DType::BF16;
};

// Timings of the last step on this swapper (any unit), seconds.
struct OptimizerStepStats {
  double total_seconds = 0;
  double compute_seconds = 0;     // cpu_adam
  double read_wait_seconds = 0;   // blocked waiting for reads (incl. CRC verification)
  double write_wait_seconds = 0;  // blocked waiting for writes (incl. CRC computation)
  uint64_t bytes_read = 0, bytes_written = 0;
  size_t sub_groups = 0;
};

// Threading: calls on different units may run concurrently from different threads (each
// step takes its own buffers from the pool). Calls on the same unit must not overlap: the
// second throws InvalidArgument. steps_done / poisoned / last_step_stats are thread-safe.
class OptimizerSwapper {
 public:
  // swapper, pool and executor (optional: null = cpu_adam on the calling thread) must outlive
  // this object. Throws InvalidArgument for bad options.
  OptimizerSwapper(Swapper& swapper, PinnedPool& pool, const OptimizerSwapperOptions& options,
                   const cpu_adam::Executor* executor = nullptr);
  ~OptimizerSwapper();
  OptimizerSwapper(const OptimizerSwapper&) = delete;
  OptimizerSwapper& operator=(const OptimizerSwapper&) = delete;

  // Writes the initial state of `unit`: master = `master` (numel = master.size()), moments
  // zero; steps_done = 0 and the unit is no longer poisoned. Throws InvalidArgument if the
  // SwapSpace has no optimizer file for `unit` laid out by optimizer_file_spec(unit,
  // master.size(), sub_group_size); IoError / OutOfMemory as step.
  void init_state(uint32_t unit, std::span<const float> master);
  // Like init_state, but returns once `master` has been copied into the pinned ring and every
  // sub-group's write submitted: the last writes (up to buffer_count sub-groups) go on while
  // the caller makes the next unit's weights. The unit is initialised when they have finished.
  // The next call on this swapper that works on a unit (any unit), flush() and the destructor
  // wait for them first; a failed write surfaces there (as IoError naming the file; the unit
  // stays uninitialised), the destructor logs it. One call's writes are left in flight at a
  // time: concurrent calls (on different units) finish each other's before leaving their own.
  void init_state_async(uint32_t unit, std::span<const float> master);
  // Waits for the writes an init_state_async left in flight; rethrows their first error.
  void flush();
  // Like init_state with given moments (checkpoint resume); steps_done = `steps_done`.
  void load_state(uint32_t unit, std::span<const float> master, std::span<const float> exp_avg,
                  std::span<const float> exp_avg_sq, uint64_t steps_done);

  // One Adam step of `unit`: grads.size() == numel (fp32, host memory, unscaled by
  // hp.grad_scale in the kernel), hp as cpu_adam::adam_step (hp.step is the caller's step
  // number and is not checked against steps_done). `out` receives numel elements.
  // On success steps_done(unit) increases by one. Throws InvalidArgument (unknown or
  // uninitialised or poisoned unit, wrong sizes, bad hp), OutOfMemory (no buffers within
  // buffer_timeout), IoError / CorruptData from the swap files (see failure semantics above).
  void step(uint32_t unit, std::span<const float> grads, const cpu_adam::AdamParams& hp,
            ParamsOut out = {});
  // The same step written to the spare copy (options.spare_copy); the current copy stays the
  // unit's state until commit(unit) (the new state becomes current, steps_done + 1) or
  // discard(unit). `out` receives the new parameters as with step. While a tentative result is
  // pending, every other call on the unit except commit/discard/init_state/load_state/
  // fill_state throws InvalidArgument; a failed tentative step leaves nothing pending.
  void step_tentative(uint32_t unit, std::span<const float> grads, const cpu_adam::AdamParams& hp,
                      ParamsOut out = {});
  void commit(uint32_t unit);
  void discard(uint32_t unit);
  bool tentative_pending(uint32_t unit) const;

  // Reads the fp32 master weights (and, with read_state, the moments) of `unit` into the
  // caller's arrays (each numel elements). Throws as step.
  void read_master(uint32_t unit, std::span<float> master);
  void read_state(uint32_t unit, std::span<float> master, std::span<float> exp_avg,
                  std::span<float> exp_avg_sq);

  // Streaming access for checkpoints: one pass over the unit's sub-groups through the ring,
  // calling `fn(first, n, master, exp_avg, exp_avg_sq)` for each in order, with pointers into a
  // pinned ring buffer that are valid only during the call. visit_state only reads;
  // fill_state only writes (fn fills the arrays; the moments start zeroed) and sets
  // steps_done = `steps_done`, like load_state. Memory: the ring, never the whole unit.
  // Throws as read_state / load_state, and what fn throws (the pass is drained first; a
  // failed fill_state leaves the unit uninitialised).
  using StateVisitor = std::function<void(uint64_t first, uint64_t n, const float* master,
                                          const float* exp_avg, const float* exp_avg_sq)>;
  using StateFiller = std::function<void(uint64_t first, uint64_t n, float* master, float* exp_avg,
                                         float* exp_avg_sq)>;
  void visit_state(uint32_t unit, uint64_t numel, const StateVisitor& fn);
  void fill_state(uint32_t unit, uint64_t numel, const StateFiller& fn, uint64_t steps_done);

  uint64_t steps_done(uint32_t unit) const;  // 0 for an unknown unit
  bool poisoned(uint32_t unit) const;
  OptimizerStepStats last_step_stats() const;
  const OptimizerSwapperOptions& options() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

}  // namespace outcore::swap
