// Regex: a PCRE2 pattern (UTF, Unicode properties, JIT) for the pre-tokenizers' splits.
//
// Hugging Face tokenizers compile their patterns with Oniguruma; where the two differ on the
// patterns tokenizers ship, the pattern is translated: \s and \S mean Unicode White_Space
// (Oniguruma's meaning; PCRE2's \s also takes U+180E), \h, \H mean a hex digit and its
// complement, and ^ and $ match at every line's start and end (Ruby syntax). What means other
// characters in the two and is not translated is refused: \w, \W, \b, \B and POSIX brackets
// ([:alpha:]; Oniguruma's word characters take in combining marks). Matching follows Oniguruma's
// find_iter: leftmost matches, each search starting at the end of the last match, an empty match
// right after a match skipped by one character.
//
// Threading: a Regex is immutable after construction; matching on many threads at once needs
// one RegexScratch per thread.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <string_view>

namespace outcore::data {

// Per-thread match state (PCRE2 match data, match context and JIT stack). Move-only.
class RegexScratch {
 public:
  RegexScratch();
  ~RegexScratch();
  RegexScratch(RegexScratch&&) noexcept;
  RegexScratch& operator=(RegexScratch&&) noexcept;

 private:
  friend class Regex;
  struct State;
  std::unique_ptr<State> state_;
};

class Regex {
 public:
  // Compiles `pattern`: a regular expression, or with `literal` the string itself. Throws
  // ConfigError(json_path, "... (in <source>)") with PCRE2's message and the offset when the
  // pattern does not compile, or when it uses what cannot be translated (a nested class, \w,
  // \b, a POSIX bracket).
  Regex(std::string_view pattern, bool literal, const std::string& json_path,
        const std::string& source);
  ~Regex();
  Regex(Regex&&) noexcept;
  Regex& operator=(Regex&&) noexcept;

  // Calls on_match(begin, end) (byte offsets) for each match in `subject`, in order.
  // REQUIRES: `subject` is well-formed UTF-8. Throws Error naming the pattern when PCRE2 fails
  // (a resource limit), which no shipped tokenizer's pattern reaches.
  template <typename F>
  void for_each_match(std::string_view subject, RegexScratch& scratch, F&& on_match) const {
    size_t last_end = 0, last_match_end = SIZE_MAX, begin = 0, end = 0;
    while (last_end <= subject.size()) {
      if (!search(subject, last_end, scratch, begin, end)) return;
      if (begin == end && last_match_end == end) {
        last_end += next_char_length(subject, last_end);
        continue;
      }
      last_end = last_match_end = end;
      on_match(begin, end);
    }
  }

  const std::string& pattern() const { return pattern_; }

 private:
  // The first match at or after `start`; false when there is none.
  bool search(std::string_view subject, size_t start, RegexScratch& scratch, size_t& begin,
              size_t& end) const;
  static size_t next_char_length(std::string_view s, size_t at);

  struct Code;
  std::unique_ptr<Code> code_;
  std::string pattern_;
};

// Whether the character at the start of `s` / at the end of `s` is a word character: the Rust
// regex crate's \w (Alphabetic, marks, decimal digits, connector punctuation, joiners), what
// tokenizers' single_word tests. False for an empty `s`. REQUIRES: well-formed UTF-8.
bool starts_with_word_char(std::string_view s);
bool ends_with_word_char(std::string_view s);

// Whether code point `c` is Unicode White_Space (Rust's char::is_whitespace).
bool is_unicode_whitespace(char32_t c);

}  // namespace outcore::data
