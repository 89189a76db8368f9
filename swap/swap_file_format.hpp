// Internal: the byte layout of a swap file's header (see swap.hpp, "On-disk layout").
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <span>

#include "common/aligned_buffer.hpp"
#include "swap/swap.hpp"

namespace outcore::swap::format {

inline constexpr char kMagic[8] = {'O', 'C', 'S', 'W', 'A', 'P', '\0', '\1'};
inline constexpr uint32_t kVersion = 1;
inline constexpr size_t kPreambleBytes = 64;
inline constexpr size_t kEntryBytes = 64;
inline constexpr size_t kMaxNameBytes = 47;  // + NUL = 48, then offset and bytes

// Bytes of the header of a file holding `tensor_count` tensors: a whole number of 4 KiB blocks.
constexpr uint64_t header_bytes(size_t tensor_count) {
  return align_up(kPreambleBytes + kEntryBytes * tensor_count, kIoAlignment);
}

// Preamble fields, little-endian, at these byte offsets.
struct Preamble {
  static constexpr size_t kMagicAt = 0;       // char[8]
  static constexpr size_t kVersionAt = 8;     // u32
  static constexpr size_t kKindAt = 12;       // u32 (SwapKind)
  static constexpr size_t kUnitAt = 16;       // u32
  static constexpr size_t kCountAt = 20;      // u32 tensor count
  static constexpr size_t kNonceAt = 24;      // u64 per-run random nonce
  static constexpr size_t kFileBytesAt = 32;  // u64 file size
};
// Entry fields at kPreambleBytes + i * kEntryBytes.
struct Entry {
  static constexpr size_t kNameAt = 0;     // char[48], NUL-padded
  static constexpr size_t kOffsetAt = 48;  // u64
  static constexpr size_t kBytesAt = 56;   // u64
};

template <typename T>
inline void put(std::span<std::byte> out, size_t at, T v) {
  std::memcpy(out.data() + at, &v, sizeof v);  // x86-64: little-endian
}

}  // namespace outcore::swap::format
