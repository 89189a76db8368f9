#include "engine/config/lenient_json.hpp"

#include <algorithm>
#include <cctype>
#include <cstddef>
#include <iterator>
#include <string>
#include <unordered_set>
#include <utility>

namespace outcore::config::detail {
namespace {

using Json = nlohmann::ordered_json;

// Index of the first character at or after `i` that is neither whitespace nor inside a
// comment (//, /* */, and with `hash` hjson's #); text.size() if none.
size_t skip_blank(std::string_view text, size_t i, bool hash = true) {
  while (i < text.size()) {
    char c = text[i];
    if (c == ' ' || c == '\t' || c == '\n' || c == '\r') {
      ++i;
    } else if ((c == '/' && i + 1 < text.size() && text[i + 1] == '/') || (hash && c == '#')) {
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

// nlohmann's SAX events carry no position. The lexer reads the text through this
// iterator, which records how far it has read, so each event can be placed in the file.
class TrackingIterator {
 public:
  using iterator_category = std::input_iterator_tag;
  using value_type = char;
  using difference_type = std::ptrdiff_t;
  using pointer = const char*;
  using reference = const char&;

  TrackingIterator(const char* p, const char** read_end) : p_(p), read_end_(read_end) {}
  reference operator*() const { return *p_; }
  TrackingIterator& operator++() {
    *read_end_ = ++p_;
    return *this;
  }
  TrackingIterator operator++(int) {
    TrackingIterator old = *this;
    ++*this;
    return old;
  }
  bool operator==(const TrackingIterator& o) const { return p_ == o.p_; }

 private:
  const char* p_;
  const char** read_end_;
};

std::string at_line_column(std::string_view text, size_t offset) {
  LineColumn lc = line_column(text, offset);
  return "line " + std::to_string(lc.line) + ", column " + std::to_string(lc.column);
}

// A token or key for a message: long ones (a 400-digit number) are cut.
std::string shorten(std::string_view token) {
  if (token.size() <= 40) return std::string(token);
  return std::string(token.substr(0, 37)) + "...";
}

// nlohmann SAX handler building the document as an ordered_json. Unlike nlohmann's own DOM
// builder (whose ordered_map finds each new key by a linear scan), appending a key costs
// O(1): duplicates are found with one hash set per open object. It follows the JSON path
// of the value being read, so duplicate keys and out-of-range numbers are named by it, and
// it stops the parse past kMaxConfigDepth levels of nesting.
class DomBuilder {
 public:
  DomBuilder(std::string_view text, const char* const& read_end, LenientParse& out)
      : text_(text), read_end_(read_end), out_(out) {}

  Json take_value() { return std::move(root_); }

  bool null() { return scalar(nullptr); }
  bool boolean(bool b) { return scalar(b); }
  bool number_integer(Json::number_integer_t x) { return scalar(x); }
  bool number_unsigned(Json::number_unsigned_t x) { return scalar(x); }
  bool number_float(Json::number_float_t x, const std::string& token) {
    // The lexer reads an integer literal that fits neither int64 nor uint64 as a double:
    // its value would be silently rounded.
    if (is_integer_literal(token)) return number_error(token);
    return scalar(x);
  }
  bool string(std::string& s) { return scalar(std::move(s)); }
  bool binary(Json::binary_t& b) { return scalar(std::move(b)); }  // not produced from text
  bool start_object(size_t /*elements*/) { return open(true); }
  bool start_array(size_t /*elements*/) { return open(false); }
  bool end_object() { return close(); }
  bool end_array() { return close(); }
  bool key(std::string& k);
  bool parse_error(size_t position, const std::string& last_token,
                   const nlohmann::detail::exception& e);

 private:
  struct Frame {
    Json* container;  // nullptr inside the value of a duplicate key: read, then dropped
    bool is_object;
    std::unordered_set<std::string> keys;  // objects: every key so far
    const std::string* key = nullptr;      // objects: the key being read (in `keys`)
    size_t index = 0;                      // arrays: index of the element being read
  };

  size_t offset() const { return static_cast<size_t>(read_end_ - text_.data()); }

  // Stores `v` where the value being read belongs; nullptr when it is dropped.
  Json* place(Json&& v) {
    if (frames_.empty()) {
      root_ = std::move(v);
      return &root_;
    }
    Frame& f = frames_.back();
    if (!f.container || (f.is_object && !slot_)) return nullptr;
    if (f.is_object) {
      *slot_ = std::move(v);
      return slot_;
    }
    Json::array_t& array = f.container->get_ref<Json::array_t&>();
    array.push_back(std::move(v));
    return &array.back();
  }

  // After a value: the enclosing array moves on to its next index.
  void advance() {
    if (!frames_.empty() && !frames_.back().is_object) ++frames_.back().index;
  }

  bool scalar(Json v) {
    place(std::move(v));
    advance();
    return true;
  }

  bool open(bool is_object) {
    if (frames_.size() >= kMaxConfigDepth) {
      // The lexer has just read the '{' or '['.
      return stop("", "objects and arrays nested deeper than " + std::to_string(kMaxConfigDepth) +
                          " levels at " + at_line_column(text_, offset() - 1) +
                          "; allowed: at most " + std::to_string(kMaxConfigDepth));
    }
    Json* container = place(is_object ? Json::object() : Json::array());
    frames_.push_back(Frame{container, is_object, {}, nullptr, 0});
    return true;
  }

  bool close() {
    frames_.pop_back();
    advance();
    return true;
  }

  // JSON path of the value being read: "a.b", "list[1].x". Keys are cut as in messages,
  // so listing kMaxListedPerKind paths costs at most that many times the depth limit times
  // a few dozen bytes, however long the keys.
  std::string value_path() const {
    std::string path;
    for (const Frame& f : frames_) {
      if (f.is_object) {
        if (!f.key) break;
        if (!path.empty()) path += '.';
        path += shorten(*f.key);
      } else {
        path += '[' + std::to_string(f.index) + ']';
      }
    }
    return path;
  }

  static bool is_integer_literal(std::string_view token) {
    return token.find_first_of(".eE") == std::string_view::npos;
  }

  // Records a number the config cannot hold and stops. The lexer has read the number and,
  // unless it ends the text, the character after it.
  bool number_error(std::string_view token) {
    size_t end = offset();
    size_t start = end - std::min(end, token.size());
    if (end > token.size() && text_.substr(end - token.size() - 1, token.size()) == token) {
      start = end - token.size() - 1;
    }
    std::string what = is_integer_literal(token)
                           ? "is an integer beyond 64 bits; allowed: "
                             "-9223372036854775808..18446744073709551615"
                           : "is beyond the range of a double (about 1.8e308)";
    return stop(value_path(), "numeric overflow at " + at_line_column(text_, start) + ": " +
                                  shorten(token) + " " + what);
  }

  bool stop(std::string path, std::string message) {
    out_.errors.push_back({std::move(path), std::move(message)});
    return false;  // stops the parse
  }

  std::string_view text_;
  const char* const& read_end_;
  LenientParse& out_;
  Json root_;
  std::vector<Frame> frames_;
  Json* slot_ = nullptr;  // in an object: where the current key's value goes (nullptr: dropped)
  size_t listed_duplicates_ = 0;
};

bool DomBuilder::key(std::string& k) {
  Frame& f = frames_.back();
  auto [it, inserted] = f.keys.insert(k);
  f.key = &*it;
  slot_ = nullptr;
  if (!inserted) {
    if (listed_duplicates_ < kMaxListedPerKind) {
      ++listed_duplicates_;
      out_.errors.push_back({value_path(), std::string(kDuplicateKeyMessage)});
    } else {
      ++out_.unlisted_duplicates;
    }
    return true;  // its value is read and dropped: the first one stays
  }
  if (!f.container) return true;
  // Appended without ordered_map's linear search for the key: `keys` ruled a duplicate out.
  Json::object_t& object = f.container->get_ref<Json::object_t&>();
  static_cast<Json::object_t::Container&>(object).emplace_back(std::move(k), nullptr);
  slot_ = &object.back().second;
  return true;
}

bool DomBuilder::parse_error(size_t position, const std::string& last_token,
                             const nlohmann::detail::exception& e) {
  // 406: a number whose value is beyond the range of a double (1e400).
  if (e.id == 406) return number_error(last_token);
  // `position` is 1-based: the position of the character that could not be parsed.
  std::string what = e.what();
  bool broken_literal = what.find("; last read:") != std::string::npos;
  size_t start = token_start(text_, position == 0 ? 0 : position - 1, broken_literal);
  return stop(
      "", "malformed JSON at " + at_line_column(text_, start) + ": " + describe_parse_error(what));
}

}  // namespace

std::string blank_trailing_commas(std::string_view text) {
  std::string out(text);
  char last_significant = 0;
  size_t i = 0;
  while (i < text.size()) {
    size_t next = skip_blank(text, i, /*hash=*/false);
    if (next != i) {
      i = next;
      continue;
    }
    char c = text[i];
    if (c == '#') {  // hjson's line comment, which nlohmann does not know: blanked
      while (i < text.size() && text[i] != '\n') out[i++] = ' ';
      continue;
    }
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
  // The parser takes a NUL byte for the end of the text: what follows would be dropped unread.
  if (const size_t nul = text.find('\0'); nul != std::string_view::npos) {
    result.errors.push_back({"", "malformed JSON at " + at_line_column(text, nul) +
                                     ": a NUL byte (JSON text holds none; nothing after it "
                                     "would be read)"});
    result.value = Json(nullptr);
    return result;
  }
  // Commas become spaces: offsets in `cleaned` are offsets in `text`.
  std::string cleaned = blank_trailing_commas(text);
  const char* read_end = cleaned.data();
  DomBuilder builder(cleaned, read_end, result);
  bool ok = Json::sax_parse(TrackingIterator(cleaned.data(), &read_end),
                            TrackingIterator(cleaned.data() + cleaned.size(), &read_end), &builder,
                            nlohmann::detail::input_format_t::json, /*strict=*/true,
                            /*ignore_comments=*/true);
  result.value = ok ? builder.take_value() : Json(nullptr);
  return result;
}

}  // namespace outcore::config::detail
