// StringTable: an open-addressing hash table from byte strings to small values, looked up by
// string_view without allocating. Keys are copied into one arena. The tokenizer's vocabulary
// and its per-thread word caches are StringTables.
//
// Threading: find() may run on many threads at once; insert() and clear() need exclusive use.
#pragma once

#include <bit>
#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace outcore::data {

// 64-bit hash of a byte string: eight bytes at a time, then a final mix (murmur3's fmix64).
inline uint64_t hash_bytes(std::string_view s) {
  uint64_t h = 0x9E3779B97F4A7C15ull ^ (s.size() * 0xC2B2AE3D27D4EB4Full);
  const char* p = s.data();
  size_t n = s.size();
  for (; n >= 8; p += 8, n -= 8) {
    uint64_t w;
    std::memcpy(&w, p, 8);
    h = std::rotl(h ^ (w * 0x87C37B91114253D5ull), 31) * 0x4CF5AD432745937Full;
  }
  if (n > 0) {
    uint64_t w = 0;
    std::memcpy(&w, p, n);
    h = std::rotl(h ^ (w * 0x87C37B91114253D5ull), 31) * 0x4CF5AD432745937Full;
  }
  h ^= h >> 33;
  h *= 0xFF51AFD7ED558CCDull;
  h ^= h >> 33;
  h *= 0xC4CEB9FE1A85EC53ull;
  h ^= h >> 33;
  return h;
}

template <typename V>
class StringTable {
 public:
  StringTable() { rehash(16); }

  size_t size() const { return size_; }
  // Bytes held by the key arena (what a cache bounds its memory by).
  size_t arena_bytes() const { return arena_.size(); }

  // The value stored for `key`, or nullptr.
  const V* find(std::string_view key) const {
    const uint64_t h = hash_bytes(key);
    for (size_t i = h & mask_;; i = (i + 1) & mask_) {
      const Slot& s = slots_[i];
      if (s.len == kEmpty) return nullptr;
      if (s.hash == h && s.len == key.size() &&
          std::memcmp(arena_.data() + s.offset, key.data(), key.size()) == 0)
        return &s.value;
    }
  }

  // Stores key -> value unless `key` is present. Returns the stored value and whether it was
  // inserted. REQUIRES key.size() < 2^32 - 1 and an arena below 4 GiB.
  std::pair<V*, bool> insert(std::string_view key, V value) {
    if ((size_ + 1) * 2 > slots_.size()) rehash(slots_.size() * 2);
    const uint64_t h = hash_bytes(key);
    size_t i = h & mask_;
    for (;; i = (i + 1) & mask_) {
      Slot& s = slots_[i];
      if (s.len == kEmpty) break;
      if (s.hash == h && s.len == key.size() &&
          std::memcmp(arena_.data() + s.offset, key.data(), key.size()) == 0)
        return {&s.value, false};
    }
    Slot& s = slots_[i];
    s.hash = h;
    s.offset = static_cast<uint32_t>(arena_.size());
    s.len = static_cast<uint32_t>(key.size());
    s.value = value;
    arena_.append(key);
    ++size_;
    return {&s.value, true};
  }

  // Removes every entry, keeping the allocated capacity.
  void clear() {
    for (Slot& s : slots_) s.len = kEmpty;
    arena_.clear();
    size_ = 0;
  }

  // Calls f(key, value) for every entry, in no particular order.
  template <typename F>
  void for_each(F&& f) const {
    for (const Slot& s : slots_)
      if (s.len != kEmpty) f(std::string_view(arena_.data() + s.offset, s.len), s.value);
  }

 private:
  static constexpr uint32_t kEmpty = UINT32_MAX;
  struct Slot {
    uint64_t hash = 0;
    uint32_t offset = 0;
    uint32_t len = kEmpty;
    V value{};
  };

  void rehash(size_t capacity) {
    std::vector<Slot> old = std::move(slots_);
    slots_.assign(capacity, Slot{});
    mask_ = capacity - 1;
    for (const Slot& s : old) {
      if (s.len == kEmpty) continue;
      size_t i = s.hash & mask_;
      while (slots_[i].len != kEmpty) i = (i + 1) & mask_;
      slots_[i] = s;
    }
  }

  std::vector<Slot> slots_;
  std::string arena_;
  size_t size_ = 0;
  size_t mask_ = 0;
};

}  // namespace outcore::data
