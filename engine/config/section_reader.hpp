// Internal: reads one JSON object of the config key by key, converting and checking each
// value, collecting errors and warnings instead of stopping at the first. Keys nobody asked
// for become "unknown key" warnings in finish().
#pragma once

#include <cstdint>
#include <initializer_list>
#include <limits>
#include <nlohmann/json.hpp>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "engine/config/config.hpp"

namespace outcore::config::detail {

using Json = nlohmann::ordered_json;

// Errors and warnings of one parse, in the order found.
struct Diagnostics {
  std::vector<ConfigIssue> errors;
  std::vector<ConfigIssue> warnings;
  // Unknown keys past the first kMaxListedPerKind of a section: counted, not listed.
  size_t unlisted_unknown_keys = 0;
  void error(std::string path, std::string message) {
    errors.push_back({std::move(path), std::move(message)});
  }
  void warn(std::string path, std::string message) {
    warnings.push_back({std::move(path), std::move(message)});
  }
};

// A short rendering of a JSON value for messages: "4", "\"fast\"", "[1,2]", "an object".
std::string show(const Json& v);

// "a.b" from "a" and "b"; "b" when the parent path is empty.
std::string join_path(std::string_view parent, std::string_view key);

struct IntRange {
  int64_t min = std::numeric_limits<int64_t>::min();
  int64_t max = std::numeric_limits<int64_t>::max();
  std::string describe() const;  // "an integer >= 1", "an integer in 0..3"
};

struct RealRange {
  double min = -std::numeric_limits<double>::infinity();
  double max = std::numeric_limits<double>::infinity();
  bool min_exclusive = false;
  bool max_exclusive = false;
  std::string describe() const;  // "a number > 0", "a number in [0, 1]"
};

// Conversions of one value; on failure they record an error at `path` and return nullopt.
std::optional<bool> to_bool(const Json& v, const std::string& path, Diagnostics& d);
std::optional<int64_t> to_int(const Json& v, const std::string& path, const IntRange& r,
                              Diagnostics& d);
std::optional<double> to_real(const Json& v, const std::string& path, const RealRange& r,
                              Diagnostics& d);

class SectionReader {
 public:
  // `obj` is the section's JSON object, or nullptr when the section is absent (every
  // getter then leaves its output alone). `auto_means_default`: a key set to "auto" keeps
  // its default, as in DeepSpeed's typed sections; otherwise "auto" is an error except
  // through get_auto().
  SectionReader(const Json* obj, std::string path, Diagnostics& d, bool auto_means_default);

  const std::string& path() const { return path_; }
  std::string key_path(std::string_view key) const { return join_path(path_, key); }
  Diagnostics& diagnostics() { return d_; }

  // The value of `key` (marking it known), or nullptr when absent.
  const Json* take(std::string_view key);

  // The first present key of `names` (all marked known) and its name; nullptr when none.
  // Two or more present with different values is an error naming them.
  std::pair<const Json*, std::string> take_one_of(std::initializer_list<std::string_view> names);

  // Typed getters: when `key` is present and valid, store it in `out` and return true.
  // Absent: false, `out` untouched. Invalid: error recorded, false. A null value counts as
  // absent only for the optional overloads.
  bool get(std::string_view key, bool& out);
  bool get(std::string_view key, int64_t& out, const IntRange& r = {});
  bool get(std::string_view key, int& out, const IntRange& r);
  bool get(std::string_view key, uint64_t& out);
  bool get(std::string_view key, double& out, const RealRange& r = {});
  bool get(std::string_view key, std::string& out, bool null_is_empty);
  bool get(std::string_view key, std::optional<int64_t>& out, const IntRange& r = {});
  bool get(std::string_view key, std::optional<double>& out, const RealRange& r = {});
  // Case-insensitive choice among `choices`; the error lists them.
  template <typename E>
  bool get_enum(std::string_view key, E& out,
                std::initializer_list<std::pair<std::string_view, E>> choices);

  // Values that may be "auto"; null means unset.
  bool get_auto(std::string_view key, AutoOr<bool>& out);
  bool get_auto(std::string_view key, AutoOr<int64_t>& out, const IntRange& r);
  bool get_auto(std::string_view key, AutoOr<double>& out, const RealRange& r);

  // Keys DeepSpeed knows and outcore does not implement: accepted; a warning when the
  // value differs from DeepSpeed's default `ds_default`.
  void ignore(std::string_view key, const Json& ds_default);

  // Records "got <v>; allowed: \"a\", \"b\" or \"c\"" for `key`.
  void enum_error(std::string_view key, const Json& v, const std::vector<std::string_view>& names);

  // Records an "unknown key" warning (kUnknownKeyMessage) for each of the first
  // kMaxListedPerKind keys not taken, with a suggestion when a known key is spelled alike,
  // and counts the others in Diagnostics::unlisted_unknown_keys. Linear in the keys.
  void finish();

 private:
  // The value of `key` prepared for a typed getter: nullptr when absent, or when "auto"
  // in a section where "auto" means the default.
  const Json* fetch(std::string_view key);

  const Json* obj_;
  std::string path_;
  Diagnostics& d_;
  bool auto_means_default_;
  std::vector<std::string> known_;
};

inline constexpr std::string_view kUnknownKeyMessage = "unknown key; ignored";
// True for the warnings finish() records.
bool is_unknown_key(const ConfigIssue& issue);

bool is_auto_string(const Json& v);
std::string lower(std::string_view s);

template <typename E>
bool SectionReader::get_enum(std::string_view key, E& out,
                             std::initializer_list<std::pair<std::string_view, E>> choices) {
  const Json* v = fetch(key);
  if (!v) return false;
  if (v->is_string()) {
    std::string s = lower(v->get<std::string>());
    for (const auto& [name, value] : choices) {
      if (lower(name) == s) {
        out = value;
        return true;
      }
    }
  }
  std::vector<std::string_view> names;
  for (const auto& c : choices) names.push_back(c.first);
  enum_error(key, *v, names);
  return false;
}

}  // namespace outcore::config::detail
