// Helpers shared by the aio tests: a unique temporary directory in the build tree, random
// data, a checksum, an open-descriptor count for leak checks, and whether the
// kernel lets this process create an io_uring.
#pragma once

#include <dirent.h>
#include <gtest/gtest.h>
#include <linux/io_uring.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cerrno>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <span>
#include <sstream>
#include <string>

#include "aio/aio.hpp"
#include "tests/common/log_capture.hpp"
#include "tests/common/temp_dir.hpp"

namespace outcore::aio::test {

// A scratch directory named after the test, removed on destruction.
class TempDir : public outcore::test::TempDir {
 public:
  TempDir() : outcore::test::TempDir("aio") {}
};

using outcore::test::fill_random;

// FNV-1a, 64 bit.
inline uint64_t checksum(std::span<const std::byte> s) {
  uint64_t h = 1469598103934665603ull;
  for (std::byte b : s) {
    h ^= static_cast<uint8_t>(b);
    h *= 1099511628211ull;
  }
  return h;
}

inline int open_fd_count() {
  int n = 0;
  for (auto& e : std::filesystem::directory_iterator("/proc/self/fd")) {
    (void)e;
    ++n;
  }
  return n;
}

using outcore::test::LogCapture;

// 0 if the raw io_uring_setup system call creates a ring here, else its errno. Independent of
// liburing and of aio's own probe, so tests can check the probe against it.
inline int io_uring_setup_errno() {
  io_uring_params p{};
  long fd = ::syscall(__NR_io_uring_setup, 1u, &p);
  if (fd < 0) return errno;
  ::close(static_cast<int>(fd));
  return 0;
}

}  // namespace outcore::aio::test

namespace outcore::aio {

// Read and write, the file created where missing: how most tests open the files they write.
inline constexpr OpenOptions kCreateRw{.access = Access::kReadWrite, .create = true};

}  // namespace outcore::aio
