// AddedTokenMatcher: finds a tokenizer's added tokens ("<|end_of_text|>", "<|im_end|>", ...)
// in text and splits the text around them, as tokenizers' AddedVocabulary does: leftmost-
// longest matches, each search resuming at the end of the previous match, with the lstrip,
// rstrip and single_word flags of each token.
//
// Threading: immutable after the last add(); split() may run on many threads at once.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace outcore::data {

struct AddedTokenFlags {
  // Only matched where neither neighbour is a word character (see starts_with_word_char).
  bool single_word = false;
  // The match takes the White_Space before it (lstrip) / after it (rstrip) along.
  bool lstrip = false;
  bool rstrip = false;
};

class AddedTokenMatcher {
 public:
  // Adds `pattern` (not empty) for token `id`. When the same pattern is added twice the first
  // one is kept.
  void add(std::string_view pattern, uint32_t id, AddedTokenFlags flags);
  bool empty() const { return entries_.empty(); }

  // Calls on_text(piece) for each non-empty stretch of `text` between tokens and on_token(id)
  // for each token, in text order. REQUIRES: `text` is well-formed UTF-8.
  template <typename OnText, typename OnToken>
  void split(std::string_view text, OnText&& on_text, OnToken&& on_token) const {
    if (entries_.empty()) {
      if (!text.empty()) on_text(text);
      return;
    }
    const size_t n = text.size();
    size_t emitted = 0;  // tokenizers' start_offset
    for (size_t i = 0; i < n;) {
      const auto [entry, span] = next_match(text, i);
      if (entry < 0) break;
      size_t start = span.first, stop = span.first + span.second;
      i = stop;  // the next search starts after the match, whatever the flags take along
      const Entry& e = entries_[static_cast<size_t>(entry)];
      if (e.flags.single_word && !stands_alone(text, start, stop)) continue;
      if (e.flags.lstrip) start = std::max(whitespace_run_before(text, start), emitted);
      if (e.flags.rstrip) stop = whitespace_run_after(text, stop);
      if (emitted < start) on_text(text.substr(emitted, start - emitted));
      on_token(e.id);
      emitted = stop;
    }
    if (emitted < n) on_text(text.substr(emitted));
  }

 private:
  struct Entry {
    uint32_t id;
    AddedTokenFlags flags;
  };
  struct Node {
    std::vector<std::pair<unsigned char, uint32_t>> next;
    int32_t entry = -1;
  };

  // The first match at or after `from`: (entry, (start, length)), entry -1 when none.
  std::pair<int32_t, std::pair<size_t, size_t>> next_match(std::string_view text,
                                                           size_t from) const;
  static bool stands_alone(std::string_view text, size_t start, size_t stop);
  // The start of the White_Space run that ends at `at` / the end of the run starting at `at`.
  static size_t whitespace_run_before(std::string_view text, size_t at);
  static size_t whitespace_run_after(std::string_view text, size_t at);

  std::vector<Node> nodes_ = std::vector<Node>(1);
  std::vector<Entry> entries_;
  std::array<bool, 256> first_byte_{};
};

}  // namespace outcore::data
