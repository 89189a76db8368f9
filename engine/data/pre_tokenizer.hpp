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
  std::vector<RegexScratch> regex;  // one per Split step, then ByteLevel's pattern's
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
  // scratch.prefixed (valid until the next call of on_word). Each step passes a piece on as soon
  // as it is complete, so no list of a document's pieces is ever made (one of a 50 MB document
  // took gigabytes). REQUIRES: well-formed UTF-8.
  template <typename F>
  void for_each_word(std::string_view text, PreTokenizerScratch& scratch, F&& on_word) const {
    if (scratch.regex.size() < splits_.size() + 1) scratch.regex.resize(splits_.size() + 1);
    auto emit = [&](size_t begin, size_t end) {
      std::string_view piece = text.substr(begin, end - begin);
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
      gpt2_->for_each_match(piece, scratch.regex.back(), [&](size_t b, size_t e) {
        if (prev < b) on_word(piece.substr(prev, b - prev));
        if (b < e) on_word(piece.substr(b, e - b));
        prev = e;
      });
      if (prev < piece.size()) on_word(piece.substr(prev));
    };
    if (!text.empty()) split_from(0, text, 0, text.size(), scratch, emit);
  }

 private:
  struct Split {
    Regex regex;
    SplitBehavior behavior;
    bool invert;
  };

  // One Split step's pieces from its marks (the matches and the text between them, in order),
  // as tokenizers' NormalizedString::split folds them per the behaviour; each piece goes to
  // next(begin, end) once complete, empty ones included (the caller drops them, as
  // PreTokenizedString does).
  template <typename Next>
  struct Folder {
    SplitBehavior behavior;
    Next& next;
    bool held = false, previous_match = false;
    size_t held_begin = 0, held_end = 0;

    void hold(size_t b, size_t e) {
      held = true;
      held_begin = b;
      held_end = e;
    }
    void flush() {
      if (held) next(held_begin, held_end);
      held = false;
    }
    // `match`: the mark is a match (after `invert`), a delimiter.
    void mark(size_t b, size_t e, bool match) {
      switch (behavior) {
        case SplitBehavior::kIsolated:
          next(b, e);
          break;
        case SplitBehavior::kRemoved:
          if (!match) next(b, e);
          break;
        case SplitBehavior::kContiguous:  // runs of matches, and of the rest, each one piece
          if (held && match == previous_match) {
            held_end = e;
          } else {
            flush();
            hold(b, e);
          }
          break;
        case SplitBehavior::kMergedWithPrevious:  // a match joins the piece before it
          if (held && match && !previous_match) {
            held_end = e;
          } else {
            flush();
            hold(b, e);
          }
          break;
        case SplitBehavior::kMergedWithNext:  // a match joins the piece after it, not a match
          if (match) {
            flush();
            hold(b, e);
          } else if (held) {
            next(held_begin, e);
            held = false;
          } else {
            next(b, e);
          }
          break;
      }
      previous_match = match;
    }
  };

  // Runs the Split steps from `level` on text[begin, end), then emit(b, e) for each non-empty
  // piece left.
  template <typename Emit>
  void split_from(size_t level, std::string_view text, size_t begin, size_t end,
                  PreTokenizerScratch& scratch, Emit& emit) const {
    if (level == splits_.size()) {
      emit(begin, end);
      return;
    }
    const Split& split = splits_[level];
    auto next = [&](size_t b, size_t e) {
      if (b < e) split_from(level + 1, text, b, e, scratch, emit);
    };
    Folder<decltype(next)> fold{split.behavior, next};
    const std::string_view subject = text.substr(begin, end - begin);
    size_t prev = 0;
    split.regex.for_each_match(subject, scratch.regex[level], [&](size_t b, size_t e) {
      if (prev != b) fold.mark(begin + prev, begin + b, split.invert);
      fold.mark(begin + b, begin + e, !split.invert);
      prev = e;
    });
    if (prev != subject.size()) fold.mark(begin + prev, end, split.invert);
    fold.flush();
  }

  std::vector<Split> splits_;
  bool byte_level_ = false;
  bool add_prefix_space_ = false;
  std::optional<Regex> gpt2_;
};

}  // namespace outcore::data
