#include "engine/config/lenient_json.hpp"

#include <cctype>
#include <string>
#include <unordered_set>

namespace outcore::config::detail {
namespace {

using Json = nlohmann::ordered_json;

// Index of the first character at or after `i` that is neither whitespace nor inside a
// comment; text.size() if none.
size_t skip_blank(std::string_view text, size_t i) {
  while (i < text.size()) {
    char c = text[i];
    if (c == ' ' || c == '\t' || c == '\n' || c == '\r') {
      ++i;
    } else if (c == '/' && i + 1 < text.size() && text[i + 1] == '/') {
      while (i < text.size() && text[i] != '\n') ++i;
    } else if (c == '/' && i + 1 < text.size() && text[i + 1] == '*') {
      size_t end = text.find("*/", i + 2);
      i = end == std::string_view::npos ? text.size() : end + 2;
    } else {
      break;
    }
  }
  return i;
}

// Follows the structure of the document to give each duplicate key its JSON path.
class DuplicateKeyFinder {
 public:
  explicit DuplicateKeyFinder(std::vector<ConfigIssue>& errors) : errors_(errors) {}

  bool on_event(nlohmann::detail::parse_event_t event, const Json& parsed) {
    using E = nlohmann::detail::parse_event_t;
    switch (event) {
      case E::object_start:
        frames_.push_back(Frame{true, child_path(), {}, {}, 0});
        break;
      case E::array_start:
        frames_.push_back(Frame{false, child_path(), {}, {}, 0});
        break;
      case E::key: {
        Frame& f = frames_.back();
        f.key = parsed.get<std::string>();
        if (!f.keys.insert(f.key).second) {
          errors_.push_back({child_path(), "duplicate key (each key may appear once)"});
        }
        break;
      }
      case E::object_end:
      case E::array_end:
        frames_.pop_back();
        advance();
        break;
      case E::value:
        advance();
        break;
    }
    return true;
  }

 private:
  struct Frame {
    bool is_object;
    std::string path;
    std::unordered_set<std::string> keys;
    std::string key;
    size_t index;
  };

  std::string child_path() const {
    if (frames_.empty()) return "";
    const Frame& f = frames_.back();
    if (f.is_object) return f.path.empty() ? f.key : f.path + "." + f.key;
    return f.path + "[" + std::to_string(f.index) + "]";
  }

  void advance() {
    if (!frames_.empty() && !frames_.back().is_object) ++frames_.back().index;
  }

  std::vector<ConfigIssue>& errors_;
  std::vector<Frame> frames_;
};

// Start of the token that contains `offset`, or of the last token before it. nlohmann
// reports an unexpected token at its last character, and a malformed literal ("tru}") at
// the character that broke it (`broken_literal`); users expect the token's first character.
size_t token_start(std::string_view text, size_t offset, bool broken_literal) {
  size_t last = offset;
  size_t i = 0;
  while (true) {
    i = skip_blank(text, i);
    if (i >= text.size() || i > offset) return last;
    last = i;
    char c = text[i];
    if (c == '"') {
      ++i;
      while (i < text.size() && text[i] != '"') i += text[i] == '\\' ? 2 : 1;
      ++i;
    } else if (std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '+' || c == '.') {
      while (i < text.size() && (std::isalnum(static_cast<unsigned char>(text[i])) ||
                                 text[i] == '-' || text[i] == '+' || text[i] == '.')) {
        ++i;
      }
      if (broken_literal && offset == i) return last;
    } else {
      ++i;
    }
    if (offset < i) return last;
  }
}

// nlohmann's message without its "[json.exception...] parse error at line L, column C: "
// prefix (we print our own position).
std::string describe_parse_error(const std::string& what) {
  std::string_view w = what;
  size_t col = w.find("column ");
  if (col != std::string_view::npos) {
    size_t colon = w.find(": ", col);
    if (colon != std::string_view::npos) return std::string(w.substr(colon + 2));
  }
  size_t bracket = w.find("] ");
  return std::string(bracket == std::string_view::npos ? w : w.substr(bracket + 2));
}

}  // namespace

std::string blank_trailing_commas(std::string_view text) {
  std::string out(text);
  char last_significant = 0;
  size_t i = 0;
  while (i < text.size()) {
    size_t next = skip_blank(text, i);
    if (next != i) {
      i = next;
      continue;
    }
    char c = text[i];
    if (c == '"') {
      ++i;
      while (i < text.size() && text[i] != '"') i += text[i] == '\\' ? 2 : 1;
      ++i;
      last_significant = '"';
      continue;
    }
    if (c == ',') {
      bool after_value = last_significant != 0 && last_significant != '{' &&
                         last_significant != '[' && last_significant != ',';
      size_t after = skip_blank(text, i + 1);
      if (after_value && after < text.size() && (text[after] == '}' || text[after] == ']')) {
        out[i] = ' ';
        ++i;
        continue;  // the comma is gone: last_significant stays the value before it
      }
    }
    last_significant = c;
    ++i;
  }
  return out;
}

LineColumn line_column(std::string_view text, size_t offset) {
  if (offset > text.size()) offset = text.size();
  LineColumn lc{1, 1};
  for (size_t i = 0; i < offset; ++i) {
    if (text[i] == '\n') {
      ++lc.line;
      lc.column = 1;
    } else {
      ++lc.column;
    }
  }
  return lc;
}

LenientParse parse_lenient_json(std::string_view text) {
  LenientParse result;
  std::string cleaned = blank_trailing_commas(text);
  DuplicateKeyFinder finder(result.errors);
  Json::parser_callback_t callback = [&finder](int /*depth*/, nlohmann::detail::parse_event_t event,
                                               Json& parsed) {
    return finder.on_event(event, parsed);
  };
  try {
    result.value = Json::parse(cleaned, callback, /*allow_exceptions=*/true,
                               /*ignore_comments=*/true);
  } catch (const Json::parse_error& e) {
    // e.byte is 1-based: the position of the character that could not be parsed.
    std::string what = e.what();
    bool broken_literal = what.find("; last read:") != std::string::npos;
    size_t offset = token_start(cleaned, e.byte == 0 ? 0 : e.byte - 1, broken_literal);
    LineColumn lc = line_column(text, offset);
    result.value = nullptr;
    result.errors.push_back({"", "malformed JSON at line " + std::to_string(lc.line) + ", column " +
                                     std::to_string(lc.column) + ": " +
                                     describe_parse_error(what)});
  }
  return result;
}

}  // namespace outcore::config::detail
