// LockFile: an exclusive flock(2) on a lock file, held for the object's lifetime, so that one
// process at a time uses what the file guards (a swap directory, a save directory).
//
// Release unlinks the file while still holding it, then closes it: a lock file does not outlive
// its holder. A process that opened the file just before it was unlinked, and then wins its
// flock, finds that the path no longer names the inode it locked and retries on the new file, so
// two holders never coexist.
//
// Ownership (with a marker): a file this creates holds the marker (or nothing, where it could not
// be written); an existing file at the path is outcore's when it is a regular file holding the
// marker or nothing (a holder killed before writing it, or a lock file of an earlier version);
// anything else there is someone else's: it is opened read-only and locked, never written,
// truncated or unlinked. Without a marker every file at the path is outcore's.
//
// Errors: PathBusy(path, `busy`) (an IoError of EWOULDBLOCK) when another holder has it; IoError
// naming the path for every other failure (ENOENT when the directory is gone). Thread-compatible.
#pragma once

#include <filesystem>
#include <functional>
#include <string>
#include <string_view>

namespace outcore {

class LockFile {
 public:
  // `path`: the lock file (created, mode 0600, never through a symbolic link). `busy`: the
  // operation named in the error when another holder has it. `register_cleanup`: unlinked by
  // cleanup::remove_registered_files(Scope::kAll) too, should the process end at once while
  // holding it.
  LockFile(std::filesystem::path path, std::string busy, std::string_view marker = {},
           bool register_cleanup = false);
  ~LockFile() { release(); }
  LockFile(const LockFile&) = delete;
  LockFile& operator=(const LockFile&) = delete;

  const std::filesystem::path& path() const { return path_; }
  // Whether release() unlinks the file (see Ownership).
  bool owned() const { return owned_; }
  // Unlinks the file if it is outcore's and still at path(), while holding it, then closes it.
  // Idempotent.
  void release() noexcept;
  // Whether path() still names the file this holds: false once it (or a directory above it)
  // was moved, removed or replaced since, so that what the lock guards is no longer at the
  // path (a save directory renamed under its run). False after release().
  bool still_at_path() const;

 private:
  std::filesystem::path path_;
  int fd_ = -1;
  bool owned_ = false;
  bool registered_ = false;
};

// OutputLock: an exclusive flock(2) on an output file itself, for a run that writes the file
// at its end through a temporary and a rename (a trace): a second run naming the same file is
// refused while the first holds it. `path`'s links are followed. A missing file is created empty
// (and unlinked again by release() while it is still empty and at its path: a run that never
// wrote it leaves nothing); an existing one is only opened, never written or truncated here. A
// FIFO or device is neither opened for long nor locked.
//
// `what` names the file in errors ("trace file"): PathBusy naming the path when another holder
// has it; IoError naming the path otherwise.
class OutputLock {
 public:
  OutputLock(const std::string& path, const std::string& what);
  ~OutputLock() { release(); }
  OutputLock(const OutputLock&) = delete;
  OutputLock& operator=(const OutputLock&) = delete;

  void release() noexcept;

 private:
  std::string path_;
  int fd_ = -1;
  bool created_ = false;
};

namespace internal {
// Called once by the next LockFile, after it has opened its file and before it flocks it (then
// cleared): a seam for tests to reproduce the race of a release between the two. Not
// thread-safe.
void set_lock_open_hook(std::function<void()> hook);
}  // namespace internal

}  // namespace outcore
