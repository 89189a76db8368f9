#include "engine/data/added_tokens.hpp"

#include "engine/data/regex.hpp"
#include "engine/data/utf8.hpp"

namespace outcore::data {

void AddedTokenMatcher::add(std::string_view pattern, uint32_t id, AddedTokenFlags flags) {
  uint32_t node = 0;
  for (char ch : pattern) {
    const auto c = static_cast<unsigned char>(ch);
    uint32_t child = 0;
    for (const auto& [byte, to] : nodes_[node].next)
      if (byte == c) child = to;
    if (child == 0) {
      child = static_cast<uint32_t>(nodes_.size());
      nodes_[node].next.emplace_back(c, child);
      nodes_.emplace_back();
    }
    node = child;
  }
  if (node == 0 || nodes_[node].entry >= 0) return;
  nodes_[node].entry = static_cast<int32_t>(entries_.size());
  entries_.push_back({id, flags});
  first_byte_[static_cast<unsigned char>(pattern[0])] = true;
}

std::pair<int32_t, std::pair<size_t, size_t>> AddedTokenMatcher::next_match(std::string_view text,
                                                                            size_t from) const {
  const auto* p = reinterpret_cast<const unsigned char*>(text.data());
  for (size_t i = from; i < text.size(); ++i) {
    if (!first_byte_[p[i]]) continue;
    int32_t best = -1;
    size_t best_len = 0;
    uint32_t node = 0;
    for (size_t j = i; j < text.size(); ++j) {
      uint32_t child = 0;
      for (const auto& [byte, to] : nodes_[node].next)
        if (byte == p[j]) child = to;
      if (child == 0) break;
      node = child;
      if (nodes_[node].entry >= 0) {
        best = nodes_[node].entry;
        best_len = j + 1 - i;
      }
    }
    if (best >= 0) return {best, {i, best_len}};
  }
  return {-1, {0, 0}};
}

bool AddedTokenMatcher::stands_alone(std::string_view text, size_t start, size_t stop) {
  return !ends_with_word_char(text.substr(0, start)) && !starts_with_word_char(text.substr(stop));
}

size_t AddedTokenMatcher::whitespace_run_before(std::string_view text, size_t at) {
  while (at > 0) {
    size_t i = at - 1;
    while (i > 0 && (static_cast<unsigned char>(text[i]) & 0xC0) == 0x80) --i;
    if (!is_unicode_whitespace(decode_utf8_at(text, i))) break;
    at = i;
  }
  return at;
}

size_t AddedTokenMatcher::whitespace_run_after(std::string_view text, size_t at) {
  while (at < text.size() && is_unicode_whitespace(decode_utf8_at(text, at)))
    at += utf8_char_length(static_cast<unsigned char>(text[at]));
  return at;
}

}  // namespace outcore::data
