#include "engine/data/normalizer.hpp"

#include <fmt/format.h>
#include <utf8proc.h>

#include <cstdlib>
#include <memory>

#include "common/error.hpp"

namespace outcore::data {
namespace {

// Whether every character of `text` is left unchanged by `form` whatever follows it: ASCII for
// every form, and for NFC also every character below U+0300 (the first combining mark; none
// below it decomposes canonically or is excluded from composition).
bool unchanged_by(NormalForm form, std::string_view text) {
  const unsigned char limit = form == NormalForm::kNfc ? 0xCC : 0x80;
  for (char c : text)
    if (static_cast<unsigned char>(c) >= limit) return false;
  return true;
}

utf8proc_option_t options_of(NormalForm form) {
  const int stable = UTF8PROC_STABLE;
  switch (form) {
    case NormalForm::kNfc:
      return static_cast<utf8proc_option_t>(stable | UTF8PROC_COMPOSE);
    case NormalForm::kNfd:
      return static_cast<utf8proc_option_t>(stable | UTF8PROC_DECOMPOSE);
    case NormalForm::kNfkc:
      return static_cast<utf8proc_option_t>(stable | UTF8PROC_COMPOSE | UTF8PROC_COMPAT);
    case NormalForm::kNfkd:
      return static_cast<utf8proc_option_t>(stable | UTF8PROC_DECOMPOSE | UTF8PROC_COMPAT);
  }
  return static_cast<utf8proc_option_t>(stable);
}

}  // namespace

std::string_view Normalizer::apply(std::string_view text, std::string& buffer) const {
  std::string_view cur = text;
  for (NormalForm form : forms_) {
    if (unchanged_by(form, cur)) continue;
    utf8proc_uint8_t* out = nullptr;
    const utf8proc_ssize_t n =
        utf8proc_map(reinterpret_cast<const utf8proc_uint8_t*>(cur.data()),
                     static_cast<utf8proc_ssize_t>(cur.size()), &out, options_of(form));
    std::unique_ptr<utf8proc_uint8_t, decltype(&std::free)> owned(out, &std::free);
    if (n < 0)
      throw InvalidArgument(fmt::format("Unicode normalization failed: {}", utf8proc_errmsg(n)));
    buffer.assign(reinterpret_cast<const char*>(out), static_cast<size_t>(n));
    cur = buffer;
  }
  return cur;
}

}  // namespace outcore::data
