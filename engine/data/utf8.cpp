#include "engine/data/utf8.hpp"

#include <cstdint>
#include <cstring>

namespace outcore::data {
namespace {

// The sequence starting at p[0] (n > 0 bytes left): its length when well-formed, else minus
// the length of its maximal subpart (the lead byte and the continuation bytes that were still
// possible), as the WHATWG decoder consumes it before emitting U+FFFD.
int sequence_at(const unsigned char* p, size_t n) {
  const unsigned char b = p[0];
  if (b < 0x80) return 1;
  int need;
  unsigned char lo = 0x80, hi = 0xBF;
  if (b >= 0xC2 && b <= 0xDF) {
    need = 1;
  } else if (b >= 0xE0 && b <= 0xEF) {
    need = 2;
    if (b == 0xE0) lo = 0xA0;
    if (b == 0xED) hi = 0x9F;
  } else if (b >= 0xF0 && b <= 0xF4) {
    need = 3;
    if (b == 0xF0) lo = 0x90;
    if (b == 0xF4) hi = 0x8F;
  } else {
    return -1;
  }
  for (int k = 1; k <= need; ++k) {
    if (static_cast<size_t>(k) >= n || p[k] < lo || p[k] > hi) return -k;
    lo = 0x80;
    hi = 0xBF;
  }
  return need + 1;
}

// Length of the ASCII prefix of p[0, n), eight bytes at a time.
size_t ascii_prefix(const unsigned char* p, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    std::memcpy(&w, p + i, 8);
    if (w & 0x8080808080808080ull) break;
  }
  while (i < n && p[i] < 0x80) ++i;
  return i;
}

}  // namespace

size_t find_invalid_utf8(std::string_view s) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    i += ascii_prefix(p + i, n - i);
    if (i == n) break;
    const int len = sequence_at(p + i, n - i);
    if (len < 0) return i;
    i += static_cast<size_t>(len);
  }
  return n;
}

void append_replacing_invalid_utf8(std::string_view s, std::string& out) {
  static constexpr char kReplacement[] = "\xEF\xBF\xBD";
  const auto* p = reinterpret_cast<const unsigned char*>(s.data());
  const size_t n = s.size();
  size_t i = 0, copied = 0;
  while (i < n) {
    i += ascii_prefix(p + i, n - i);
    if (i == n) break;
    const int len = sequence_at(p + i, n - i);
    if (len > 0) {
      i += static_cast<size_t>(len);
      continue;
    }
    out.append(s.data() + copied, i - copied);
    out.append(kReplacement, 3);
    i += static_cast<size_t>(-len);
    copied = i;
  }
  out.append(s.data() + copied, n - copied);
}

}  // namespace outcore::data
