// Internal: DeepSpeed's lenient JSON dialect on top of nlohmann::json.
// Comments (// and /* */, and hjson's #, as DeepSpeed reads configs with hjson) and trailing
// commas are accepted; duplicate keys are reported
// by their JSON path; a syntax error is reported with its line and column. Time and memory
// are linear in the size of the text: nesting is bounded by kMaxConfigDepth and duplicate
// keys past kMaxListedPerKind are counted, not listed.
#pragma once

#include <cstddef>
#include <nlohmann/json.hpp>
#include <string>
#include <string_view>
#include <vector>

#include "engine/config/config.hpp"

namespace outcore::config::detail {

inline constexpr std::string_view kDuplicateKeyMessage = "duplicate key (each key may appear once)";

struct LenientParse {
  nlohmann::ordered_json value;     // null when `errors` holds a syntax error or a limit
  std::vector<ConfigIssue> errors;  // one syntax / depth / number error at most, duplicate keys
  size_t unlisted_duplicates = 0;   // duplicate keys found past the first kMaxListedPerKind
};

// Parses `text`. Never throws for bad input: every problem is returned in `errors`. Errors
// that stop the parse (the value is then null): malformed JSON, nesting deeper than
// kMaxConfigDepth, a number beyond the range of a double or an integer literal beyond
// 64 bits (named by its JSON path); each gives the line and column.
LenientParse parse_lenient_json(std::string_view text);

// Returns `text` with every comma that directly precedes `}` or `]` (ignoring whitespace
// and comments between them), and every # comment (to the end of its line), replaced by
// spaces, so byte offsets are unchanged. Commas and # in strings and comments are left alone.
std::string blank_trailing_commas(std::string_view text);

// 1-based line and column of the byte at 0-based `offset` (clamped to the text).
struct LineColumn {
  size_t line;
  size_t column;
};
LineColumn line_column(std::string_view text, size_t offset);

}  // namespace outcore::config::detail
