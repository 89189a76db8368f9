// Internal: DeepSpeed's lenient JSON dialect on top of nlohmann::json.
// Comments (// and /* */) and trailing commas are accepted; duplicate keys are reported
// by their JSON path; a syntax error is reported with its line and column.
#pragma once

#include <cstddef>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "engine/config/config.hpp"

namespace outcore::config::detail {

struct LenientParse {
  nlohmann::ordered_json value;     // discarded (null) when `errors` holds a syntax error
  std::vector<ConfigIssue> errors;  // syntax error (at most one) and duplicate keys
};

// Parses `text`. Never throws for bad input: every problem is returned in `errors`.
LenientParse parse_lenient_json(std::string_view text);

// Returns `text` with every comma that directly precedes `}` or `]` (ignoring whitespace
// and comments between them) replaced by a space, so byte offsets are unchanged. Commas in
// strings and comments are left alone.
std::string blank_trailing_commas(std::string_view text);

// 1-based line and column of the byte at 0-based `offset` (clamped to the text).
struct LineColumn {
  size_t line;
  size_t column;
};
LineColumn line_column(std::string_view text, size_t offset);

}  // namespace outcore::config::detail
