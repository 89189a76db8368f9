#include "common/lock_file.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <utility>

#include "common/cleanup.hpp"
#include "common/error.hpp"

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

namespace internal {
void set_lock_open_hook(std::function<void()> hook) { lock_open_hook() = std::move(hook); }
}  // namespace internal

LockFile::LockFile(std::filesystem::path path, std::string busy, std::string_view marker,
                   bool register_cleanup)
    : path_(std::move(path)) {
  for (int attempt = 0;; ++attempt) {
    if (attempt == 100)
      throw IoError(path_.string(), EWOULDBLOCK, busy + " (its lock file keeps being replaced)");
    bool created = true;
    int fd = ::open(path_.c_str(), O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
    if (fd < 0 && errno == EEXIST) {
      created = false;
      fd = ::open(path_.c_str(), O_RDWR | O_CLOEXEC | O_NOFOLLOW | O_NONBLOCK);
      if (fd < 0 && errno == ENOENT) continue;  // unlinked by its holder since: try again
    }
    if (fd < 0) throw IoError(path_.string(), errno, "open lock file");
    if (auto hook = std::exchange(lock_open_hook(), nullptr)) hook();
    if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
      const int err = errno;
      ::close(fd);
      throw IoError(path_.string(), err, busy);
    }
    struct stat held {
    }, named{};
    if (::fstat(fd, &held) != 0 || ::lstat(path_.c_str(), &named) != 0 ||
        held.st_dev != named.st_dev || held.st_ino != named.st_ino) {
      ::close(fd);  // locked a file its holder had already unlinked
      continue;
    }
    fd_ = fd;
    // A file this created is written only now, under the lock: a process that opened it
    // before finds it empty, which is outcore's too.
    owned_ =
        marker.empty() || (created && write_all(fd, marker)) || holds_marker_or_nothing(fd, marker);
    if (register_cleanup && owned_) {
      cleanup::register_path(path_.string());
      registered_ = true;
    }
    return;
  }
}

void LockFile::release() noexcept {
  if (fd_ < 0) return;
  if (owned_) ::unlink(path_.c_str());  // while still holding it: see the class comment
  if (registered_) cleanup::unregister_path(path_.string());
  ::close(fd_);
  fd_ = -1;
}

}  // namespace outcore
