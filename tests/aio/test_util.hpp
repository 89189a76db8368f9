// Helpers shared by the aio tests: a unique temporary directory in the build tree, random
// data, a checksum, and an open-descriptor count for leak checks.
#pragma once

#include <dirent.h>
#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <random>
#include <span>
#include <string>

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

}  // namespace outcore::aio::test
