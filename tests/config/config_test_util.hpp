// Helpers shared by the engine/config tests.
#pragma once

#include <gtest/gtest.h>

#include <string>
#include <string_view>
#include <vector>

#include "engine/config/config.hpp"

namespace outcore::config::testing {

inline std::string source_path(std::string_view rel) {
  return std::string(OUTCORE_SOURCE_DIR) + "/" + std::string(rel);
}

// The issues of a config that must fail to parse; a parse that succeeds fails the test.
inline std::vector<ConfigIssue> parse_errors(std::string_view text) {
  try {
    parse_config(text, "test.json");
  } catch (const ConfigValidationError& e) {
    return e.issues();
  }
  ADD_FAILURE() << "expected a ConfigValidationError for:\n" << text;
  return {};
}

// The issues thrown by `fn` (a resolve step); success fails the test.
template <typename Fn>
std::vector<ConfigIssue> errors_of(Fn fn) {
  try {
    fn();
  } catch (const ConfigValidationError& e) {
    return e.issues();
  }
  ADD_FAILURE() << "expected a ConfigValidationError";
  return {};
}

// True when some issue has this exact path and a message containing `fragment`.
inline bool has_issue(const std::vector<ConfigIssue>& issues, std::string_view path,
                      std::string_view fragment) {
  for (const ConfigIssue& i : issues) {
    if (i.json_path == path && i.message.find(fragment) != std::string::npos) return true;
  }
  return false;
}

inline std::string dump(const std::vector<ConfigIssue>& issues) {
  std::string s;
  for (const ConfigIssue& i : issues) s += "  " + i.to_string() + "\n";
  return s;
}

}  // namespace outcore::config::testing
