// JSON text -> nlohmann::json in time linear in the text, with a nesting limit and, optionally,
// each object's keys checked unique, through nlohmann's public interfaces only. json::parse with a
// callback (the usual way to bound the nesting) rescans an object's members after every member that
// is itself an object: quadratic in the members, hours for a file of a million small objects.
// Header-only; the users link nlohmann_json.
#pragma once

#include <cstddef>
#include <functional>
#include <nlohmann/json.hpp>
#include <set>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace outcore {

// Thrown by parse_json_dom for text json::parse would misread rather than reject: nested deeper
// than the limit, or holding a NUL byte (nlohmann's lexer takes it for the end of the text and
// drops what follows unread).
struct JsonRefused : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct JsonDomOptions {
  int max_depth = 0;  // objects and arrays nested at most this deep (0: no limit)
  // Called for a key an object already has, with the key and the name of the object (the key
  // it is the value of; "" for the root or an object in an array); what it throws ends the
  // parse. Empty: a repeated key replaces the earlier value, as json::parse does.
  std::function<void(const std::string& key, const std::string& object)> on_repeated_key;
};

namespace detail {

// The first pass: nlohmann's public SAX interface, building nothing, checking the nesting and
// the keys. A syntax error ends it quietly (json::parse then reports it, exactly).
class JsonDomChecks : public nlohmann::json_sax<nlohmann::json> {
 public:
  using json = nlohmann::json;
  explicit JsonDomChecks(const JsonDomOptions& options) : options_(options) {}
  bool null() override { return true; }
  bool boolean(bool) override { return true; }
  bool number_integer(number_integer_t) override { return true; }
  bool number_unsigned(number_unsigned_t) override { return true; }
  bool number_float(number_float_t, const string_t&) override { return true; }
  bool string(string_t&) override { return true; }
  bool binary(binary_t&) override { return true; }
  bool start_object(std::size_t) override {
    enter();
    if (options_.on_repeated_key) open_.push_back({std::exchange(last_key_, {}), {}});
    return true;
  }
  bool key(string_t& k) override {
    if (options_.on_repeated_key) {
      if (!open_.back().keys.insert(k).second) options_.on_repeated_key(k, open_.back().name);
      last_key_ = k;
    }
    return true;
  }
  bool end_object() override {
    --depth_;
    if (options_.on_repeated_key) open_.pop_back();
    return true;
  }
  bool start_array(std::size_t) override {
    enter();
    last_key_.clear();
    return true;
  }
  bool end_array() override {
    --depth_;
    return true;
  }
  bool parse_error(std::size_t, const std::string&, const nlohmann::detail::exception&) override {
    return false;
  }

 private:
  struct OpenObject {
    std::string name;
    std::set<std::string, std::less<>> keys;
  };
  void enter() {
    if (++depth_ > options_.max_depth && options_.max_depth > 0)
      throw JsonRefused("objects and arrays nested deeper than " +
                        std::to_string(options_.max_depth) + " levels");
  }

  const JsonDomOptions& options_;
  int depth_ = 0;
  std::vector<OpenObject> open_;
  std::string last_key_;
};

}  // namespace detail

// Objects and arrays nested at most this deep in the JSON files outcore reads (tokenizers,
// safetensors headers and indexes, checkpoint manifests and state): far more than any real one
// holds (under 10), and few enough for the recursive readers of tokenizer.json and for dump().
inline constexpr int kMaxJsonFileDepth = 128;

// A short description of a JSON value for an error message: scalars as JSON (a string cut at
// 64 bytes), a small flat array or object as JSON ([1, 2]), anything else as its kind and size
// ("an array of 3000 elements"). Never recursive, so never deeper than the value's first level.
inline std::string json_brief(const nlohmann::json& v) {
  constexpr size_t kMaxString = 64;
  constexpr size_t kMaxMembers = 8;
  if (v.is_string()) {
    const std::string& s = v.get_ref<const std::string&>();
    if (s.size() <= kMaxString) return v.dump();
    return nlohmann::json(s.substr(0, kMaxString))
               .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace) +
           "... (" + std::to_string(s.size()) + " bytes)";
  }
  if (!v.is_structured()) return v.dump();
  bool flat = v.size() <= kMaxMembers;
  for (const nlohmann::json& m : v) {
    if (!flat) break;
    flat = !m.is_structured() &&
           (!m.is_string() || m.get_ref<const std::string&>().size() <= kMaxString);
  }
  if (v.is_object())
    for (const auto& [key, value] : v.items()) flat = flat && key.size() <= kMaxString;
  if (flat) return v.dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  const std::string n = std::to_string(v.size());
  return v.is_array() ? "an array of " + n + " elements" : "an object of " + n + " members";
}

// nlohmann's message without its "[json.exception.parse_error.101] " prefix: what is wrong and
// where ("parse error at line 1, column 16: syntax error ...").
inline std::string json_message(const nlohmann::json::exception& e) {
  const std::string m = e.what();
  const size_t close = m.rfind("] ", m.find(' '));
  const std::string_view text = m.rfind("[json.exception.", 0) == 0 && close != std::string::npos
                                    ? std::string_view(m).substr(close + 2)
                                    : std::string_view(m);
  // The text the parser last read is quoted as it was: control characters and bytes that are
  // not UTF-8 are shown as \xNN, never written to a terminal as they are.
  std::string shown;
  for (size_t i = 0; i < text.size();) {
    const auto b = static_cast<unsigned char>(text[i]);
    size_t n = b < 0x80                 ? 1
               : b >= 0xC2 && b <= 0xDF ? 2
               : b >= 0xE0 && b <= 0xEF ? 3
               : b >= 0xF0 && b <= 0xF4 ? 4
                                        : 0;
    for (size_t k = 1; k < n; ++k)
      if (i + k >= text.size() || (static_cast<unsigned char>(text[i + k]) & 0xC0) != 0x80) n = 0;
    if (n == 0 || (n == 1 && (b < 0x20 || b == 0x7f))) {
      static constexpr char kHex[] = "0123456789abcdef";
      shown += {'\\', 'x', kHex[b >> 4], kHex[b & 15]};
      ++i;
    } else {
      shown.append(text.substr(i, n));
      i += n;
    }
  }
  return shown;
}

// Parses `text` as json::parse does (throwing its exceptions for malformed text and numbers out
// of range), JsonRefused past options.max_depth or for a NUL byte, and what options.on_repeated_key
// throws. Two passes, both linear: the checks, then json::parse without a callback.
inline nlohmann::json parse_json_dom(std::string_view text, const JsonDomOptions& options = {}) {
  if (const size_t nul = text.find('\0'); nul != std::string_view::npos)
    throw JsonRefused("a NUL byte at byte " + std::to_string(nul) +
                      " (JSON text holds none; nothing after it would be read)");
  detail::JsonDomChecks checks(options);
  nlohmann::json::sax_parse(text, &checks);
  return nlohmann::json::parse(text);
}

// A JSON file's text parsed by parse_json_dom, every refusal (JsonRefused, a syntax error, a
// number out of range) said in one message, "<where>: <why>" ("<where>: not valid JSON: ..." for
// what json::parse rejects), which `refuse` throws as the caller's error (CorruptData for
// outcore's own files, ConfigError for a user's). `refuse` must throw.
template <class Refuse>
nlohmann::json parse_json_file(std::string_view text, const std::string& where,
                               const JsonDomOptions& options, Refuse&& refuse) {
  try {
    return parse_json_dom(text, options);
  } catch (const JsonRefused& e) {
    refuse(where + ": " + e.what());
  } catch (const nlohmann::json::exception& e) {  // parse errors, numbers out of range (1e400)
    refuse(where + ": not valid JSON: " + json_message(e));
  }
  throw std::logic_error("parse_json_file: refuse returned");
}

}  // namespace outcore
