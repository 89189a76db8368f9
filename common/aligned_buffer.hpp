// A move-only, zero-initialised heap buffer aligned to `kIoAlignment` (4 KiB), the unit
// O_DIRECT and the swap files are laid out in.
#pragma once

#include <cstddef>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <new>
#include <span>

namespace outcore {

inline constexpr size_t kIoAlignment = 4096;

constexpr size_t align_up(size_t n, size_t a) { return (n + a - 1) / a * a; }

class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  // Allocates align_up(bytes, kIoAlignment) bytes, zeroed. Throws std::bad_alloc.
  explicit AlignedBuffer(size_t bytes) : size_(bytes) {
    size_t cap = align_up(bytes == 0 ? 1 : bytes, kIoAlignment);
    void* p = std::aligned_alloc(kIoAlignment, cap);
    if (p == nullptr) throw std::bad_alloc();
    std::memset(p, 0, cap);
    data_.reset(static_cast<std::byte*>(p));
  }
  std::byte* data() { return data_.get(); }
  const std::byte* data() const { return data_.get(); }
  size_t size() const { return size_; }
  template <typename T>
  std::span<T> as() {
    return {reinterpret_cast<T*>(data_.get()), size_ / sizeof(T)};
  }
  template <typename T>
  std::span<const T> as() const {
    return {reinterpret_cast<const T*>(data_.get()), size_ / sizeof(T)};
  }

 private:
  struct Free {
    void operator()(std::byte* p) const { std::free(p); }
  };
  std::unique_ptr<std::byte, Free> data_;
  size_t size_ = 0;
};

}  // namespace outcore
