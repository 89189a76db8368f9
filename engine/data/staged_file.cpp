#include "engine/data/staged_file.hpp"

#include <fcntl.h>
#include <fmt/format.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include "common/cleanup.hpp"
#include "common/error.hpp"
#include "common/open_file.hpp"

namespace outcore::data {
namespace {

constexpr size_t kBufferBytes = size_t{4} << 20;

}  // namespace

StagedFile::StagedFile(std::string target) : target_(std::move(target)) {
  for (int k = 0; fd_ < 0; ++k) {
    temporary_ =
        fmt::format("{}.tmp-{}{}", target_, ::getpid(), k == 0 ? "" : fmt::format("-{}", k));
    fd_ = ::open(temporary_.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd_ < 0 && (errno != EEXIST || k == 100))
      throw IoError(temporary_, errno, "create output file");
  }
  // Removed by a process ended at once (a second Ctrl-C) too.
  cleanup::register_path(temporary_, false, cleanup::Scope::kAll);
  buffer_.reserve(kBufferBytes);
}

StagedFile::~StagedFile() {
  if (fd_ >= 0) ::close(fd_);
  if (committed_) return;
  cleanup::unregister_path(temporary_);
  ::unlink(temporary_.c_str());
}

void StagedFile::append(const void* data, size_t bytes) {
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    const size_t n = std::min(bytes, kBufferBytes - buffer_.size());
    buffer_.insert(buffer_.end(), p, p + n);
    p += n;
    bytes -= n;
    if (buffer_.size() == kBufferBytes) flush();
  }
}

void StagedFile::flush() {
  size_t done = 0;
  while (done < buffer_.size()) {
    const ssize_t n = ::write(fd_, buffer_.data() + done, buffer_.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) throw IoError(temporary_, written_ + done, buffer_.size() - done, errno, "write");
    if (n == 0) throw IoError(temporary_, written_ + done, buffer_.size() - done, EIO, "write");
    done += static_cast<size_t>(n);
  }
  written_ += done;
  buffer_.clear();
}

void StagedFile::write_at(uint64_t offset, const void* data, size_t bytes) {
  flush();
  size_t done = 0;
  while (done < bytes) {
    const ssize_t n = ::pwrite(fd_, static_cast<const char*>(data) + done, bytes - done,
                               static_cast<off_t>(offset + done));
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0)
      throw IoError(temporary_, offset + done, bytes - done, n < 0 ? errno : EIO, "write");
    done += static_cast<size_t>(n);
  }
}

void StagedFile::finish() {
  flush();
  if (::fsync(fd_) != 0) throw IoError(temporary_, errno, "fsync");
  const int fd = fd_;
  fd_ = -1;
  if (::close(fd) != 0) throw IoError(temporary_, errno, "close");
}

void StagedFile::commit() {
  cleanup::unregister_path(temporary_);  // a cleanup from here on never removes the target
  if (::rename(temporary_.c_str(), target_.c_str()) != 0)
    throw IoError(target_, errno, fmt::format("rename {} into place", temporary_));
  committed_ = true;
  fsync_parent_directory(target_);
}

}  // namespace outcore::data
