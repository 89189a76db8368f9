// PreTokenizer: cuts normalized text into the words the BPE model encodes, as tokenizers'
// pre-tokenizers do: Split steps (a regex or a string, with a behaviour and `invert`) applied
// in order, then optionally ByteLevel (its prefix space and GPT-2 regex; the byte-to-character
// map itself is folded into the model, see bpe.hpp).
//
// Threading: immutable after set-up; for_each_word may run on many threads at once, each with
// its own PreTokenizerScratch.
#pragma once

#include <cstddef>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "engine/data/regex.hpp"

namespace outcore::data {

// tokenizers' SplitDelimiterBehavior: what becomes of the matches (the delimiters).
enum class SplitBehavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

struct PreTokenizerScratch {
  struct Piece {
    size_t begin, end;
    bool is_match;
  };
  RegexScratch regex;
  std::vector<Piece> marks, kept;
  std::vector<Piece> ranges, next_ranges;
  std::string prefixed;
};

class PreTokenizer {
 public:
  void add_split(Regex regex, SplitBehavior behavior, bool invert) {
    splits_.push_back({std::move(regex), behavior, invert});
  }
  // ByteLevel as the last step: a space put in front of every piece that does not start with
  // one (add_prefix_space), then GPT-2's pattern (use_regex), delimiters isolated.
  void set_byte_level(bool add_prefix_space, bool use_regex);
  bool byte_level() const { return byte_level_; }

  // Calls on_word(word) for each non-empty word of `text`, in order. A word views `text` or
  // scratch.prefixed (valid until the next call of on_word). REQUIRES: well-formed UTF-8.
  template <typename F>
  void for_each_word(std::string_view text, PreTokenizerScratch& scratch, F&& on_word) const {
    auto emit = [&](std::string_view piece) {
      if (!byte_level_) {
        on_word(piece);
        return;
      }
      if (add_prefix_space_ && piece.front() != ' ') {
        scratch.prefixed.assign(1, ' ');
        scratch.prefixed.append(piece);
        piece = scratch.prefixed;
      }
      if (!gpt2_) {
        on_word(piece);
        return;
      }
      size_t prev = 0;
      gpt2_->for_each_match(piece, scratch.regex, [&](size_t b, size_t e) {
        if (prev < b) on_word(piece.substr(prev, b - prev));
        if (b < e) on_word(piece.substr(b, e - b));
        prev = e;
      });
      if (prev < piece.size()) on_word(piece.substr(prev));
    };
    if (streams()) {
      // One Split that keeps or drops each piece on its own (Llama 3's, Qwen's): its pieces as
      // the regex finds them, with no list of a document's pieces (one of a 50 MB document took
      // gigabytes).
      const Split& split = splits_.front();
      auto piece = [&](size_t b, size_t e, bool match) {
        if (b == e) return;
        if (split.behavior == SplitBehavior::kRemoved && match != split.invert) return;
        emit(text.substr(b, e - b));
      };
      size_t prev = 0;
      split.regex.for_each_match(text, scratch.regex, [&](size_t b, size_t e) {
        piece(prev, b, false);
        piece(b, e, true);
        prev = e;
      });
      piece(prev, text.size(), false);
      return;
    }
    split_all(text, scratch);
    for (const PreTokenizerScratch::Piece& r : scratch.ranges)
      emit(text.substr(r.begin, r.end - r.begin));
  }

 private:
  // Whether for_each_word runs the one Split as its regex finds the pieces: an isolating or
  // removing Split, not followed by the GPT-2 pattern (which would need the regex scratch too).
  bool streams() const {
    return splits_.size() == 1 && !gpt2_ &&
           (splits_.front().behavior == SplitBehavior::kIsolated ||
            splits_.front().behavior == SplitBehavior::kRemoved);
  }

  struct Split {
    Regex regex;
    SplitBehavior behavior;
    bool invert;
  };
  // scratch.ranges = the non-empty pieces of `text` after every Split step.
  void split_all(std::string_view text, PreTokenizerScratch& scratch) const;
  void apply(const Split& split, std::string_view text, PreTokenizerScratch& scratch) const;

  std::vector<Split> splits_;
  bool byte_level_ = false;
  bool add_prefix_space_ = false;
  std::optional<Regex> gpt2_;
};

}  // namespace outcore::data
