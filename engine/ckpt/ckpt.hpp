// engine/ckpt: sharded checkpoints on disk.
//
// A save directory holds checkpoints and a `latest` file naming the newest one:
//
//   <dir>/latest                      "global_step<N>\n", replaced atomically
//   <dir>/.lock                       flock held by the run that saves here (LockFile: removed
//                                     when it ends, or is ended at once, unless it is not
//                                     outcore's)
//   <dir>/global_step<N>/manifest.json   format, version, step, world size, units, and the
//                                        size and CRC32C of every other file
//   <dir>/global_step<N>/config.json     the model's Hugging Face config
//   <dir>/global_step<N>/ds_config.json  the resolved DeepSpeed config
//   <dir>/global_step<N>/trainer_state.json  step, scheduler, loss scaler, data position
//   <dir>/global_step<N>/rank<r>/optimizer.bin  fp32 master, exp_avg, exp_avg_sq per unit
//   <dir>/global_step<N>/rank<r>/model.bin      low-precision parameters per unit
//
// Every data file starts with a 4 KiB header (magic "OCCKPT\0\1", version, rank, kind, tag)
// followed by segments. A segment is a contiguous run of one unit's flat slab
// [slab_begin, slab_begin + count) of one array, at a 4 KiB-aligned offset. A rank's files hold
// the slab elements it owns, so a checkpoint of any world size is the same slabs cut at other
// places: reading it at another world size is re-slicing (Checkpoint::read_slab), never a
// conversion. Elements at or past a unit's numel are padding and read as zero.
//
// Atomicity: a save writes `<tag>.tmp/` (its first file the marker `.outcore-save`), fsyncs
// every file and directory, verifies what every rank wrote (each file of the manifest present,
// sizes and CRC32C read back), renames it to `<tag>` and removes the marker from it, then
// replaces `latest` through `latest.tmp` + rename. A crash at any point leaves the previous
// checkpoint and `latest` valid; SaveDir removes the leftovers with a warning.
//
// Ownership: outcore deletes or replaces only entries of a save directory it can recognise as
// its own, by name and by content: `.lock` empty or holding its marker (common/lock_file.hpp),
// `global_step<N>/` holding an outcore manifest, leftovers
// `global_step<N>.tmp/` and `.old/` that are empty or hold the marker and nothing but
// checkpoint files (a removal writes the marker into a checkpoint before renaming it to `.old`;
// a committed checkpoint holds none, and a marker names the directory it was written into, so a
// user's copy of a checkpoint under those names is no leftover),
// `latest` naming a `global_step<N>`, and `latest.tmp` naming one or empty. Any other entry is
// left alone;
// one that has a name outcore needs is refused when the directory is opened, naming it. A
// checkpoint is removed (replaced, or pruned under `keep`) only while it holds nothing but the
// files a save writes; anything else put into it keeps it.
//
// Errors: IoError (path, offset, errno) for I/O, including ENOSPC at preallocation;
// CorruptData naming the file (and, for a CRC mismatch, the expected and actual CRC32C) for a
// checkpoint that does not check out; InvalidArgument for misuse.
//
// Threads: the caller's; each CheckpointWriter and Checkpoint does its file I/O on an aio
// engine of its own.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <memory>
#include <nlohmann/json.hpp>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "aio/aio.hpp"
#include "common/dtype.hpp"
#include "common/lock_file.hpp"

namespace outcore::ckpt {

inline constexpr int kFormatVersion = 1;
inline constexpr std::string_view kManifestName = "manifest.json";
// In a save being written or a checkpoint being removed, never in a committed checkpoint.
inline constexpr std::string_view kSaveMarkerName = ".outcore-save";
inline constexpr std::string_view kLatestName = "latest";

// CRC32C (Castagnoli, as iSCSI and ext4 use it) of `data`, continuing `crc` (start with 0).
uint32_t crc32c(std::span<const std::byte> data, uint32_t crc = 0);

// The arrays a checkpoint holds per unit.
enum class ArrayKind : uint8_t { kMaster, kExpAvg, kExpAvgSq, kParams };
std::string_view array_name(ArrayKind a);  // "master", "exp_avg", "exp_avg_sq", "params"

struct Segment {
  int unit = 0;
  ArrayKind array = ArrayKind::kMaster;
  DType dtype = DType::F32;
  uint64_t slab_begin = 0;  // first slab element
  uint64_t count = 0;       // elements
  uint64_t offset = 0;      // byte offset in the file, 4 KiB aligned
  uint64_t bytes() const { return count * dtype_size(dtype); }
};

struct FileInfo {
  std::string path;  // relative to the checkpoint directory, '/' separated
  uint64_t bytes = 0;
  uint32_t crc32c = 0;
  int rank = -1;                  // -1 for files shared by every rank
  std::vector<Segment> segments;  // data files only
};

struct UnitInfo {
  std::string name;  // "embedding", "layer.<i>", "head"
  uint64_t numel = 0;
  uint64_t padded_numel = 0;  // at the saving world size
};

struct Manifest {
  int version = kFormatVersion;
  std::string tag;
  int64_t step = 0;  // optimizer steps done when saved
  int world_size = 1;
  int zero_stage = 0;
  DType param_dtype = DType::F32;
  std::vector<UnitInfo> units;
  std::vector<FileInfo> files;
  // A save after which another run's checkpoints are removed (the first of a --start-over, or
  // of a resume of one killed before they went) lists them, in step order: a kill before they
  // went leaves them beside it, and a resume of this checkpoint then removes them (they are
  // not another branch of the run). Written into the manifest only when not empty.
  std::vector<std::string> replaces;

  const FileInfo* find(std::string_view path) const;
  nlohmann::ordered_json to_json() const;
  // Throws CorruptData naming `source` and the key for a malformed manifest, or a version
  // this build cannot read.
  static Manifest from_json(const nlohmann::json& j, const std::string& source);
  // Checks that for every unit and array the data segments cover [0, numel) without overlap
  // and lie inside their files. CorruptData naming the unit otherwise.
  void check_coverage(const std::string& source) const;
};

// The manifest as bytes, with its own CRC32C embedded (the "manifest_crc32c" key is computed
// over the text with that value zeroed), and the check on load.
std::string manifest_text(const Manifest& m);
Manifest parse_manifest(std::string_view text, const std::string& source);

// ---------------------------------------------------------------------------------------------
// Writing.

// Several processes saving one checkpoint together (data-parallel ranks): each writes its own
// data files into the same <tag>.tmp; rank 0 also writes the text files and the manifest (with
// every rank's files) and commits. Both callbacks are collective: every rank calls them in
// the same order. A rank that fails must end the job (the others would wait for it).
struct SaveGroup {
  int rank = 0;
  int world = 1;
  std::function<void()> barrier;
  // Every rank's `mine`, in rank order, returned on every rank.
  std::function<std::vector<std::string>(const std::string& mine)> all_gather;
};

struct WriterOptions {
  aio::Options aio;  // I/O engine settings (block size, queue depth)
  // Null: this process writes the whole checkpoint. Not owned.
  const SaveGroup* group = nullptr;
  std::shared_ptr<aio::IoBackend> backend;  // nullptr: io_uring; tests inject faults
  // Savers cut each array into segments of at most this many elements (32 MiB of fp32), so
  // the writer's staging is a few pieces whatever the size of a unit.
  uint64_t piece_elems = uint64_t{8} << 20;
  // Test hooks, to check that a crash at any point leaves the previous checkpoint valid:
  // kill the process with SIGKILL after this many data bytes were written (0: never), or at
  // a named point: "before-rename", "before-latest", "after-latest"; where a checkpoint of the
  // same tag is replaced, "after-exchange" (the directories swapped, the old one not yet
  // removed) or "between-renames" (replaced by two renames, as on a filesystem that cannot
  // exchange them, and killed between them); "removal-before-rename" runs the removal of the
  // files registered for cleanup there, as a process ending at once would (empty: never).
  uint64_t crash_after_bytes = 0;
  std::string crash_at;
  // Or after this many files and directories were removed while replacing or pruning
  // checkpoints (0: never).
  uint64_t crash_after_removals = 0;
  // The free bytes of the save directory's filesystem, instead of statvfs's (tests of a full
  // disk).
  std::optional<uint64_t> free_bytes;
  // Read every file back (size and CRC32C) before the checkpoint is renamed into place. Off
  // only in benchmarks that time the writes alone.
  bool verify = true;
};

// What a save directory's existing checkpoints are to the run opening it.
enum class ExistingCheckpoints {
  kRefuse,    // another run's: opening a directory that holds any is refused
  kContinue,  // this run's (it resumes from one of them): kept, pruned under `keep`
  kReplace,   // another run's, to be replaced: removed once this run's first save is committed
};

struct SaveDirOptions {
  int keep = 0;  // > 0: keep only the newest `keep` checkpoints after each save
  // false: a data-parallel rank other than 0, which writes its files into checkpoints rank 0
  // commits: no lock, no check or clean-up, no `latest`, no pruning (rank 0 does them, and must
  // have opened the directory first). It checks at once that the directory is rank 0's (its
  // `.lock` is there: not a directory of this node alone) and that it can write there
  // (InvalidArgument / IoError naming the directory), not at the first save.
  bool primary = true;
  ExistingCheckpoints existing = ExistingCheckpoints::kRefuse;
  // The checkpoint of this directory the run resumes from ("global_step<N>"; empty: none). With
  // kContinue, checkpoints of later steps are another branch of the run, which this run's saves
  // would replace: opening the directory is refused, naming them, unless `latest` names the
  // one resumed from (then they are this run's, saved by a process killed before it named
  // them latest, and a warning says they will be replaced), or the one resumed from lists
  // them as those it replaces (Manifest::replaces: then they are removed after this run's
  // first save, with a warning). With kReplace, it is not among the checkpoints replaced.
  std::string resumed_tag{};
};

// A save directory: created if missing (and, by the primary, removed again when the SaveDir
// goes if still empty; parents it created stay), locked against a second run (PathBusy, an IoError
// of EWOULDBLOCK naming the lock file; the lock file goes with the SaveDir, and with a refused
// open), cleaned of an interrupted save's leftovers (each named in one warning). InvalidArgument
// naming the entry when an entry with a name outcore uses is not outcore's (see "Ownership" above),
// with ExistingCheckpoints::kRefuse when the directory holds checkpoints, and with kContinue when
// it holds checkpoints after the one resumed from (naming them and the ways out). Other entries are
// never touched.
class SaveDir {
 public:
  explicit SaveDir(std::filesystem::path dir, SaveDirOptions options = {});
  ~SaveDir();
  SaveDir(const SaveDir&) = delete;
  SaveDir& operator=(const SaveDir&) = delete;

  const std::filesystem::path& path() const { return dir_; }
  int keep() const { return options_.keep; }
  // The tag `latest` names, if any.
  std::optional<std::string> latest() const;
  // The checkpoints this run's next save replaces (ExistingCheckpoints::kReplace, or a
  // --start-over's leftovers a resume found): the commit lists them in its manifest.
  const std::vector<std::string>& replacing() const { return replaced_; }
  // Points `latest` at `tag` (temp file, fsync, rename, fsync of the directory).
  void set_latest(const std::string& tag, const WriterOptions& hooks);
  // After a committed save of `tag`: removes the checkpoints ExistingCheckpoints::kReplace
  // hands over (other than `tag`), then those beyond the newest `keep` (never the one `latest`
  // names). Only outcore checkpoints are counted or removed, and only those holding nothing
  // but a save's files: one holding anything else (a user's notes, an export) is kept, with a
  // warning naming what it holds.
  void prune(const std::string& tag, const WriterOptions& hooks);
  // Makes `path` (`<tag>.tmp` or `<tag>.old` of this directory) free for a save: removes it
  // when it is an interrupted save's leftover; InvalidArgument naming it when it is anything
  // else.
  void clear_leftover(const std::filesystem::path& path) const;
  // Before a run that may save at any step in [first, last] (every save_every steps, the last
  // one, or a stop's): InvalidArgument naming the first checkpoint of those steps here that holds
  // a file that is not a checkpoint's, which a save of that step would be refused to replace
  // after the training. Primary only; nothing for a rank other than 0.
  void check_can_save(int64_t first, int64_t last) const;
  // Before a run that saves `saves` checkpoints of up to `bytes` each (train::checkpoint_bytes):
  // OutOfMemory naming the directory, the figures and the free space when the filesystem cannot
  // hold the checkpoints the run adds before its pruning keeps their number level (with keep K:
  // K + 1 at once, less those already here; at least one), so that a full disk does not end a
  // run unsaved after its training (`hooks.free_bytes` standing in for statvfs's). Without
  // keep (every checkpoint kept), a warning when the free space holds fewer than `saves`.
  // Nothing when the free space cannot be read (each save checks again).
  void check_room(uint64_t bytes, int64_t saves, const WriterOptions& hooks) const;
  // Whether the path still names the directory the primary locked (true for a rank other than
  // 0): false once it was moved, removed or replaced since the SaveDir opened it.
  bool still_here() const;
  // The primary's check, before each save, before `latest` is set and before pruning, that
  // still_here(): an Error naming the path otherwise, so that a directory made at that name
  // since (another run's) is never saved into or pruned.
  void check_still_here() const;

 private:
  void take_lock();         // `.lock`: created (with outcore's marker) or opened, then flock'ed
  void release() noexcept;  // unlinks the `.lock` outcore wrote; removes a created empty dir
  void open_entries();      // checks every entry with a name outcore uses; removes leftovers
  void check_shared_and_writable() const;  // a rank other than 0's: rank 0's `.lock`, writable
  // Renames checkpoint `tag` to `<tag>.old`, then removes it (marker last).
  void remove_checkpoint(const std::string& tag, const WriterOptions& hooks,
                         uint64_t& removals) const;

  std::filesystem::path dir_;
  SaveDirOptions options_;
  std::optional<LockFile> lock_;       // `.lock` (the primary's)
  bool created_dir_ = false;           // created by this primary SaveDir: removed if still empty
  std::vector<std::string> replaced_;  // removed after the next save (see replacing())
  std::vector<std::string> kept_;      // checkpoints not removed, each warned about once
};

struct SaveResult {
  std::string tag;
  std::filesystem::path path;
  uint64_t bytes = 0;        // all files
  double seconds = 0;        // from begin to commit
  double write_seconds = 0;  // data files only (staging excluded is not separable: included)
};

// Writes one checkpoint. Declare every file first (add_text_file, add_data_file), call
// prepare() (creates `<tag>.tmp/`, preallocates every data file: a full disk fails here, before
// any data is written), then for each data file stage() and submit() its segments in order,
// and commit(). Destroying a writer that did not commit removes `<tag>.tmp/`.
//
// Staging memory is bounded: `staging_slots` buffers of the largest segment's size; stage()
// waits for the oldest in-flight write when all are busy, so producing segment k+1 overlaps
// writing segment k. Threading: one thread drives a writer.
class CheckpointWriter {
 public:
  CheckpointWriter(SaveDir& dir, std::string tag, WriterOptions options = {},
                   size_t staging_slots = 8);
  ~CheckpointWriter();
  CheckpointWriter(const CheckpointWriter&) = delete;
  CheckpointWriter& operator=(const CheckpointWriter&) = delete;

  const std::string& tag() const { return tag_; }
  void add_text_file(std::string rel_path, std::string text);
  // Declares a data file; segment offsets are assigned here (`offset` is ignored on input).
  // Returns its index.
  int add_data_file(std::string rel_path, int rank, std::string_view kind,
                    std::vector<Segment> segments);
  void prepare();
  // A buffer for segment `seg` of data file `file`: exactly its bytes (4 KiB aligned, zero
  // beyond them up to the 4 KiB boundary). Segments of one file must be staged and submitted
  // in order; different files may interleave.
  std::span<std::byte> stage(int file, int seg);
  void submit(int file, int seg);
  // Waits for every write, fsyncs, writes the manifest (with `manifest` providing everything
  // but files and tag), verifies the whole checkpoint as Checkpoint::verify does (CorruptData
  // naming the file when a rank's file is missing, short or not what was written: nothing is
  // renamed then), renames into place, updates `latest`, prunes. Returns what was written.
  SaveResult commit(Manifest manifest);

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  std::string tag_;
};

// ---------------------------------------------------------------------------------------------
// Reading.

struct ReaderOptions {
  aio::Options aio;
  std::shared_ptr<aio::IoBackend> backend;
  // Opens a save's <tag>.tmp/ holding kSaveMarkerName (the save's own check of what it wrote);
  // otherwise such a directory, a save never reported saved, is refused.
  bool unfinished_save = false;
  // Test hook: called with the checkpoint directory chosen, before its files are opened.
  std::function<void(const std::filesystem::path&)> before_files_open = {};
};

// A checkpoint opened for reading. Opening reads and checks the manifest and opens every file
// it lists; verify() checks every file before anything is loaded. What is read is what was
// opened: a run saving into the save directory may prune or replace the checkpoint meanwhile.
// A file written in place after it was opened is refused by the read that follows.
class Checkpoint {
 public:
  // `path`: a checkpoint directory (holding manifest.json) or a save directory whose `latest`
  // names one; a save directory without `latest` (its first save stopped before naming the
  // checkpoint, or the file was removed) opens its newest checkpoint, with a warning. When the
  // checkpoint `latest` named is removed or replaced while it is opened, `latest` is read again.
  // InvalidArgument when neither; CorruptData for a bad manifest or `latest`, or a file of the
  // manifest missing, not a regular file, or (a data file) not its size or with a header
  // (magic, version, rank, tag) other than the manifest's: another rank's or save's file.
  static Checkpoint open(const std::filesystem::path& path, ReaderOptions options = {});
  ~Checkpoint();
  Checkpoint(Checkpoint&&) noexcept;
  Checkpoint& operator=(Checkpoint&&) noexcept;

  const Manifest& manifest() const;
  const std::filesystem::path& dir() const;

  // Checks the size and CRC32C of every file in the manifest, reading each once.
  // CorruptData naming the file with its expected and actual size or CRC. `stop`, when given,
  // is asked between chunks: true ends the check with Interrupted (no read left in flight).
  void verify(const std::function<bool()>& stop = {}) const;
  // A text file of the manifest (size and CRC checked).
  std::string read_text(std::string_view rel_path) const;
  // Slab elements [begin, begin + count) of `unit`'s `array`, as stored (dtype of the
  // segments: fp32, or the param dtype for kParams), from whichever files hold them.
  // Elements at or past the unit's numel are zero. `out` holds count * dtype bytes.
  // CorruptData naming a file read from that was written since the checkpoint was opened (its
  // modification time or size changed): its bytes may not be those verify() checked.
  void read_slab(int unit, ArrayKind array, uint64_t begin, uint64_t count,
                 std::span<std::byte> out) const;
  DType array_dtype(ArrayKind array) const;
  // Bytes read from data files since open (for throughput figures).
  uint64_t bytes_read() const;

 private:
  struct Impl;
  explicit Checkpoint(std::unique_ptr<Impl> impl);
  // The checkpoint directory `dir` itself (open() once it has chosen one).
  static Checkpoint open_dir(const std::filesystem::path& dir, const ReaderOptions& options);
  std::unique_ptr<Impl> impl_;
};

// The checkpoint writer's staging buffers in a run's saves (train/checkpointing.cpp: the open
// piece's three arrays plus writes in flight), and the read-back check's reads: kVerifyBuffers - 1
// chunks in flight while one is summed.
inline constexpr size_t kSaveStagingSlots = 8;
inline constexpr uint64_t kVerifyChunkBytes = uint64_t{32} << 20;
inline constexpr size_t kVerifyBuffers = 4;

// The writer's and the read-back check's buffers in one save: `staging_slots` buffers of the
// largest segment written (`largest_segment_bytes`), alive through the check's ring of reads
// (all of it: its buffers are zeroed when made).
inline uint64_t save_buffer_bytes(size_t staging_slots, uint64_t largest_segment_bytes) {
  return staging_slots * largest_segment_bytes + kVerifyBuffers * kVerifyChunkBytes;
}

// The tag a save at `step` uses: "global_step<step>" (DeepSpeed's name).
std::string tag_for_step(int64_t step);
// The step of tag "global_step<N>" as tag_for_step writes it (no leading zero): N; -1 for any
// other name.
int64_t step_of_tag(const std::string& name);
// Whether `name` is one a save directory's run writes: latest, latest.tmp, .lock,
// global_step<N>, global_step<N>.tmp, global_step<N>.old (and latest.old, kept free too).
bool is_save_entry_name(const std::string& name);
// Whether `path` is a directory holding an outcore manifest (checked by its "format" key only:
// a checkpoint whose data is damaged is still outcore's). Links are not followed.
bool is_checkpoint_dir(const std::filesystem::path& path);
// The checkpoints of directory `dir`: its entries global_step<N> that are checkpoint
// directories, with their steps, in no order (none when `dir` cannot be read).
std::vector<std::pair<int64_t, std::filesystem::path>> checkpoints_in(
    const std::filesystem::path& dir);

// The checkpoint of save directory `dir` that a save of the run resumed from `resumed_tag` left
// when it was killed before naming it latest: `latest` names `resumed_tag`, and the one
// checkpoint of a later step was written after it. Saves run one at a time, each named latest
// before the next starts, so a killed one leaves one such checkpoint; several, or one written
// before it (another run's, left by a --start-over killed before it removed them), are not
// this run's. Its tag, or nullopt.
std::optional<std::string> killed_save_after(const std::filesystem::path& dir,
                                             const std::string& resumed_tag);
// The checkpoints of its save directory that checkpoint directory `checkpoint` replaces
// (Manifest::replaces); none when it lists none or cannot be read.
std::vector<std::string> replaced_by(const std::filesystem::path& checkpoint);
// The outcore checkpoint directory `path` is or lies in (itself or its nearest ancestor holding
// an outcore manifest), or nullopt. A file written there is one the checkpoint does not list: a
// save directory then keeps that checkpoint forever, and a save of its tag is refused.
std::optional<std::filesystem::path> checkpoint_holding(const std::filesystem::path& path);
// Whether `path` is a name a save directory writes (global_step<N>, `latest`, `.lock`, and a
// save's `.tmp` / `.old`) in a directory that is one (it holds `latest` or a checkpoint).
bool takes_a_save_name(const std::filesystem::path& path);

}  // namespace outcore::ckpt
