// Helpers shared by the swap tests: a unique directory in the build tree for swap files,
// random data, and a byte flipper for corruption tests.
#pragma once

#include <fcntl.h>
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

namespace outcore::swap::test {

// A scratch directory named after the test, removed on destruction.
class TempDir : public outcore::test::TempDir {
 public:
  TempDir() : outcore::test::TempDir("swap") {}
};

using outcore::test::fill_random;

inline void fill_random(std::span<float> s, uint64_t seed, float lo = -1.0f, float hi = 1.0f) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> d(lo, hi);
  for (float& x : s) x = d(rng);
}

// XORs the byte at `offset` of `path` with 0x01 and syncs it to disk.
inline void flip_byte(const std::filesystem::path& path, uint64_t offset) {
  int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  ASSERT_GE(fd, 0) << path;
  unsigned char b = 0;
  ASSERT_EQ(::pread(fd, &b, 1, static_cast<off_t>(offset)), 1);
  b ^= 0x01;
  ASSERT_EQ(::pwrite(fd, &b, 1, static_cast<off_t>(offset)), 1);
  ASSERT_EQ(::fsync(fd), 0);
  ::close(fd);
}

}  // namespace outcore::swap::test
