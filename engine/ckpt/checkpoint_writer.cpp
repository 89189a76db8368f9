// Writing checkpoints: the save directory (lock, leftovers, latest, pruning) and the streaming,
// atomic CheckpointWriter.
#include <fcntl.h>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <csignal>
#include <cstring>
#include <fstream>
#include <map>
#include <set>

#include "common/aligned_buffer.hpp"
#include "common/cleanup.hpp"
#include "common/error.hpp"
#include "common/lock_file.hpp"
#include "common/log.hpp"
#include "common/open_file.hpp"
#include "engine/ckpt/ckpt.hpp"
#include "engine/ckpt/file_util.hpp"

namespace fs = std::filesystem;

namespace outcore::ckpt {
namespace {

[[noreturn]] void crash_now(const char* where) {
  log::warn("checkpoint: simulated crash ({})", where);
  ::raise(SIGKILL);
  std::abort();
}

// ---- What is outcore's in a save directory ----------------------------------------------------

// The marker every save writes first into `<tag>.tmp/`, removed once the checkpoint is renamed
// into place, and written again into a checkpoint before it is renamed to `<tag>.old` to be
// removed. It names the directory it was written into by device and inode, which a rename keeps
// and a copy does not (marker_text): a `.tmp` or `.old` directory without it, or holding one
// written into another directory (a user's copy of a checkpoint), is never taken for a
// leftover. kLegacyMarkerText is what earlier versions wrote (and left in committed
// checkpoints): a directory holding it is a leftover only while it holds no manifest.
constexpr std::string_view kLegacyMarkerText = "outcore checkpoint in progress\n";
// What outcore writes into the `.lock` it creates (one without it is not outcore's).
constexpr std::string_view kLockText = "outcore save directory lock\n";

bool has_suffix(const std::string& s, std::string_view suffix) {
  return s.size() > suffix.size() &&
         s.compare(s.size() - suffix.size(), suffix.size(), suffix) == 0;
}

fs::file_type type_of(const fs::path& p) {
  std::error_code ec;
  return fs::symlink_status(p, ec).type();  // a symbolic link is never followed
}

// The marker's text for directory `dir`: its device and inode (empty when it cannot be stat'ed).
std::string marker_text(const fs::path& dir) {
  struct stat st {};
  if (::lstat(dir.c_str(), &st) != 0) return {};
  return fmt::format("outcore checkpoint in progress\ndirectory {}:{}\n",
                     static_cast<uint64_t>(st.st_dev), static_cast<uint64_t>(st.st_ino));
}

// Writes the marker into directory `dir` (durably: the file and its directory entry), in place
// of one already there (an earlier version's, left in a committed checkpoint, or one of an
// interrupted removal): a regular file of that name is outcore's; anything else (a link) fails
// the write and is kept.
void write_marker(const fs::path& dir) {
  const std::string text = marker_text(dir);
  if (text.empty()) throw IoError(dir.string(), errno, "stat checkpoint directory");
  if (type_of(dir / kSaveMarkerName) == fs::file_type::regular &&
      ::unlink((dir / kSaveMarkerName).c_str()) != 0 && errno != ENOENT)
    throw IoError((dir / kSaveMarkerName).string(), errno, "remove the save marker");
  write_file_durably(dir / kSaveMarkerName, text);
  fsync_directory(dir);
}

bool is_rank_dir_name(const std::string& name) {
  return name.size() > 4 && name.compare(0, 4, "rank") == 0 &&
         name.find_first_not_of("0123456789", 4) == std::string::npos;
}

// The first entry of directory `p` that a save does not write (a user's file, an export put
// into it), relative to `p`; empty when there is none. What a save writes: the marker, the
// manifest, the text files and rank<r>/{optimizer,model}.bin every save writes, and with
// `manifest_files` the files its manifest lists (a checkpoint whose manifest does not parse is
// still judged by the names).
std::string foreign_entry(const fs::path& p, bool manifest_files) {
  std::set<std::string, std::less<>> ours = {std::string(kSaveMarkerName),
                                             std::string(kManifestName), "config.json",
                                             "ds_config.json", "trainer_state.json"};
  if (manifest_files) {
    try {
      const Manifest m = parse_manifest(read_small_file(p / kManifestName, 64ull << 20),
                                        (p / kManifestName).string());
      for (const FileInfo& f : m.files) ours.insert(f.path);
    } catch (const Error&) {
    }
  }
  std::error_code ec;
  for (const fs::directory_entry& e : fs::directory_iterator(p, ec)) {
    const std::string name = e.path().filename().string();
    const fs::file_type t = type_of(e.path());
    if (t == fs::file_type::regular && ours.count(name)) continue;
    if (t != fs::file_type::directory || !is_rank_dir_name(name)) return name;
    for (const fs::directory_entry& f : fs::directory_iterator(e.path(), ec)) {
      const std::string rel = name + "/" + f.path().filename().string();
      const std::string fname = f.path().filename().string();
      if (type_of(f.path()) != fs::file_type::regular ||
          (!ours.count(rel) && fname != "optimizer.bin" && fname != "model.bin"))
        return rel;
    }
  }
  if (ec) return fmt::format("(unreadable: {})", ec.message());
  return {};
}

// An interrupted save: an empty directory, or one holding the marker and nothing but the files
// a save writes (text files, manifest, rank<r>/{optimizer,model}.bin).
bool is_save_leftover(const fs::path& p) {
  if (type_of(p) != fs::file_type::directory) return false;
  std::error_code ec;
  if (fs::is_empty(p, ec)) return true;
  try {
    if (type_of(p / kSaveMarkerName) != fs::file_type::regular) return false;
    const std::string text = read_small_file(p / kSaveMarkerName, 4096);
    const bool ours =
        text == marker_text(p) || (text == kLegacyMarkerText && !is_checkpoint_dir(p));
    if (!ours) return false;
  } catch (const Error&) {
    return false;
  }
  return foreign_entry(p, /*manifest_files=*/true).empty();
}

// Whether `dir` holds a save directory's lock as outcore writes it: a run saves there, or did
// until it was killed (even before its first checkpoint).
bool holds_save_lock(const fs::path& dir) {
  const fs::path lock = dir / ".lock";
  if (type_of(lock) != fs::file_type::regular) return false;
  std::ifstream in(lock, std::ios::binary);
  std::string text(kLockText.size() + 1, '\0');
  in.read(text.data(), static_cast<std::streamsize>(text.size()));
  text.resize(static_cast<size_t>(in.gcount()));
  return text == kLockText;
}

// `latest` or `latest.tmp` as outcore writes them: a regular file naming one checkpoint of a
// save directory (global_step<N>); for `latest.tmp`, also an empty one (a save killed between
// creating and writing it). Any other file of those names is the user's.
bool is_latest_file(const fs::path& p, bool tmp = false) {
  if (type_of(p) != fs::file_type::regular) return false;
  std::error_code ec;
  if (tmp && fs::file_size(p, ec) == 0 && !ec) return true;
  try {
    return step_of_tag(read_latest_tag(p)) >= 0;
  } catch (const Error&) {
    return false;
  }
}

[[noreturn]] void refuse_entry(const fs::path& dir, const fs::path& entry, std::string_view what) {
  throw InvalidArgument(fmt::format(
      "save directory {}: {} is not outcore's ({}), and outcore writes that name: move it away or "
      "choose another save directory",
      dir.string(), entry.filename().string(), what));
}

// Removes a directory of outcore's (a checkpoint, or a leftover `.tmp` / `.old`) so that a kill
// at any moment leaves something still recognisable as outcore's: the marker is written first
// when missing and removed last, before the empty directory. `removals` counts files and
// directories removed, for the crash hook (WriterOptions::crash_after_removals).
void remove_owned_dir(const fs::path& p, const WriterOptions* hooks, uint64_t& removals) {
  auto removed = [&] {
    ++removals;
    if (hooks != nullptr && hooks->crash_after_removals != 0 &&
        removals >= hooks->crash_after_removals)
      crash_now("after removals");
  };
  auto remove_one = [&](const fs::path& q) {
    std::error_code ec;
    fs::remove(q, ec);
    if (ec) throw IoError(q.string(), ec.value(), "remove");
    removed();
  };
  std::error_code ec;
  if (!fs::is_empty(p, ec) && type_of(p / kSaveMarkerName) == fs::file_type::not_found)
    write_marker(p);
  std::vector<fs::path> entries;
  for (const fs::directory_entry& e : fs::directory_iterator(p)) entries.push_back(e.path());
  for (const fs::path& e : entries) {
    if (e.filename() == kSaveMarkerName) continue;
    if (type_of(e) == fs::file_type::directory) {
      std::vector<fs::path> files;
      for (const fs::directory_entry& f : fs::directory_iterator(e)) files.push_back(f.path());
      for (const fs::path& f : files) remove_one(f);
    }
    remove_one(e);
  }
  if (type_of(p / kSaveMarkerName) != fs::file_type::not_found) remove_one(p / kSaveMarkerName);
  remove_one(p);
}

// Writes the marker into checkpoint `p` before it is renamed to `<tag>.old` and removed.
void mark_for_removal(const fs::path& p) { write_marker(p); }

}  // namespace

int64_t step_of_tag(const std::string& name) {
  constexpr std::string_view prefix = "global_step";
  if (name.size() <= prefix.size() || name.compare(0, prefix.size(), prefix) != 0) return -1;
  // As tag_for_step writes it: no leading zero (global_step01 is someone else's).
  if (name[prefix.size()] == '0' && name.size() > prefix.size() + 1) return -1;
  int64_t v = 0;
  for (size_t i = prefix.size(); i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9' || v > (INT64_MAX - 9) / 10) return -1;
    v = v * 10 + (name[i] - '0');
  }
  return v;
}

bool is_save_entry_name(const std::string& name) {
  if (name == kLatestName || name == std::string(kLatestName) + ".tmp" ||
      name == std::string(kLatestName) + ".old" || name == ".lock")
    return true;
  if (has_suffix(name, ".tmp") || has_suffix(name, ".old"))
    return step_of_tag(name.substr(0, name.size() - 4)) >= 0;
  return step_of_tag(name) >= 0;
}

bool is_checkpoint_dir(const fs::path& p) {
  if (type_of(p) != fs::file_type::directory ||
      type_of(p / kManifestName) != fs::file_type::regular)
    return false;
  try {
    const nlohmann::json j =
        nlohmann::json::parse(read_small_file(p / kManifestName, 64ull << 20), nullptr, false);
    return j.is_object() && j.value("format", std::string()) == "outcore-checkpoint";
  } catch (const Error&) {
    return false;
  }
}

std::vector<std::string> replaced_by(const fs::path& checkpoint) {
  try {
    const fs::path p = checkpoint / kManifestName;
    return parse_manifest(read_small_file(p, 64ull << 20), p.string()).replaces;
  } catch (const std::exception&) {  // no checkpoint there, or not one to read
    return {};
  }
}

std::optional<std::string> killed_save_after(const fs::path& dir, const std::string& resumed_tag) {
  const int64_t from = step_of_tag(resumed_tag);
  std::error_code ec;
  if (from < 0 || !fs::exists(dir / kLatestName, ec)) return std::nullopt;
  try {
    if (read_latest_tag(dir / kLatestName) != resumed_tag) return std::nullopt;
  } catch (const Error&) {
    return std::nullopt;
  }
  std::vector<std::string> later;
  for (const auto& [step, path] : checkpoints_in(dir))
    if (step > from) later.push_back(path.filename().string());
  if (later.size() != 1) return std::nullopt;
  const fs::file_time_type resumed_at = fs::last_write_time(dir / resumed_tag / kManifestName, ec);
  if (ec) return std::nullopt;
  const fs::file_time_type later_at = fs::last_write_time(dir / later[0] / kManifestName, ec);
  if (ec || later_at < resumed_at) return std::nullopt;
  return later[0];
}

std::vector<std::pair<int64_t, fs::path>> checkpoints_in(const fs::path& dir) {
  std::vector<std::pair<int64_t, fs::path>> found;
  std::error_code ec;
  for (fs::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const int64_t step = step_of_tag(it->path().filename().string());
    if (step >= 0 && is_checkpoint_dir(it->path())) found.emplace_back(step, it->path());
  }
  return found;
}

// ---- SaveDir --------------------------------------------------------------------------------

SaveDir::SaveDir(fs::path dir, SaveDirOptions options) : dir_(std::move(dir)), options_(options) {
  if (options_.keep < 0)
    throw InvalidArgument(fmt::format("--keep must be >= 0, got {}", options_.keep));
  std::error_code ec;
  if (fs::exists(dir_, ec) && !fs::is_directory(dir_, ec))
    throw InvalidArgument(
        fmt::format("save directory {}: exists and is not a directory", dir_.string()));
  if (fs::is_symlink(fs::symlink_status(dir_, ec)) && !fs::exists(dir_, ec))
    throw InvalidArgument(
        fmt::format("save directory {}: a symbolic link to {}, which does not exist", dir_.string(),
                    fs::read_symlink(dir_, ec).string()));
  const bool existed = fs::exists(dir_, ec);
  fs::create_directories(dir_, ec);
  // A path through a file, or through a link to nowhere, is the caller's to fix.
  if (ec == std::errc::not_a_directory || ec == std::errc::file_exists)
    throw InvalidArgument(
        fmt::format("save directory {}: cannot be created: {} (a part of its "
                    "path is a file or a link to nowhere)",
                    dir_.string(), ec.message()));
  if (ec) throw IoError(dir_.string(), ec.value(), "create checkpoint directory");
  created_dir_ = !existed && options_.primary;
  if (!options_.primary) {
    check_shared_and_writable();
    return;
  }
  try {
    take_lock();
    open_entries();
  } catch (...) {
    release();
    throw;
  }
}

// A rank's checkpoint files go where rank 0 commits them: into rank 0's directory, which this
// rank must reach (a shared filesystem across nodes) and be able to write. Found now, not after
// the run's training at its first save.
void SaveDir::check_shared_and_writable() const {
  std::error_code ec;
  if (!fs::exists(dir_ / ".lock", ec))
    throw InvalidArgument(fmt::format(
        "save directory {}: rank 0's lock file .lock is not there: every rank saves into the "
        "directory rank 0 opened, which must be one directory they share (on several nodes, a "
        "shared filesystem)",
        dir_.string()));
  const fs::path probe = dir_ / fmt::format(".outcore-probe-{}", ::getpid());
  const int fd = ::open(probe.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0600);
  if (fd < 0)
    throw IoError(dir_.string(), errno,
                  "write into the save directory (every rank writes its part of each checkpoint "
                  "there)");
  ::close(fd);
  ::unlink(probe.c_str());
}

void SaveDir::take_lock() {
  for (int attempt = 0;; ++attempt) {
    try {
      // Registered for cleanup: a run ended at once (a second Ctrl-C, a failed rank) leaves
      // no lock behind (a rank asked to stop, which may still save, keeps it).
      lock_.emplace(dir_ / ".lock", "lock checkpoint directory (is another run saving into it?)",
                    kLockText, /*register_cleanup=*/true);
      return;
    } catch (const IoError& e) {
      // A run that saved nothing removed the directory it had created after this one created
      // it too (it was empty then): it is this run's to create again.
      if (e.error_number() != ENOENT || attempt == 3) throw;
      std::error_code ec;
      fs::create_directories(dir_, ec);
      if (ec) throw IoError(dir_.string(), ec.value(), "create checkpoint directory");
      created_dir_ = true;
    }
  }
}

void SaveDir::release() noexcept {
  lock_.reset();
  // A directory this run created and saved nothing into is not left behind (only the primary
  // sets created_dir_: other ranks write only into checkpoints it commits).
  if (created_dir_) {
    std::error_code ec;
    if (fs::is_empty(dir_, ec) && !ec) fs::remove(dir_, ec);
  }
}

void SaveDir::open_entries() {
  std::vector<std::pair<int64_t, std::string>> checkpoints;
  std::vector<fs::path> leftovers;
  bool has_latest = false;
  for (const fs::directory_entry& e : fs::directory_iterator(dir_)) {
    const std::string name = e.path().filename().string();
    if (name == kLatestName) {
      if (!is_latest_file(e.path())) refuse_entry(dir_, e.path(), "not a file naming a checkpoint");
      has_latest = true;
    } else if (name == std::string(kLatestName) + ".tmp") {
      if (!is_latest_file(e.path(), /*tmp=*/true))
        refuse_entry(dir_, e.path(), "not a file naming a checkpoint");
      leftovers.push_back(e.path());
    } else if (step_of_tag(name) >= 0) {
      if (!is_checkpoint_dir(e.path()))
        refuse_entry(dir_, e.path(), "not a directory holding an outcore manifest");
      checkpoints.emplace_back(step_of_tag(name), name);
    } else if ((has_suffix(name, ".tmp") || has_suffix(name, ".old")) &&
               step_of_tag(name.substr(0, name.size() - 4)) >= 0) {
      if (!is_save_leftover(e.path()))
        refuse_entry(dir_, e.path(), "not what an interrupted save leaves");
      leftovers.push_back(e.path());
    }
    // Anything else is the user's, and never touched.
  }
  // `latest` naming a checkpoint that is not there, and `<tag>.old` holding it: a save that
  // replaced it by two renames was killed between them. The checkpoint goes back in place.
  if (has_latest) {
    const std::optional<std::string> named = latest();
    const fs::path moved = dir_ / (named.value_or("") + ".old");
    const auto it = std::find(leftovers.begin(), leftovers.end(), moved);
    if (named && type_of(dir_ / *named) == fs::file_type::not_found && it != leftovers.end() &&
        is_checkpoint_dir(moved)) {
      log::warn(
          "checkpoint: {} names {}, which a save killed while replacing it left as {}: put "
          "back",
          (dir_ / kLatestName).string(), *named, moved.string());
      rename_durably(moved, dir_ / *named, dir_);
      std::error_code ec;
      fs::remove(dir_ / *named / kSaveMarkerName, ec);  // a leftover one is harmless: named as ours
      leftovers.erase(it);
      checkpoints.emplace_back(step_of_tag(*named), *named);
    }
  }
  if ((!checkpoints.empty() || has_latest) && options_.existing == ExistingCheckpoints::kRefuse) {
    std::sort(checkpoints.begin(), checkpoints.end());
    std::string names;
    for (const auto& [step, name] : checkpoints) names += (names.empty() ? "" : ", ") + name;
    const std::optional<std::string> tag = latest();
    throw InvalidArgument(fmt::format(
        "save directory {} holds another run's checkpoints ({}{}): continue that run with "
        "--resume {}, replace them with --start-over (they are removed once this run's first "
        "checkpoint is saved), or choose another save directory",
        dir_.string(), names.empty() ? std::string("none") : names,
        tag ? fmt::format("; latest {}", *tag) : std::string(), dir_.string()));
  }
  if (options_.existing == ExistingCheckpoints::kContinue && !options_.resumed_tag.empty()) {
    const int64_t from = step_of_tag(options_.resumed_tag);
    std::sort(checkpoints.begin(), checkpoints.end());
    std::vector<std::string> later_names;
    for (const auto& [step, name] : checkpoints)
      if (step > from) later_names.push_back(name);
    // The checkpoint resumed from is a --start-over's first save, killed before it removed
    // those it replaces: they go after this run's first save, as they would have then.
    std::vector<std::string> leftovers_of_start_over;
    for (const std::string& name : replaced_by(dir_ / options_.resumed_tag))
      if (std::erase(later_names, name) > 0) leftovers_of_start_over.push_back(name);
    if (!leftovers_of_start_over.empty()) {
      log::warn(
          "checkpoint: {} in {}: checkpoints of the run that {} replaced (--start-over), left "
          "by a kill before they were removed: removed once this run saves",
          fmt::join(leftovers_of_start_over, ", "), dir_.string(), options_.resumed_tag);
      replaced_.insert(replaced_.end(), leftovers_of_start_over.begin(),
                       leftovers_of_start_over.end());
    }
    const std::string later = fmt::format("{}", fmt::join(later_names, ", "));
    // A save of this same run killed before it was named latest: this run's saves replace it.
    const bool one_killed_save =
        later_names.size() == 1 && killed_save_after(dir_, options_.resumed_tag) == later_names[0];
    if (one_killed_save)
      log::warn(
          "checkpoint: {} in {} was saved after {}, which latest names (a save killed "
          "before it was named latest): this run's saves replace it",
          later, dir_.string(), options_.resumed_tag);
    else if (!later.empty())
      throw InvalidArgument(fmt::format(
          "save directory {} holds checkpoints after {}, the one this run resumes from ({}): "
          "this run's saves would replace them (another branch of this run, or another run's "
          "left by a --start-over stopped before it removed them). Continue from the newest "
          "with --resume {}, save this run elsewhere with another --save-dir, or replace them "
          "with --start-over (they are removed once this run's first checkpoint is saved)",
          dir_.string(), options_.resumed_tag, later, (dir_ / later_names.back()).string()));
  }
  if (options_.existing == ExistingCheckpoints::kReplace)
    for (const auto& [step, name] : checkpoints)
      if (name != options_.resumed_tag) replaced_.push_back(name);
  // Leftovers of an interrupted save: never valid, since a save is valid only once renamed.
  uint64_t removals = 0;
  for (const fs::path& p : leftovers) {
    log::warn("checkpoint: removing {} left by an interrupted save", p.string());
    if (type_of(p) == fs::file_type::directory) {
      remove_owned_dir(p, nullptr, removals);
    } else {
      std::error_code ec;
      fs::remove(p, ec);
      if (ec) throw IoError(p.string(), ec.value(), "remove leftover of an interrupted save");
    }
  }
}

SaveDir::~SaveDir() { release(); }

void SaveDir::clear_leftover(const fs::path& p) const {
  if (type_of(p) == fs::file_type::not_found) return;
  if (!is_save_leftover(p)) refuse_entry(dir_, p, "not what an interrupted save leaves");
  uint64_t removals = 0;
  remove_owned_dir(p, nullptr, removals);
}

std::optional<fs::path> checkpoint_holding(const fs::path& path) {
  fs::path at = resolved_path(path.string());
  if (at.empty()) return std::nullopt;
  for (;; at = at.parent_path()) {
    if (is_checkpoint_dir(at)) return at;
    if (at == at.root_path() || !at.has_relative_path()) return std::nullopt;
  }
}

bool takes_a_save_name(const fs::path& path) {
  // "dir/" and "dir/." name dir; a link before ".." is resolved as the kernel does ("link/.."
  // is the link target's parent).
  const fs::path at = resolved_path(path.string());
  if (at.empty() || !at.has_filename()) return false;
  if (!is_save_entry_name(at.filename().string())) return false;
  const fs::path dir = at.parent_path();
  return type_of(dir / kLatestName) == fs::file_type::regular || !checkpoints_in(dir).empty() ||
         holds_save_lock(dir);
}

void SaveDir::check_can_save(int64_t first, int64_t last) const {
  if (!options_.primary) return;
  std::vector<std::pair<int64_t, std::string>> found;
  for (const fs::directory_entry& e : fs::directory_iterator(dir_)) {
    const std::string name = e.path().filename().string();
    const int64_t step = step_of_tag(name);
    if (step >= first && step <= last) found.emplace_back(step, name);
  }
  std::sort(found.begin(), found.end());
  for (const auto& [step, tag] : found) {
    const std::string foreign = foreign_entry(dir_ / tag, /*manifest_files=*/true);
    if (!foreign.empty())
      throw InvalidArgument(fmt::format(
          "save directory {}: {} holds {}, which is not a checkpoint file, and this run may save "
          "step {} (steps {} to {}) over it: move that file out of the checkpoint, or choose "
          "another save directory",
          dir_.string(), tag, foreign, step, first, last));
  }
}

namespace {
// The free bytes of `dir`'s filesystem: the test hook's, else statvfs's (nullopt when unreadable).
std::optional<uint64_t> free_bytes_of(const fs::path& dir, const WriterOptions& hooks) {
  if (hooks.free_bytes) return hooks.free_bytes;
  struct statvfs sv {};
  if (::statvfs(dir.c_str(), &sv) != 0) return std::nullopt;
  return static_cast<uint64_t>(sv.f_bavail) * sv.f_frsize;
}
}  // namespace

void SaveDir::check_room(uint64_t bytes, int64_t saves, const WriterOptions& hooks) const {
  const std::optional<uint64_t> free_bytes = free_bytes_of(dir_, hooks);
  if (!free_bytes || bytes == 0) return;
  const auto mib = [](uint64_t n) { return static_cast<double>(n) / (1 << 20); };
  // The checkpoints here already (this run's, or those it replaces after its first save) take
  // their room now; with keep K the directory holds K + 1 at once, just before a save prunes.
  const auto here = static_cast<int64_t>(checkpoints_in(dir_).size());
  // Checkpoints this run adds before its pruning keeps their number level. Those here stay
  // while it continues them (kept among the newest K); another run's, replaced, go after the
  // first save.
  const bool replaced = options_.existing == ExistingCheckpoints::kReplace;
  // Replacing, the checkpoint resumed from (if here) stays, counted among the newest K.
  const int64_t resumed_here =
      replaced && !options_.resumed_tag.empty() && is_checkpoint_dir(dir_ / options_.resumed_tag)
          ? 1
          : 0;
  const int64_t keep = options_.keep;
  const int64_t added =
      keep <= 0  ? 1
      : replaced ? std::max<int64_t>(1, std::min<int64_t>(saves + resumed_here, keep + 1) - here)
                 : std::max<int64_t>(1, std::min<int64_t>(saves, keep + 1 - here));
  const uint64_t fits = *free_bytes / bytes;
  if (fits < static_cast<uint64_t>(added))
    throw OutOfMemory(fmt::format(
        "save directory {}: a checkpoint of this run takes up to {} bytes ({:.1f} MiB), and "
        "the filesystem has {} bytes ({:.1f} MiB) free{}: free some space, lower --keep or "
        "choose another --save-dir ({})",
        dir_.string(), bytes, mib(bytes), *free_bytes, mib(*free_bytes),
        added > 1 ? fmt::format(", room for {} of the {} more it holds at once (--keep {}, {} "
                                "here now)",
                                fits, added, options_.keep, here)
                  : std::string(),
        fits == 0 ? "the first save would fail after the training"
                  : fmt::format("save {} would fail", fits + 1)));
  const uint64_t room = fits + (replaced ? static_cast<uint64_t>(here - resumed_here) : 0);
  if (keep == 0 && room < static_cast<uint64_t>(saves))
    log::warn(
        "save directory {}: the filesystem has room for {} of this run's {} checkpoints of {:.1f} "
        "MiB, and every one is kept: save {} will fail unless space is freed (--keep K keeps the "
        "newest K)",
        dir_.string(), room, saves, mib(bytes), room + 1);
}

void SaveDir::remove_checkpoint(const std::string& tag, const WriterOptions& hooks,
                                uint64_t& removals) const {
  // Only a checkpoint holding nothing but a save's files: a user's file in it is never removed.
  const std::string foreign = foreign_entry(dir_ / tag, /*manifest_files=*/true);
  if (!foreign.empty())
    throw InvalidArgument(fmt::format(
        "it holds {}, which is not a checkpoint file: kept (remove it yourself when unwanted)",
        foreign));
  // Renamed first: a kill while its files go leaves `<tag>.old`, never a partial `<tag>`.
  const fs::path old = dir_ / (tag + ".old");
  clear_leftover(old);
  mark_for_removal(dir_ / tag);
  rename_durably(dir_ / tag, old, dir_);
  remove_owned_dir(old, &hooks, removals);
}

bool SaveDir::still_here() const { return !options_.primary || !lock_ || lock_->still_at_path(); }

void SaveDir::check_still_here() const {
  if (still_here()) return;
  throw Error(fmt::format(
      "save directory {}: no longer the directory this run locked (moved, removed or replaced "
      "since the run opened it): nothing saved into it or pruned there",
      dir_.string()));
}

std::optional<std::string> SaveDir::latest() const {
  const fs::path p = dir_ / kLatestName;
  if (!fs::exists(p)) return std::nullopt;
  return read_latest_tag(p);
}

void SaveDir::set_latest(const std::string& tag, const WriterOptions& hooks) {
  if (hooks.crash_at == "before-latest") crash_now("before-latest");
  check_still_here();
  const fs::path tmp = dir_ / (std::string(kLatestName) + ".tmp");
  // Only outcore's own leftover (a rename that failed) is replaced: anything else that appeared
  // there during the run, a link above all, is the user's and kept (the save fails).
  if (type_of(tmp) != fs::file_type::not_found) {
    if (!is_latest_file(tmp, /*tmp=*/true))
      refuse_entry(dir_, tmp, "not a file naming a checkpoint");
    std::error_code ec;
    fs::remove(tmp, ec);
  }
  write_file_durably(tmp, tag + "\n");
  rename_durably(tmp, dir_ / kLatestName, dir_);
  if (hooks.crash_at == "after-latest") crash_now("after-latest");
}

void SaveDir::prune(const std::string& tag, const WriterOptions& hooks) {
  if (!options_.primary) return;
  check_still_here();
  uint64_t removals = 0;
  auto remove = [&](const std::string& name, const char* why) {
    try {
      remove_checkpoint(name, hooks, removals);
    } catch (const Error& e) {
      if (std::find(kept_.begin(), kept_.end(), name) != kept_.end()) return;
      kept_.push_back(name);
      log::warn("checkpoint: cannot remove {} ({}): {}", (dir_ / name).string(), why, e.what());
    }
  };
  for (const std::string& name : replaced_) {
    if (name == tag || !is_checkpoint_dir(dir_ / name)) continue;
    log::info("checkpoint: removing {}, a checkpoint of the run this one replaces",
              (dir_ / name).string());
    remove(name, "a checkpoint of the run this one replaces");
  }
  replaced_.clear();
  if (options_.keep <= 0) return;
  const std::optional<std::string> current = latest();
  std::vector<std::pair<int64_t, std::string>> found;
  for (const fs::directory_entry& e : fs::directory_iterator(dir_)) {
    const std::string name = e.path().filename().string();
    const int64_t step = step_of_tag(name);
    if (step >= 0 && is_checkpoint_dir(e.path())) found.push_back({step, name});
  }
  std::sort(found.begin(), found.end(), [](auto& a, auto& b) { return a.first > b.first; });
  for (size_t i = static_cast<size_t>(options_.keep); i < found.size(); ++i) {
    if (current && found[i].second == *current) continue;
    remove(found[i].second, "beyond --keep");
  }
}

// ---- CheckpointWriter -----------------------------------------------------------------------

struct CheckpointWriter::Impl {
  struct DataFile {
    FileInfo info;
    std::string kind;
    aio::File file;
    uint32_t crc = 0;
    size_t next_stage = 0, next_submit = 0;
  };
  struct Slot {
    AlignedBuffer buf;
    std::optional<aio::Ticket> ticket;
    int file = -1, seg = -1;
    uint64_t bytes = 0;
  };

  Impl(SaveDir& d, const std::string& t, WriterOptions o, size_t n)
      : dir(d), tag(t), tmp(d.path() / (t + ".tmp")), options(std::move(o)), slot_count(n) {}

  void wait_slot(Slot& s) {
    if (!s.ticket) return;
    aio::Ticket t = *s.ticket;
    s.ticket.reset();
    engine->wait(t);
    written += s.bytes;
  }
  void wait_all_slots() {
    for (Slot& s : slots) wait_slot(s);
  }

  SaveDir& dir;
  std::string tag;
  fs::path tmp;
  WriterOptions options;
  size_t slot_count;
  std::chrono::steady_clock::time_point t0 = std::chrono::steady_clock::now();
  std::vector<std::pair<std::string, std::string>> texts;
  // Declared before the engine: the engine's destructor waits for writes from these buffers
  // and files, so they must outlive it.
  std::vector<DataFile> files;
  std::vector<Slot> slots;
  std::map<std::pair<int, int>, size_t> staged;  // (file, seg) -> slot
  size_t next_slot = 0;
  std::unique_ptr<aio::Engine> engine;
  uint64_t submitted = 0, written = 0;
  bool prepared = false, committed = false;
  bool created_tmp = false;  // this writer made `<tag>.tmp/` (the lead rank's)
  // What this writer made under `<tag>.tmp/`, registered for cleanup (scope kAll) until the
  // checkpoint is committed or removed (another rank's until it hands it to rank 0): a process
  // ended at once during a save (a second Ctrl-C) takes its data with it instead of leaving a
  // checkpoint's size.
  std::vector<std::string> registered;
  void track(const fs::path& p, bool directory) {
    cleanup::register_path(p.string(), directory, cleanup::Scope::kAll);
    registered.push_back(p.string());
  }
  // False when a removal of the registered files (the process ending at once) took any of them.
  bool untrack() {
    bool all = true;
    for (const std::string& p : registered) all = cleanup::unregister_path(p) && all;
    registered.clear();
    return all;
  }
  // Makes the directories from `<tag>.tmp/` down to `dir`, tracking those it made.
  void make_directories(const fs::path& dir) {
    std::vector<fs::path> missing;
    for (fs::path d = dir;
         d != tmp && d.has_relative_path() && type_of(d) == fs::file_type::not_found;
         d = d.parent_path())
      missing.push_back(d);
    for (auto it = missing.rbegin(); it != missing.rend(); ++it) {
      track(*it, /*directory=*/true);
      std::error_code ec;
      fs::create_directory(*it, ec);
      if (ec) throw IoError(it->string(), ec.value(), "create checkpoint directory");
    }
  }
};

CheckpointWriter::CheckpointWriter(SaveDir& dir, std::string tag, WriterOptions options,
                                   size_t staging_slots)
    : tag_(std::move(tag)) {
  if (tag_.empty() || tag_.find('/') != std::string::npos || tag_ == "." || tag_ == "..")
    throw InvalidArgument(fmt::format("checkpoint tag \"{}\" is not a directory name", tag_));
  if (staging_slots < 2) throw InvalidArgument("checkpoint writer: staging_slots must be >= 2");
  impl_ = std::make_unique<Impl>(dir, tag_, std::move(options), staging_slots);
}

CheckpointWriter::~CheckpointWriter() {
  if (!impl_) return;
  struct Untrack {
    Impl& m;
    ~Untrack() { m.untrack(); }
  } untrack{*impl_};
  if (impl_->committed) return;
  try {
    impl_->engine.reset();  // waits for in-flight writes before buffers and files go
  } catch (const std::exception& e) {
    log::warn("checkpoint: {}", e.what());
  }
  if (!impl_->created_tmp) return;  // `<tag>.tmp` is another writer's, or not there
  if (type_of(impl_->tmp) == fs::file_type::not_found) return;  // removed with the registered
  try {
    uint64_t removals = 0;
    remove_owned_dir(impl_->tmp, nullptr, removals);
  } catch (const std::exception& e) {
    log::warn("checkpoint: {} (the next run removes it)", e.what());
  }
}

void CheckpointWriter::add_text_file(std::string rel_path, std::string text) {
  if (impl_->prepared) throw InvalidArgument("checkpoint writer: add_text_file after prepare()");
  impl_->texts.emplace_back(std::move(rel_path), std::move(text));
}

int CheckpointWriter::add_data_file(std::string rel_path, int rank, std::string_view kind,
                                    std::vector<Segment> segments) {
  if (impl_->prepared) throw InvalidArgument("checkpoint writer: add_data_file after prepare()");
  Impl::DataFile f;
  f.info.path = std::move(rel_path);
  f.info.rank = rank;
  f.kind = kind;
  uint64_t off = kAlign;  // the header
  for (Segment& s : segments) {
    s.offset = off;
    off += align_up(s.bytes());
  }
  f.info.bytes = off;
  f.info.segments = std::move(segments);
  impl_->files.push_back(std::move(f));
  return static_cast<int>(impl_->files.size() - 1);
}

void CheckpointWriter::prepare() {
  Impl& m = *impl_;
  if (m.prepared) throw InvalidArgument("checkpoint writer: prepare() twice");
  const SaveGroup* group = m.options.group;
  const bool lead = group == nullptr || group->rank == 0;
  std::error_code ec;
  if (lead) {
    m.dir.check_still_here();
    m.dir.clear_leftover(m.tmp);
  }
  uint64_t need = 0, max_seg = 0;
  for (const auto& [p, t] : m.texts) need += t.size() + kAlign;
  for (const Impl::DataFile& f : m.files) {
    need += f.info.bytes;
    for (const Segment& s : f.info.segments) max_seg = std::max(max_seg, align_up(s.bytes()));
  }
  if (const std::optional<uint64_t> free_bytes = free_bytes_of(m.dir.path(), m.options);
      free_bytes && *free_bytes < need)
    throw IoError(m.dir.path().string(), ENOSPC,
                  fmt::format("save checkpoint {} ({} bytes needed, {} bytes free)", m.tag, need,
                              *free_bytes));
  if (lead) {
    if (!fs::create_directory(m.tmp, ec) || ec)
      throw IoError(m.tmp.string(), ec ? ec.value() : EEXIST, "create checkpoint directory");
    m.created_tmp = true;
    m.track(m.tmp, /*directory=*/true);
    // First, so that an interrupted save is recognisable as outcore's by its content. Never
    // removed with the registered files: other ranks' files may still be in `<tag>.tmp`, which
    // the next open removes only while it holds the marker.
    write_marker(m.tmp);
  }
  if (group != nullptr) group->barrier();  // <tag>.tmp exists, fresh, before any rank writes
  m.engine = std::make_unique<aio::Engine>(m.options.aio, m.options.backend);
  AlignedBuffer header(kAlign);
  for (Impl::DataFile& f : m.files) {
    const fs::path p = m.tmp / f.info.path;
    m.make_directories(p.parent_path());
    m.track(p, /*directory=*/false);
    f.file = aio::File::open(p, {.access = aio::Access::kWrite,
                                 .create = true,
                                 .truncate = true,
                                 .exclusive = true,
                                 .direct = true});
    f.file.preallocate(f.info.bytes);
    std::memset(header.data(), 0, kAlign);
    std::memcpy(header.data(), kDataFileMagic, 8);
    const uint32_t version = kFormatVersion;
    const int32_t rank = f.info.rank;
    std::memcpy(header.data() + kHeaderVersionAt, &version, 4);
    std::memcpy(header.data() + kHeaderRankAt, &rank, 4);
    std::memcpy(header.data() + kHeaderKindAt, f.kind.data(),
                std::min(f.kind.size(), kHeaderKindMax));
    std::memcpy(header.data() + kHeaderTagAt, m.tag.data(), std::min(m.tag.size(), kHeaderTagMax));
    m.engine->write(f.file, 0, {header.data(), kAlign});
    f.crc = crc32c({header.data(), kAlign});
  }
  log::debug("checkpoint {}: prepared {} data files ({} bytes) in {:.3f} s", m.tag, m.files.size(),
             need, std::chrono::duration<double>(std::chrono::steady_clock::now() - m.t0).count());
  m.slots.resize(m.slot_count);
  for (Impl::Slot& s : m.slots) s.buf = AlignedBuffer(std::max<uint64_t>(max_seg, kAlign));
  m.prepared = true;
}

std::span<std::byte> CheckpointWriter::stage(int file, int seg) {
  Impl& m = *impl_;
  if (!m.prepared) throw InvalidArgument("checkpoint writer: stage() before prepare()");
  Impl::DataFile& f = m.files.at(static_cast<size_t>(file));
  if (static_cast<size_t>(seg) != f.next_stage ||
      static_cast<size_t>(seg) >= f.info.segments.size())
    throw InvalidArgument(
        fmt::format("checkpoint writer: {}: segment {} staged out of order "
                    "(next is {})",
                    f.info.path, seg, f.next_stage));
  const size_t si = m.next_slot++ % m.slots.size();
  Impl::Slot& s = m.slots[si];
  m.wait_slot(s);
  if (s.file >= 0 && m.staged.count({s.file, s.seg}))
    throw InvalidArgument("checkpoint writer: more segments staged than staging slots");
  const Segment& sg = f.info.segments[static_cast<size_t>(seg)];
  const uint64_t bytes = sg.bytes();
  std::memset(s.buf.data() + bytes, 0, align_up(bytes) - bytes);
  s.file = file;
  s.seg = seg;
  s.bytes = align_up(bytes);
  m.staged[{file, seg}] = si;
  ++f.next_stage;
  return {s.buf.data(), bytes};
}

void CheckpointWriter::submit(int file, int seg) {
  Impl& m = *impl_;
  auto it = m.staged.find({file, seg});
  Impl::DataFile& f = m.files.at(static_cast<size_t>(file));
  if (it == m.staged.end() || static_cast<size_t>(seg) != f.next_submit)
    throw InvalidArgument(
        fmt::format("checkpoint writer: {}: segment {} submitted out of order", f.info.path, seg));
  Impl::Slot& s = m.slots[it->second];
  m.staged.erase(it);
  const Segment& sg = f.info.segments[static_cast<size_t>(seg)];
  std::span<const std::byte> data{s.buf.data(), s.bytes};
  f.crc = crc32c(data, f.crc);
  s.ticket = m.engine->submit_write(f.file, sg.offset, data);
  ++f.next_submit;
  m.submitted += s.bytes;
  if (m.options.crash_after_bytes != 0 && m.submitted >= m.options.crash_after_bytes) {
    m.wait_all_slots();
    crash_now("after bytes");
  }
}

SaveResult CheckpointWriter::commit(Manifest manifest) {
  Impl& m = *impl_;
  if (!m.prepared) prepare();
  if (!m.staged.empty())
    throw InvalidArgument("checkpoint writer: commit() with staged segments not submitted");
  m.wait_all_slots();
  const auto tw = std::chrono::steady_clock::now();
  log::debug("checkpoint {}: data written after {:.3f} s", m.tag,
             std::chrono::duration<double>(tw - m.t0).count());
  manifest.tag = m.tag;
  manifest.files.clear();
  manifest.replaces.clear();
  for (const std::string& name : m.dir.replacing())
    if (name != m.tag) manifest.replaces.push_back(name);
  std::sort(
      manifest.replaces.begin(), manifest.replaces.end(),
      [](const std::string& a, const std::string& b) { return step_of_tag(a) < step_of_tag(b); });
  const SaveGroup* group = m.options.group;
  const bool lead = group == nullptr || group->rank == 0;
  uint64_t total = 0;
  for (const auto& [rel, text] : m.texts) {
    m.make_directories((m.tmp / rel).parent_path());
    m.track(m.tmp / rel, /*directory=*/false);
    write_file_durably(m.tmp / rel, text);
    FileInfo fi;
    fi.path = rel;
    fi.bytes = text.size();
    fi.crc32c = crc32c(std::as_bytes(std::span(text.data(), text.size())));
    total += fi.bytes;
    manifest.files.push_back(std::move(fi));
  }
  for (Impl::DataFile& f : m.files) {
    if (f.next_submit != f.info.segments.size())
      throw InvalidArgument(fmt::format("checkpoint writer: {}: {} of {} segments written",
                                        f.info.path, f.next_submit, f.info.segments.size()));
    f.file.fdatasync();
    f.file.close();
    f.info.crc32c = f.crc;
    total += f.info.bytes;
    manifest.files.push_back(f.info);
  }
  log::debug("checkpoint {}: data files synced after {:.3f} s", m.tag,
             std::chrono::duration<double>(std::chrono::steady_clock::now() - m.t0).count());
  const fs::path final_dir = m.dir.path() / m.tag;
  if (group != nullptr) {
    // Every rank's data files into rank 0's manifest, then rank 0 commits while the others
    // wait for it: a checkpoint exists for all ranks or for none. From here rank 0 owns
    // `<tag>.tmp`: another rank ending at once must not remove its part of what rank 0 commits.
    if (!lead) m.untrack();
    const std::vector<std::string> all = group->all_gather(manifest.to_json().dump());
    if (!lead) {
      group->barrier();
      m.committed = true;
      SaveResult r;
      r.tag = m.tag;
      r.path = final_dir;
      r.bytes = total;
      r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - m.t0).count();
      r.write_seconds = std::chrono::duration<double>(tw - m.t0).count();
      return r;
    }
    manifest.files.clear();
    for (const auto& [rel, text] : m.texts) {
      FileInfo fi;
      fi.path = rel;
      fi.bytes = text.size();
      fi.crc32c = crc32c(std::as_bytes(std::span(text.data(), text.size())));
      manifest.files.push_back(std::move(fi));
    }
    for (size_t r = 0; r < all.size(); ++r) {
      const std::string source = fmt::format("rank {}'s files of checkpoint {}", r, m.tag);
      const Manifest theirs = Manifest::from_json(nlohmann::json::parse(all[r]), source);
      for (const FileInfo& f : theirs.files) {
        if (f.rank < 0) continue;  // text files: rank 0's, added above
        if (r != 0) total += f.bytes;
        manifest.files.push_back(f);
      }
    }
  }
  const std::string text = manifest_text(manifest);
  m.track(m.tmp / kManifestName, /*directory=*/false);
  write_file_durably(m.tmp / kManifestName, text);
  total += text.size();
  // Directories: every subdirectory, then the checkpoint directory itself.
  for (const fs::directory_entry& e : fs::recursive_directory_iterator(m.tmp))
    if (e.is_directory()) fsync_directory(e.path());
  fsync_directory(m.tmp);
  // Read back what every rank wrote: "saved" means loadable, not only written.
  if (m.options.verify)
    Checkpoint::open(m.tmp,
                     {.aio = m.options.aio, .backend = m.options.backend, .unfinished_save = true})
        .verify();
  if (m.options.crash_at == "before-rename") crash_now("before-rename");
  if (lead) m.dir.check_still_here();

  // From here `<tag>.tmp` is renamed or exchanged: a removal by its old names could take the
  // checkpoint's files or the replaced one's; a kill leaves it to the next open. A removal that
  // ran before (the process is ending at once) has taken files of it: nothing is put in place.
  if (m.options.crash_at == "removal-before-rename")
    cleanup::remove_registered_files();  // what a second Ctrl-C's watcher does meanwhile
  if (!m.untrack())
    throw Interrupted(fmt::format("checkpoint {}: not committed, the process is ending", m.tag));
  // Where a checkpoint of this tag is in place (a run that saves the same step again), it is
  // replaced in one step (the two directories exchanged), so that `latest` never names a missing
  // directory; where the filesystem cannot exchange, by two renames, the old one to `<tag>.old`
  // first (a kill between them is repaired by the next SaveDir: it puts `<tag>.old` back).
  fs::path replaced = m.dir.path() / (m.tag + ".old");
  std::error_code ec;
  if (fs::symlink_status(final_dir, ec).type() != fs::file_type::not_found) {
    if (!is_checkpoint_dir(final_dir))
      refuse_entry(m.dir.path(), final_dir, "not a directory holding an outcore manifest");
    const std::string foreign = foreign_entry(final_dir, /*manifest_files=*/true);
    if (!foreign.empty())
      refuse_entry(m.dir.path(), final_dir,
                   fmt::format("a checkpoint holding {}, which a save does not write", foreign));
    m.dir.clear_leftover(replaced);
    mark_for_removal(final_dir);
    if (m.options.crash_at != "between-renames" && exchange_entries(m.tmp, final_dir)) {
      replaced = m.tmp;  // the old checkpoint, marked: a leftover there if this process dies
      m.committed = true;
      fsync_directory(m.dir.path());
      if (m.options.crash_at == "after-exchange") crash_now("after-exchange");
    } else {
      rename_durably(final_dir, replaced, m.dir.path());
      if (m.options.crash_at == "between-renames") crash_now("between-renames");
      rename_durably(m.tmp, final_dir, m.dir.path());
    }
  } else {
    rename_durably(m.tmp, final_dir, m.dir.path());
  }
  m.committed = true;
  // In place and committed: the marker goes (one left, by a kill or a failure here, names this
  // directory only, so a user's copy of it is still no leftover).
  std::error_code ec_marker;
  fs::remove(final_dir / kSaveMarkerName, ec_marker);
  if (ec_marker)
    log::warn("checkpoint: cannot remove {}: {}", (final_dir / kSaveMarkerName).string(),
              ec_marker.message());
  else
    try {
      fsync_directory(final_dir);
    } catch (const Error& e) {
      log::warn("checkpoint: {}", e.what());
    }
  if (fs::symlink_status(replaced, ec).type() != fs::file_type::not_found) {
    uint64_t removals = 0;
    remove_owned_dir(replaced, &m.options, removals);
  }
  m.dir.set_latest(m.tag, m.options);
  m.dir.prune(m.tag, m.options);
  if (group != nullptr) group->barrier();  // the other ranks return once it is committed

  SaveResult r;
  r.tag = m.tag;
  r.path = final_dir;
  r.bytes = total;
  const auto now = std::chrono::steady_clock::now();
  r.seconds = std::chrono::duration<double>(now - m.t0).count();
  r.write_seconds = std::chrono::duration<double>(tw - m.t0).count();
  return r;
}

}  // namespace outcore::ckpt
