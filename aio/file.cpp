// aio::File: open (O_DIRECT with a buffered fallback), size, preallocate, sync, close.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <mutex>
#include <set>
#include <utility>

#include "aio/aio.hpp"
#include "aio/file_internal.hpp"
#include "common/log.hpp"
#include "common/open_file.hpp"

namespace outcore::aio {
namespace {

int real_open(const char* path, int flags, mode_t mode) { return ::open(path, flags, mode); }

int real_fallocate(int fd, int mode, off_t offset, off_t len) {
  return ::fallocate(fd, mode, offset, len);
}

std::atomic<internal::OpenFunction> g_open{&real_open};
std::atomic<internal::FallocateFunction> g_fallocate{&real_fallocate};
std::atomic<uint64_t> g_next_serial{1};

std::mutex g_warned_mu;
std::set<dev_t>& warned_devices() {
  static std::set<dev_t> devices;
  return devices;
}

// One warning per filesystem (device) per process.
void warn_fallback_once(int fd, const std::string& path) {
  struct stat st {};
  dev_t dev = ::fstat(fd, &st) == 0 ? st.st_dev : 0;
  std::lock_guard lock(g_warned_mu);
  if (!warned_devices().insert(dev).second) return;
  log::warn("{}: the filesystem refuses O_DIRECT; using buffered I/O for files on it", path);
}

int access_flags(Access a) {
  switch (a) {
    case Access::kRead:
      return O_RDONLY;
    case Access::kWrite:
      return O_WRONLY;
    case Access::kReadWrite:
      return O_RDWR;
  }
  return O_RDONLY;
}

int open_retrying(const char* path, int flags, unsigned mode) {
  int fd;
  do {
    fd = g_open.load()(path, flags, static_cast<mode_t>(mode));
  } while (fd < 0 && errno == EINTR);
  return fd;
}

}  // namespace

namespace internal {
OpenFunction set_open_function_for_testing(OpenFunction fn) {
  return g_open.exchange(fn == nullptr ? &real_open : fn);
}
FallocateFunction set_fallocate_function_for_testing(FallocateFunction fn) {
  return g_fallocate.exchange(fn == nullptr ? &real_fallocate : fn);
}
void reset_fallback_warnings_for_testing() {
  std::lock_guard lock(g_warned_mu);
  warned_devices().clear();
}
}  // namespace internal

File::File(int fd, bool direct, std::shared_ptr<const std::string> path)
    : fd_(fd), direct_(direct), serial_(g_next_serial.fetch_add(1)), path_(std::move(path)) {}

namespace {

// Opened with O_NONBLOCK so that a FIFO does not wait for a peer: anything but a regular file
// or a block device (or, written only, a character device such as /dev/full) is refused here
// (closing `fd`), then the descriptor blocks again.
int checked_type(int fd, const std::string& path, Access access) {
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    const int err = errno;
    ::close(fd);
    throw IoError(path, err, "fstat");
  }
  const bool write_only_device = access == Access::kWrite && S_ISCHR(st.st_mode);
  if (!S_ISREG(st.st_mode) && !S_ISBLK(st.st_mode) && !write_only_device) {
    ::close(fd);
    throw InvalidArgument(path + ": is " + file_kind(st.st_mode) + ", not a regular file");
  }
  const int flags = ::fcntl(fd, F_GETFL);
  if (flags < 0 || ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0) {
    const int err = errno;
    ::close(fd);
    throw IoError(path, err, "fcntl");
  }
  return fd;
}

}  // namespace

namespace {
// An open that failed with ENXIO (a FIFO opened for writing without a reader, a device without
// its driver): refused naming what is there when it is a FIFO, as a read's open is.
[[noreturn]] void throw_open_error(const std::string& path, int err) {
  struct stat st {};
  if (err == ENXIO && ::stat(path.c_str(), &st) == 0 && S_ISFIFO(st.st_mode))
    throw InvalidArgument(path + ": is " + file_kind(st.st_mode) + ", not a regular file");
  throw IoError(path, err, "open");
}
}  // namespace

File File::open(const std::filesystem::path& path, const OpenOptions& opts) {
  auto shared = std::make_shared<const std::string>(path.string());
  int flags = access_flags(opts.access) | O_CLOEXEC | O_NOCTTY | O_NONBLOCK;
  if (opts.create) flags |= O_CREAT;
  if (opts.truncate) flags |= O_TRUNC;
  if (opts.exclusive) flags |= O_EXCL;
  if (opts.direct) {
    int fd = open_retrying(shared->c_str(), flags | O_DIRECT, opts.mode);
    if (fd >= 0) {
      // Checked before `shared` moves into the File (argument order is unspecified).
      checked_type(fd, *shared, opts.access);
      return File(fd, true, std::move(shared));
    }
    if (errno != EINVAL) throw_open_error(*shared, errno);
  }
  int fd = open_retrying(shared->c_str(), flags, opts.mode);
  if (fd < 0) throw_open_error(*shared, errno);
  checked_type(fd, *shared, opts.access);
  if (opts.direct) warn_fallback_once(fd, *shared);
  return File(fd, false, std::move(shared));
}

File::File(File&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)),
      direct_(other.direct_),
      serial_(std::exchange(other.serial_, 0)),
      path_(std::move(other.path_)) {}

File& File::operator=(File&& other) noexcept {
  if (this != &other) {
    reset();
    fd_ = std::exchange(other.fd_, -1);
    direct_ = other.direct_;
    serial_ = std::exchange(other.serial_, 0);
    path_ = std::move(other.path_);
  }
  return *this;
}

File::~File() { reset(); }

void File::reset() noexcept {
  if (fd_ < 0) return;
  if (::close(std::exchange(fd_, -1)) != 0) {
    log::warn("close failed on {}: {}", path(), errno_string(errno));
  }
}

const std::string& File::path() const {
  static const std::string kNotOpen = "(file not open)";
  return path_ ? *path_ : kNotOpen;
}

uint64_t File::size() const {
  struct stat st {};
  if (::fstat(fd_, &st) != 0) throw IoError(path(), errno, "fstat");
  return static_cast<uint64_t>(st.st_size);
}

void File::preallocate(uint64_t bytes) {
  if (bytes == 0) return;
  int rc;
  do {
    rc = g_fallocate.load()(fd_, 0, 0, static_cast<off_t>(bytes));
  } while (rc != 0 && errno == EINTR);
  if (rc == 0) return;
  if (errno != EOPNOTSUPP) throw IoError(path(), 0, bytes, errno, "fallocate");
  log::warn(
      "{}: fallocate is not supported by the filesystem; the size is set without "
      "reserving space, so a full disk shows up only when writing",
      path());
  if (size() < bytes) truncate(bytes);
}

void File::truncate(uint64_t bytes) {
  if (::ftruncate(fd_, static_cast<off_t>(bytes)) != 0) {
    throw IoError(path(), 0, bytes, errno, "ftruncate");
  }
}

void File::fdatasync() {
  if (::fdatasync(fd_) != 0) throw IoError(path(), errno, "fdatasync");
}

void File::fsync() {
  if (::fsync(fd_) != 0) throw IoError(path(), errno, "fsync");
}

void File::close() {
  if (fd_ < 0) return;
  // The descriptor is released even when close reports an error (Linux semantics).
  if (::close(std::exchange(fd_, -1)) != 0) throw IoError(path(), errno, "close");
}

}  // namespace outcore::aio
