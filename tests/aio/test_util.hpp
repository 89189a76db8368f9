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

namespace outcore::aio::test {

// A directory unique to this process and test, removed (with its contents) on destruction.
class TempDir {
 public:
  TempDir() {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    std::string name = info ? std::string(info->test_suite_name()) + "." + info->name() : "aio";
    for (char& c : name) {
      if (c == '/') c = '_';
    }
    auto stamp = std::chrono::steady_clock::now().time_since_epoch().count();
    path_ = std::filesystem::path(OUTCORE_BINARY_DIR) / "test_tmp" /
            ("aio-" + std::to_string(::getpid()) + "-" + std::to_string(stamp) + "-" + name);
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }

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
