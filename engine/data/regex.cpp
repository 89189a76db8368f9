#define PCRE2_CODE_UNIT_WIDTH 8
#include "engine/data/regex.hpp"

#include <fmt/format.h>
#include <pcre2.h>

#include <algorithm>
#include <array>

#include "common/error.hpp"
#include "engine/data/utf8.hpp"

namespace outcore::data {
namespace {

std::string pcre2_message(int code) {
  std::array<PCRE2_UCHAR, 256> buf{};
  pcre2_get_error_message(code, buf.data(), buf.size());
  return reinterpret_cast<const char*>(buf.data());
}

// The pattern with Oniguruma's \s, \S, \h, \H spelled for PCRE2 (see regex.hpp). Throws
// ConfigError for a nested character class (Oniguruma's set operations; PCRE2 has none).
std::string translate_oniguruma(std::string_view p, const std::string& json_path,
                                const std::string& source) {
  std::string out;
  out.reserve(p.size() + 32);
  bool in_class = false;
  for (size_t i = 0; i < p.size(); ++i) {
    const char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      const char e = p[++i];
      if (e == 'Q') {  // \Q...\E: copied as it is
        const size_t stop = p.find("\\E", i + 1);
        const size_t end = stop == std::string_view::npos ? p.size() : stop + 2;
        out.append(p.substr(i - 1, end - (i - 1)));
        i = end - 1;
      } else if (e == 's') {
        out += "\\p{White_Space}";
      } else if (e == 'S') {
        out += "\\P{White_Space}";
      } else if (e == 'h') {
        out += in_class ? "0-9a-fA-F" : "[0-9a-fA-F]";
      } else if (e == 'H' && !in_class) {
        out += "[^0-9a-fA-F]";
      } else if (e == 'H') {
        throw ConfigError(json_path, fmt::format("\\H inside a character class is not supported "
                                                 "(pattern \"{}\", in {})",
                                                 p, source));
      } else if (e == 'w' || e == 'W' || (!in_class && (e == 'b' || e == 'B'))) {
        // Oniguruma's word characters take in the combining marks, PCRE2's do not: the split
        // would differ from tokenizers' wherever a mark follows a letter. (Inside a class \b
        // is a backspace in both.)
        throw ConfigError(json_path, fmt::format("\\{} is not supported: Oniguruma's word "
                                                 "characters are not PCRE2's (pattern \"{}\", "
                                                 "in {})",
                                                 e, p, source));
      } else {
        out += c;
        out += e;
      }
      continue;
    }
    if (!in_class && c == '[') {
      in_class = true;
      out += c;
      // A ']' right after '[' or '[^' is a literal.
      if (i + 1 < p.size() && p[i + 1] == '^') out += p[++i];
      if (i + 1 < p.size() && p[i + 1] == ']') out += p[++i];
      continue;
    }
    if (in_class && c == '[') {
      const size_t close = p.find(":]", i);
      if (i + 1 < p.size() && p[i + 1] == ':' && close != std::string_view::npos)
        throw ConfigError(json_path, fmt::format("POSIX bracket {} is not supported: its "
                                                 "characters in Oniguruma are not PCRE2's "
                                                 "(pattern \"{}\", in {})",
                                                 p.substr(i, close + 2 - i), p, source));
      throw ConfigError(json_path, fmt::format("nested character classes are not supported "
                                               "(pattern \"{}\", in {})",
                                               p, source));
    }
    if (in_class && c == ']') in_class = false;
    out += c;
  }
  return out;
}

// One compiled single-character class, matched anchored.
class CharClass {
 public:
  explicit CharClass(const char* pattern) {
    int err = 0;
    PCRE2_SIZE off = 0;
    code_ = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern), PCRE2_ZERO_TERMINATED,
                          PCRE2_UTF | PCRE2_UCP | PCRE2_ANCHORED, &err, &off, nullptr);
    if (code_ == nullptr)
      throw Error(fmt::format("PCRE2 lacks Unicode property support: \"{}\": {}", pattern,
                              pcre2_message(err)));
  }
  ~CharClass() { pcre2_code_free(code_); }
  bool matches(std::string_view ch) const {
    pcre2_match_data* md = pcre2_match_data_create(1, nullptr);
    const int rc = pcre2_match(code_, reinterpret_cast<PCRE2_SPTR>(ch.data()), ch.size(), 0,
                               PCRE2_NO_UTF_CHECK, md, nullptr);
    pcre2_match_data_free(md);
    return rc >= 0;
  }

 private:
  pcre2_code* code_ = nullptr;
};

// The regex crate's \w (UTS #18), which tokenizers' single_word tests with.
const CharClass& word_class() {
  static const CharClass c("[\\p{Alphabetic}\\p{M}\\p{Nd}\\p{Pc}\\p{Join_Control}]");
  return c;
}

}  // namespace

struct RegexScratch::State {
  pcre2_match_context* context = nullptr;
  pcre2_jit_stack* stack = nullptr;
  pcre2_match_data* data = nullptr;
  State() {
    context = pcre2_match_context_create(nullptr);
    stack = pcre2_jit_stack_create(32 * 1024, 4 * 1024 * 1024, nullptr);
    data = pcre2_match_data_create(1, nullptr);
    if (context == nullptr || stack == nullptr || data == nullptr)
      throw OutOfMemory("cannot allocate PCRE2 match state");
    pcre2_jit_stack_assign(context, nullptr, stack);
  }
  ~State() {
    pcre2_match_data_free(data);
    pcre2_jit_stack_free(stack);
    pcre2_match_context_free(context);
  }
};

RegexScratch::RegexScratch() : state_(std::make_unique<State>()) {}
RegexScratch::~RegexScratch() = default;
RegexScratch::RegexScratch(RegexScratch&&) noexcept = default;
RegexScratch& RegexScratch::operator=(RegexScratch&&) noexcept = default;

struct Regex::Code {
  pcre2_code* code = nullptr;
  ~Code() { pcre2_code_free(code); }
};

Regex::Regex(std::string_view pattern, bool literal, const std::string& json_path,
             const std::string& source)
    : code_(std::make_unique<Code>()), pattern_(pattern) {
  // Lines end at \n alone, as in Oniguruma, whatever newline PCRE2 was built with.
  constexpr std::string_view kLineEnds = "(*LF)";
  const std::string translated =
      literal ? std::string(pattern)
              : std::string(kLineEnds) + translate_oniguruma(pattern, json_path, source);
  // PCRE2_UCP only changes what escapes and classes mean, which a literal has none of. ^ and $
  // match at every line's start and end, as in Oniguruma's Ruby syntax, which tokenizers uses.
  const uint32_t options =
      PCRE2_UTF | PCRE2_NO_UTF_CHECK | (literal ? PCRE2_LITERAL : PCRE2_UCP | PCRE2_MULTILINE);
  int err = 0;
  PCRE2_SIZE offset = 0;
  code_->code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(translated.data()), translated.size(),
                              options, &err, &offset, nullptr);
  if (code_->code == nullptr) {
    throw ConfigError(
        json_path,
        fmt::format(
            "pattern \"{}\" does not compile: {} at offset {} (in {})", pattern, pcre2_message(err),
            literal || offset < kLineEnds.size() ? offset : offset - kLineEnds.size(), source));
  }
  // Without JIT (a platform PCRE2 lacks it for) matching falls back to the interpreter.
  pcre2_jit_compile(code_->code, PCRE2_JIT_COMPLETE);
}

Regex::~Regex() = default;
Regex::Regex(Regex&&) noexcept = default;
Regex& Regex::operator=(Regex&&) noexcept = default;

bool Regex::search(std::string_view subject, size_t start, RegexScratch& scratch, size_t& begin,
                   size_t& end) const {
  RegexScratch::State& s = *scratch.state_;
  const int rc = pcre2_match(code_->code, reinterpret_cast<PCRE2_SPTR>(subject.data()),
                             subject.size(), start, PCRE2_NO_UTF_CHECK, s.data, s.context);
  if (rc == PCRE2_ERROR_NOMATCH) return false;
  if (rc < 0) {
    throw Error(fmt::format("pre-tokenizer pattern \"{}\": matching failed: {}", pattern_,
                            pcre2_message(rc)));
  }
  const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(s.data);
  begin = ov[0];
  end = ov[1];
  return true;
}

size_t Regex::next_char_length(std::string_view s, size_t at) {
  return at < s.size() ? utf8_char_length(static_cast<unsigned char>(s[at])) : 1;
}

bool starts_with_word_char(std::string_view s) {
  if (s.empty()) return false;
  const size_t len = std::min(s.size(), utf8_char_length(static_cast<unsigned char>(s[0])));
  return word_class().matches(s.substr(0, len));
}

bool ends_with_word_char(std::string_view s) {
  if (s.empty()) return false;
  size_t i = s.size() - 1;
  while (i > 0 && (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80) --i;
  return word_class().matches(s.substr(i));
}

bool is_unicode_whitespace(char32_t c) {
  return (c >= 0x09 && c <= 0x0D) || c == 0x20 || c == 0x85 || c == 0xA0 || c == 0x1680 ||
         (c >= 0x2000 && c <= 0x200A) || c == 0x2028 || c == 0x2029 || c == 0x202F || c == 0x205F ||
         c == 0x3000;
}

}  // namespace outcore::data
