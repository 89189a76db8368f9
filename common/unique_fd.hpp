// UniqueFd: owns one file descriptor and closes it when it goes. The error of that close is
// lost; where it matters (a file just written), call close() and check it.
#pragma once

#include <unistd.h>

#include <utility>

namespace outcore {

class UniqueFd {
 public:
  UniqueFd() = default;
  explicit UniqueFd(int fd) : fd_(fd) {}
  ~UniqueFd() { reset(); }
  UniqueFd(UniqueFd&& other) noexcept : fd_(other.release()) {}
  UniqueFd& operator=(UniqueFd&& other) noexcept {
    if (this != &other) reset(other.release());
    return *this;
  }
  UniqueFd(const UniqueFd&) = delete;
  UniqueFd& operator=(const UniqueFd&) = delete;

  // The descriptor; -1 when none.
  int get() const { return fd_; }
  // Gives the descriptor up to the caller, who closes it.
  int release() { return std::exchange(fd_, -1); }
  // Closes the descriptor held (if any) and holds `fd` instead.
  void reset(int fd = -1) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = fd;
  }
  // Closes now and returns close(2)'s result (errno set on -1); the descriptor is gone either
  // way. -1 with EBADF when none is held.
  int close() { return ::close(release()); }

 private:
  int fd_ = -1;
};

}  // namespace outcore
