#include "common/lock_file.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <utility>

#include "common/cleanup.hpp"
#include "common/error.hpp"
#include "common/open_file.hpp"
#include "common/unique_fd.hpp"

namespace outcore {
namespace {

std::function<void()>& lock_open_hook() {
  static std::function<void()> hook;
  return hook;
}

bool write_all(int fd, std::string_view text) {
  size_t done = 0;
  while (done < text.size()) {
    const ssize_t n = ::write(fd, text.data() + done, text.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) return false;
    done += static_cast<size_t>(n);
  }
  return true;
}

// Whether the open file `fd` is outcore's: empty, or holding exactly `marker`.
bool holds_marker_or_nothing(int fd, std::string_view marker) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) return false;
  if (st.st_size == 0) return true;
  if (static_cast<size_t>(st.st_size) != marker.size()) return false;
  std::string text(marker.size(), '\0');
  return ::pread(fd, text.data(), text.size(), 0) == static_cast<ssize_t>(text.size()) &&
         text == marker;
}

}  // namespace

bool LockFile::still_at_path() const {
  if (fd_ < 0) return false;
  struct stat held {};
  struct stat at {};
  return ::fstat(fd_, &held) == 0 && ::stat(path_.c_str(), &at) == 0 && held.st_dev == at.st_dev &&
         held.st_ino == at.st_ino;
}

OutputLock::OutputLock(const std::string& path, const std::string& what)
    : path_(resolve_links(path)) {
  const int flags = O_RDONLY | O_CLOEXEC | O_NONBLOCK;
  fd_ = ::open(path_.c_str(), flags | O_CREAT | O_EXCL, 0644);
  created_ = fd_ >= 0;
  if (fd_ < 0 && errno == EEXIST) fd_ = ::open(path_.c_str(), flags);
  if (fd_ < 0) throw IoError(path, errno, "open " + what);
  struct stat st {};
  if (::fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode)) {  // the writer's own check names it
    ::close(fd_);
    fd_ = -1;
    return;
  }
  if (::flock(fd_, LOCK_EX | LOCK_NB) != 0) {
    const int e = errno;
    release();
    if (e == EWOULDBLOCK)
      throw PathBusy(path, fmt::format("lock {} (another run writes it at its end: give each run "
                                       "its own file)",
                                       what));
    throw IoError(path, e, "lock " + what);
  }
}

void OutputLock::release() noexcept {
  if (fd_ < 0) return;
  struct stat st {};
  FileId id;
  if (created_ && ::fstat(fd_, &st) == 0 && st.st_size == 0 && file_id_of(fd_, id))
    (void)unlink_if_same(path_, id);
  ::close(fd_);
  fd_ = -1;
}

namespace internal {
void set_lock_open_hook(std::function<void()> hook) { lock_open_hook() = std::move(hook); }
}  // namespace internal

LockFile::LockFile(std::filesystem::path path, std::string busy, std::string_view marker,
                   bool register_cleanup)
    : path_(std::move(path)) {
  for (int attempt = 0;; ++attempt) {
    if (attempt == 100)
      throw PathBusy(path_.string(), busy + " (its lock file keeps being replaced)");
    bool created = true;
    // Closes the descriptor of an attempt that does not end holding the lock, whatever throws.
    UniqueFd f(::open(path_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600));
    if (f.get() < 0 && errno == EEXIST) {
      created = false;
      // Read only: an existing lock file is never written (a user's may be read-only).
      f.reset(::open(path_.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK));
      if (f.get() < 0 && errno == ENOENT) continue;  // unlinked by its holder since: try again
    }
    if (f.get() < 0) throw IoError(path_.string(), errno, "open lock file");
    if (auto hook = std::exchange(lock_open_hook(), nullptr)) hook();
    if (::flock(f.get(), LOCK_EX | LOCK_NB) != 0) {
      if (errno == EWOULDBLOCK) throw PathBusy(path_.string(), busy);
      throw IoError(path_.string(), errno, "lock " + path_.string());
    }
    struct stat held {
    }, named{};
    if (::fstat(f.get(), &held) != 0 || ::lstat(path_.c_str(), &named) != 0 ||
        held.st_dev != named.st_dev || held.st_ino != named.st_ino)
      continue;  // locked a file its holder had already unlinked
    // A file this created is written only now, under the lock: a process that opened it before
    // finds it empty, which is outcore's too (as is one whose marker could not be written).
    bool owned = marker.empty() || created;
    if (created && !marker.empty() && !write_all(f.get(), marker)) (void)::ftruncate(f.get(), 0);
    if (!owned) owned = S_ISREG(held.st_mode) && holds_marker_or_nothing(f.get(), marker);
    // Removed only by a process ending at once: one still working keeps its lock.
    if (register_cleanup && owned)
      cleanup::register_path(path_.string(), false, cleanup::Scope::kAll);
    fd_ = f.release();
    owned_ = owned;
    registered_ = register_cleanup && owned;
    return;
  }
}

void LockFile::release() noexcept {
  if (fd_ < 0) return;
  // Forgotten by the cleanup registry first: a cleanup running in between leaves the file to the
  // unlink below, and never unlinks a lock that another run created here after it.
  if (registered_) cleanup::unregister_path(path_.string());
  // While still holding it (see the class comment), and only while the path names it: a file
  // there since (its directory moved away, another run's made in its place) is not this one's.
  if (owned_ && still_at_path()) ::unlink(path_.c_str());
  ::close(fd_);
  fd_ = -1;
}

}  // namespace outcore
