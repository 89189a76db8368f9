// JSON text -> nlohmann::json in time linear in the text, with a nesting limit and, optionally,
// each object's keys checked unique. json::parse with a callback (the usual way to bound the
// nesting) rescans an object's members after every member that is itself an object: quadratic in
// the members, hours for a file of a million small objects. Header-only; the users link
// nlohmann_json.
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

// Thrown by parse_json_dom when the text nests deeper than its limit.
struct JsonTooDeep : std::length_error {
  using std::length_error::length_error;
};

struct JsonDomOptions {
  int max_depth = 0;  // objects and arrays nested at most this deep (0: no limit)
  // Called for a key an object already has, with the key and the name of the object (the key
  // it is the value of; "" for the root or an object in an array); what it throws ends the
  // parse. Empty: a repeated key replaces the earlier value, as json::parse does.
  std::function<void(const std::string& key, const std::string& object)> on_repeated_key;
};

namespace detail {

class DomSax {
 public:
  using json = nlohmann::json;
  DomSax(json& root, const JsonDomOptions& options) : dom_(root, true), options_(options) {}
  bool null() { return dom_.null(); }
  bool boolean(bool v) { return dom_.boolean(v); }
  bool number_integer(json::number_integer_t v) { return dom_.number_integer(v); }
  bool number_unsigned(json::number_unsigned_t v) { return dom_.number_unsigned(v); }
  bool number_float(json::number_float_t v, const json::string_t& text) {
    return dom_.number_float(v, text);
  }
  bool string(json::string_t& v) { return dom_.string(v); }
  bool binary(json::binary_t& v) { return dom_.binary(v); }
  bool start_object(std::size_t n) {
    enter();
    if (options_.on_repeated_key) open_.push_back({std::exchange(last_key_, {}), {}});
    return dom_.start_object(n);
  }
  bool key(json::string_t& k) {
    if (options_.on_repeated_key) {
      if (!open_.back().keys.insert(k).second) options_.on_repeated_key(k, open_.back().name);
      last_key_ = k;
    }
    return dom_.key(k);
  }
  bool end_object() {
    --depth_;
    if (options_.on_repeated_key) open_.pop_back();
    return dom_.end_object();
  }
  bool start_array(std::size_t n) {
    enter();
    last_key_.clear();
    return dom_.start_array(n);
  }
  bool end_array() {
    --depth_;
    return dom_.end_array();
  }
  bool parse_error(std::size_t position, const std::string& token,
                   const nlohmann::detail::exception& e) {
    return dom_.parse_error(position, token, e);
  }

 private:
  struct OpenObject {
    std::string name;
    std::set<std::string, std::less<>> keys;
  };
  void enter() {
    if (++depth_ > options_.max_depth && options_.max_depth > 0)
      throw JsonTooDeep("JSON nested deeper than " + std::to_string(options_.max_depth));
  }

  nlohmann::detail::json_sax_dom_parser<json> dom_;
  const JsonDomOptions& options_;
  int depth_ = 0;
  std::vector<OpenObject> open_;
  std::string last_key_;
};

}  // namespace detail

// Parses `text` as json::parse does (throwing its exceptions for malformed text and numbers out
// of range), JsonTooDeep past options.max_depth, and what options.on_repeated_key throws.
inline nlohmann::json parse_json_dom(std::string_view text, const JsonDomOptions& options = {}) {
  nlohmann::json root;
  detail::DomSax sax(root, options);
  nlohmann::json::sax_parse(text, &sax);
  return root;
}

}  // namespace outcore
