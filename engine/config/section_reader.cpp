#include "engine/config/section_reader.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <type_traits>

#include "engine/config/section_parsers.hpp"

namespace outcore::config::detail {
namespace {

size_t edit_distance(std::string_view a, std::string_view b) {
  std::vector<size_t> row(b.size() + 1);
  for (size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (size_t i = 1; i <= a.size(); ++i) {
    size_t diagonal = row[0];
    row[0] = i;
    for (size_t j = 1; j <= b.size(); ++j) {
      size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diagonal + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diagonal = up;
    }
  }
  return row[b.size()];
}

std::string real_string(double x) { return fmt::format("{}", x); }

std::string got(const Json& v, const std::string& allowed) {
  return "got " + show(v) + "; allowed: " + allowed;
}

}  // namespace

std::string lower(std::string_view s) {
  std::string out(s);
  for (char& c : out) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return out;
}

bool is_auto_string(const Json& v) {
  return v.is_string() && lower(v.get<std::string>()) == "auto";
}

std::string show(const Json& v) {
  if (v.is_object()) return "an object";
  std::string s = v.dump();
  if (s.size() > 60) s = s.substr(0, 57) + "...";
  return s;
}

// A key as messages show it: as it is when short and printable; else JSON-escaped (no control
// byte reaches the terminal) and cut to its first 60 bytes, with its length.
std::string display_key(std::string_view key) {
  constexpr size_t kShown = 60, kPlainMax = 80;
  const bool plain = key.size() <= kPlainMax && std::none_of(key.begin(), key.end(), [](char c) {
                       return static_cast<unsigned char>(c) < 0x20 || c == 0x7f;
                     });
  if (plain) return std::string(key);
  std::string shown = nlohmann::json(std::string(key.substr(0, kShown)))
                          .dump(-1, ' ', false, nlohmann::json::error_handler_t::replace);
  if (key.size() > kShown) shown += fmt::format("... ({} bytes)", key.size());
  return shown;
}

std::string join_path(std::string_view parent, std::string_view key) {
  if (parent.empty()) return display_key(key);
  return std::string(parent) + "." + display_key(key);
}

std::string IntRange::describe() const {
  constexpr int64_t lo = std::numeric_limits<int64_t>::min();
  constexpr int64_t hi = std::numeric_limits<int64_t>::max();
  if (min == lo && max == hi) return "an integer";
  if (max == hi) return fmt::format("an integer >= {}", min);
  if (min == lo) return fmt::format("an integer <= {}", max);
  return fmt::format("an integer in {}..{}", min, max);
}

std::string RealRange::describe() const {
  bool has_min = std::isfinite(min), has_max = std::isfinite(max);
  if (!has_min && !has_max) return "a number";
  if (!has_max) return "a number " + std::string(min_exclusive ? "> " : ">= ") + real_string(min);
  if (!has_min) return "a number " + std::string(max_exclusive ? "< " : "<= ") + real_string(max);
  return "a number in " + std::string(min_exclusive ? "(" : "[") + real_string(min) + ", " +
         real_string(max) + (max_exclusive ? ")" : "]");
}

std::optional<bool> to_bool(const Json& v, const std::string& path, Diagnostics& d) {
  if (v.is_boolean()) return v.get<bool>();
  if (v.is_string()) {
    std::string s = lower(v.get<std::string>());
    if (s == "true") return true;
    if (s == "false") return false;
  }
  d.error(path, got(v, "true or false"));
  return std::nullopt;
}

std::optional<int64_t> to_int(const Json& v, const std::string& path, const IntRange& r,
                              Diagnostics& d) {
  std::optional<int64_t> x;
  if (v.is_number_unsigned()) {
    uint64_t u = v.get<uint64_t>();
    if (u <= static_cast<uint64_t>(std::numeric_limits<int64_t>::max()))
      x = static_cast<int64_t>(u);
  } else if (v.is_number_integer()) {
    x = v.get<int64_t>();
  } else if (v.is_number_float()) {
    // Integers are often written as floats (2e8): accept any integral value in range.
    double f = v.get<double>();
    if (std::isfinite(f) && std::floor(f) == f && f >= -9.2233720368547758e18 &&
        f < 9.2233720368547758e18) {
      x = static_cast<int64_t>(f);
    }
  }
  if (!x || *x < r.min || *x > r.max) {
    d.error(path, got(v, r.describe()));
    return std::nullopt;
  }
  return x;
}

std::optional<double> to_real(const Json& v, const std::string& path, const RealRange& r,
                              Diagnostics& d) {
  if (v.is_number()) {
    double x = v.get<double>();
    bool low_ok = r.min_exclusive ? x > r.min : x >= r.min;
    bool high_ok = r.max_exclusive ? x < r.max : x <= r.max;
    if (std::isfinite(x) && low_ok && high_ok) return x;
  }
  d.error(path, got(v, r.describe()));
  return std::nullopt;
}

SectionReader::SectionReader(const Json* obj, std::string path, Diagnostics& d,
                             bool auto_means_default)
    : obj_(obj), path_(std::move(path)), d_(d), auto_means_default_(auto_means_default) {}

const Json* SectionReader::take(std::string_view key) {
  known_.emplace_back(key);
  if (!obj_) return nullptr;
  auto it = obj_->find(key);
  return it == obj_->end() ? nullptr : &*it;
}

std::pair<const Json*, std::string> SectionReader::take_one_of(
    std::initializer_list<std::string_view> names) {
  std::pair<const Json*, std::string> first{nullptr, ""};
  std::vector<std::string> present;
  bool all_equal = true;
  for (std::string_view name : names) {
    const Json* v = take(name);
    if (!v) continue;
    present.emplace_back(name);
    if (!first.first) first = {v, std::string(name)};
    all_equal = all_equal && *v == *first.first;
  }
  if (present.size() > 1 && !all_equal) {
    std::string list;
    for (size_t i = 0; i < present.size(); ++i) list += (i ? " and " : "") + present[i];
    d_.error(key_path(present[1]),
             "given together with " + present[0] + " (" + list +
                 " are names for the same setting with different values; keep one)");
  }
  return first;
}

const Json* SectionReader::fetch(std::string_view key) {
  const Json* v = take(key);
  if (v && auto_means_default_ && is_auto_string(*v)) {
    // As in DeepSpeed's sections: "auto" is the key's default. Said, since nothing fills it.
    d_.warn(key_path(key), "\"auto\" takes the default here (nothing fills this key)");
    return nullptr;
  }
  return v;
}

bool SectionReader::get(std::string_view key, bool& out) {
  const Json* v = fetch(key);
  if (!v) return false;
  auto b = to_bool(*v, key_path(key), d_);
  if (b) out = *b;
  return b.has_value();
}

bool SectionReader::get(std::string_view key, int64_t& out, const IntRange& r) {
  const Json* v = fetch(key);
  if (!v) return false;
  auto x = to_int(*v, key_path(key), r, d_);
  if (x) out = *x;
  return x.has_value();
}

bool SectionReader::get(std::string_view key, int& out, const IntRange& r) {
  IntRange clamped{std::max<int64_t>(r.min, std::numeric_limits<int>::min()),
                   std::min<int64_t>(r.max, std::numeric_limits<int>::max())};
  int64_t x = out;
  if (!get(key, x, clamped)) return false;
  out = static_cast<int>(x);
  return true;
}

bool SectionReader::get(std::string_view key, uint64_t& out) {
  int64_t x = 0;
  if (!get(key, x, IntRange{0})) return false;
  out = static_cast<uint64_t>(x);
  return true;
}

bool SectionReader::get(std::string_view key, double& out, const RealRange& r) {
  const Json* v = fetch(key);
  if (!v) return false;
  auto x = to_real(*v, key_path(key), r, d_);
  if (x) out = *x;
  return x.has_value();
}

bool SectionReader::get(std::string_view key, std::string& out, bool null_is_empty) {
  const Json* v = fetch(key);
  if (!v) return false;
  if (v->is_null() && null_is_empty) {
    out.clear();
    return true;
  }
  if (!v->is_string()) {
    d_.error(key_path(key), got(*v, null_is_empty ? "a string or null" : "a string"));
    return false;
  }
  const std::string& text = v->get_ref<const std::string&>();
  if (text.find('\0') != std::string::npos) {  // a path would end there for the system
    d_.error(key_path(key), fmt::format("{} holds a NUL character (\\u0000), which no path or "
                                        "name can hold",
                                        show(*v)));
    return false;
  }
  out = text;
  return true;
}

bool SectionReader::get(std::string_view key, std::optional<int64_t>& out, const IntRange& r) {
  const Json* v = fetch(key);
  if (!v) return false;
  if (v->is_null()) {
    out.reset();
    return true;
  }
  auto x = to_int(*v, key_path(key), r, d_);
  if (x) out = *x;
  return x.has_value();
}

bool SectionReader::get(std::string_view key, std::optional<double>& out, const RealRange& r) {
  const Json* v = fetch(key);
  if (!v) return false;
  if (v->is_null()) {
    out.reset();
    return true;
  }
  auto x = to_real(*v, key_path(key), r, d_);
  if (x) out = *x;
  return x.has_value();
}

namespace {

// Shared body of the get_auto overloads: "auto" marks it; null unsets a value that has no
// default; anything else goes through `convert`.
template <typename T, typename Convert>
bool read_auto(const Json* v, const std::string& path, AutoOr<T>& out, Diagnostics& d,
               const std::string& allowed, Convert convert) {
  constexpr bool strings_convert = std::is_same_v<T, bool>;  // "true" / "false"
  if (!v) return false;
  if (is_auto_string(*v)) {
    out.set_auto();
    return true;
  }
  if (v->is_null() && out.is_unset()) return false;
  if (v->is_null() || (v->is_string() && !strings_convert)) {
    d.error(path, got(*v, allowed + " or \"auto\""));
    return false;
  }
  auto x = convert(*v);
  if (x) out.set(*x);
  return x.has_value();
}

}  // namespace

bool SectionReader::get_auto(std::string_view key, AutoOr<bool>& out) {
  std::string p = key_path(key);
  return read_auto(take(key), p, out, d_, "true, false",
                   [&](const Json& v) { return to_bool(v, p, d_); });
}

bool SectionReader::get_auto(std::string_view key, AutoOr<int64_t>& out, const IntRange& r) {
  std::string p = key_path(key);
  return read_auto(take(key), p, out, d_, r.describe(),
                   [&](const Json& v) { return to_int(v, p, r, d_); });
}

bool SectionReader::get_auto(std::string_view key, AutoOr<double>& out, const RealRange& r) {
  std::string p = key_path(key);
  return read_auto(take(key), p, out, d_, r.describe(),
                   [&](const Json& v) { return to_real(v, p, r, d_); });
}

void SectionReader::ignore(std::string_view key, const Json& ds_default) {
  const Json* v = take(key);
  if (!v || *v == ds_default || is_auto_string(*v)) return;
  d_.warn(key_path(key), "set to " + show(*v) +
                             ", but outcore does not implement this DeepSpeed setting; it is "
                             "ignored (default " +
                             show(ds_default) + ")");
}

void SectionReader::enum_error(std::string_view key, const Json& v,
                               const std::vector<std::string_view>& names) {
  std::string allowed;
  for (size_t i = 0; i < names.size(); ++i) {
    if (i > 0) allowed.append(i + 1 == names.size() ? " or " : ", ");
    allowed.append(fmt::format("\"{}\"", names[i]));
  }
  d_.error(key_path(key), got(v, allowed));
}

bool is_unknown_key(const ConfigIssue& issue) {
  return issue.message.starts_with(kUnknownKeyMessage);
}

void SectionReader::finish() {
  if (!obj_) return;
  size_t listed = 0;
  for (const auto& [key, value] : obj_->items()) {
    if (std::find(known_.begin(), known_.end(), key) != known_.end()) continue;
    if (listed == kMaxListedPerKind) {
      ++d_.unlisted_unknown_keys;
      continue;
    }
    ++listed;
    std::string message(kUnknownKeyMessage);
    // Suggest a known key within this edit distance. The distance is at least the length
    // difference, so a key much longer than every known key costs no comparison.
    size_t best = std::max<size_t>(2, key.size() / 4) + 1;
    std::string suggestion;
    std::string lower_key;
    for (const std::string& k : known_) {
      size_t length_gap = key.size() > k.size() ? key.size() - k.size() : k.size() - key.size();
      if (length_gap >= best) continue;
      if (lower_key.empty()) lower_key = lower(key);
      size_t dist = edit_distance(lower_key, lower(k));
      if (dist < best) {
        best = dist;
        suggestion = k;
      }
    }
    if (!suggestion.empty()) message += " (did you mean \"" + suggestion + "\"?)";
    d_.warn(key_path(key), message);
  }
}

const Json* object_at(SectionReader& parent, std::string_view key) {
  const Json* v = parent.take(key);
  if (!v || v->is_null()) return nullptr;
  if (!v->is_object()) {
    parent.diagnostics().error(parent.key_path(key), got(*v, "an object"));
    return nullptr;
  }
  return v;
}

}  // namespace outcore::config::detail
