// Test helpers shared by every layer's tests: a unique scratch directory in the build tree and
// seeded random bytes.
#pragma once

#include <gtest/gtest.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <random>
#include <span>
#include <string>

namespace outcore::test {

// A directory under <build>/test_tmp unique to this process and test, named
// "<prefix>-<pid>-<stamp>-<Suite.Test>", removed with its contents on destruction.
class TempDir {
 public:
  explicit TempDir(const std::string& prefix) {
    const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
    std::string name = info ? std::string(info->test_suite_name()) + "." + info->name() : prefix;
    for (char& c : name) {
      if (c == '/') c = '_';
    }
    auto stamp = std::chrono::steady_clock::now().time_since_epoch().count();
    path_ = std::filesystem::path(OUTCORE_BINARY_DIR) / "test_tmp" /
            (prefix + "-" + std::to_string(::getpid()) + "-" + std::to_string(stamp) + "-" + name);
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

// Fills `s` with bytes from a 64-bit Mersenne Twister seeded with `seed`.
inline void fill_random(std::span<std::byte> s, uint64_t seed) {
  std::mt19937_64 rng(seed);
  size_t i = 0;
  for (; i + 8 <= s.size(); i += 8) {
    uint64_t v = rng();
    std::memcpy(s.data() + i, &v, 8);
  }
  for (; i < s.size(); ++i) s[i] = static_cast<std::byte>(rng());
}

}  // namespace outcore::test
