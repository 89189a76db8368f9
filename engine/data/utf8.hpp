// UTF-8 checking and repair. Well-formed means Unicode's table 3-7: no overlong forms, no
// surrogates, nothing above U+10FFFF.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

namespace outcore::data {

// Offset of the first byte of the first ill-formed sequence in `s`, or s.size() when all of
// `s` is well-formed UTF-8.
size_t find_invalid_utf8(std::string_view s);

// Appends `s` to `out` with every maximal subpart of an ill-formed sequence replaced by U+FFFD,
// which is what the WHATWG Encoding Standard's UTF-8 decoder (TextDecoder, Node's
// Buffer.toString) produces for the same bytes. Well-formed input is appended unchanged.
void append_replacing_invalid_utf8(std::string_view s, std::string& out);

// Length in bytes of the UTF-8 sequence whose lead byte is `lead` (1 for a byte that cannot
// lead one). REQUIRES: a well-formed string, for the result to be a whole character.
inline size_t utf8_char_length(unsigned char lead) {
  return lead < 0xC0 ? 1 : lead < 0xE0 ? 2 : lead < 0xF0 ? 3 : 4;
}

// The code point of the character starting at s[i]. REQUIRES: `s` well-formed, i < s.size()
// and s[i] a lead byte.
inline char32_t decode_utf8_at(std::string_view s, size_t i) {
  const auto* p = reinterpret_cast<const unsigned char*>(s.data()) + i;
  switch (utf8_char_length(p[0])) {
    case 1:
      return p[0];
    case 2:
      return ((p[0] & 0x1Fu) << 6) | (p[1] & 0x3Fu);
    case 3:
      return ((p[0] & 0x0Fu) << 12) | ((p[1] & 0x3Fu) << 6) | (p[2] & 0x3Fu);
    default:
      return ((p[0] & 0x07u) << 18) | ((p[1] & 0x3Fu) << 12) | ((p[2] & 0x3Fu) << 6) |
             (p[3] & 0x3Fu);
  }
}

}  // namespace outcore::data
