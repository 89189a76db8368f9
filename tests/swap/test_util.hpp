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

namespace outcore::swap::test {

// A directory unique to this process and test, removed (with its contents) on destruction.
class TempDir {
 public:
  TempDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    std::string name = info ? std::string(info->test_suite_name()) + "." + info->name() : "swap";
    for (char& c : name) {
      if (c == '/') c = '_';
    }
    auto stamp = std::chrono::steady_clock::now().time_since_epoch().count();
    path_ = std::filesystem::path(OUTCORE_BINARY_DIR) / "test_tmp" /
            ("swap-" + std::to_string(::getpid()) + "-" + std::to_string(stamp) + "-" + name);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
};

inline void fill_random(std::span<std::byte> s, uint64_t seed) {
  std::mt19937_64 rng(seed);
  size_t i = 0;
  for (; i + 8 <= s.size(); i += 8) {
    uint64_t v = rng();
    std::memcpy(s.data() + i, &v, 8);
  }
  for (; i < s.size(); ++i) s[i] = static_cast<std::byte>(rng());
}

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
