#include "engine/data/pre_tokenizer.hpp"

#include <algorithm>

namespace outcore::data {
namespace {

// GPT-2's pattern, as tokenizers' ByteLevel pre-tokenizer compiles it.
constexpr const char* kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

}  // namespace

void PreTokenizer::set_byte_level(bool add_prefix_space, bool use_regex) {
  byte_level_ = true;
  add_prefix_space_ = add_prefix_space;
  if (use_regex) gpt2_.emplace(kGpt2Pattern, false, "pre_tokenizer", "ByteLevel");
}

void PreTokenizer::split_all(std::string_view text, PreTokenizerScratch& scratch) const {
  scratch.ranges.clear();
  if (!text.empty()) scratch.ranges.push_back({0, text.size(), false});
  for (const Split& split : splits_) {
    apply(split, text, scratch);
    scratch.ranges.swap(scratch.next_ranges);
  }
}

// tokenizers' NormalizedString::split: the pieces of each range (matches and what lies between
// them), folded per the behaviour; empty pieces dropped at the end, as PreTokenizedString does.
void PreTokenizer::apply(const Split& split, std::string_view text,
                         PreTokenizerScratch& scratch) const {
  using Piece = PreTokenizerScratch::Piece;
  std::vector<Piece>& out = scratch.next_ranges;
  out.clear();
  for (const Piece& range : scratch.ranges) {
    const std::string_view subject = text.substr(range.begin, range.end - range.begin);
    std::vector<Piece>& marks = scratch.marks;
    marks.clear();
    size_t prev = 0;
    split.regex.for_each_match(subject, scratch.regex, [&](size_t b, size_t e) {
      if (prev != b) marks.push_back({prev, b, false});
      marks.push_back({b, e, true});
      prev = e;
    });
    if (prev != subject.size()) marks.push_back({prev, subject.size(), false});
    if (split.invert)
      for (Piece& m : marks) m.is_match = !m.is_match;

    // Each kept piece: [begin, end) of the subject; is_match marks a piece to remove.
    std::vector<Piece>& kept = scratch.kept;
    kept.clear();
    bool previous_match = false;
    switch (split.behavior) {
      case SplitBehavior::kIsolated:
        for (const Piece& m : marks) kept.push_back({m.begin, m.end, false});
        break;
      case SplitBehavior::kRemoved:
        kept.assign(marks.begin(), marks.end());
        break;
      case SplitBehavior::kContiguous:
        for (const Piece& m : marks) {
          if (m.is_match == previous_match && !kept.empty())
            kept.back().end = m.end;
          else
            kept.push_back({m.begin, m.end, false});
          previous_match = m.is_match;
        }
        break;
      case SplitBehavior::kMergedWithPrevious:
        for (const Piece& m : marks) {
          if (m.is_match && !previous_match && !kept.empty())
            kept.back().end = m.end;
          else
            kept.push_back({m.begin, m.end, false});
          previous_match = m.is_match;
        }
        break;
      case SplitBehavior::kMergedWithNext:
        for (size_t k = marks.size(); k-- > 0;) {
          const Piece& m = marks[k];
          if (m.is_match && !previous_match && !kept.empty())
            kept.back().begin = m.begin;
          else
            kept.push_back({m.begin, m.end, false});
          previous_match = m.is_match;
        }
        std::reverse(kept.begin(), kept.end());
        break;
    }
    for (const Piece& k : kept)
      if (!k.is_match && k.begin < k.end)
        out.push_back({range.begin + k.begin, range.begin + k.end, false});
  }
}

}  // namespace outcore::data
