// Internal: puts the issues of a parse in the order their keys appear in the file.
#pragma once

#include <vector>

#include "engine/config/config.hpp"
#include "engine/config/section_reader.hpp"

namespace outcore::config::detail {

// Sorts `errors` and `warnings` (each stably) by the position in `doc` of their JSON paths.
// A path not in `doc` (a missing key) is placed at its nearest enclosing key that is, so a
// problem with a section comes before the problems inside it. Paths are matched down to 8
// object levels; deeper ones (only duplicate keys go deeper) are placed at their ancestor
// at that depth. Time is linear in the size of `doc` plus the total length of the paths
// times a small constant.
void sort_by_file_order(const Json& doc, std::vector<ConfigIssue>& errors,
                        std::vector<ConfigIssue>& warnings);

}  // namespace outcore::config::detail
