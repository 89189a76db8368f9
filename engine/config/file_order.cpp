#include "engine/config/file_order.hpp"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

namespace outcore::config::detail {
namespace {

constexpr int kIndexedDepth = 8;
constexpr size_t kNotFound = std::numeric_limits<size_t>::max();

// FNV-1a, continued from `h`: a path's hash can be extended by a child key without
// building the child's path.
uint64_t fnv1a(std::string_view s, uint64_t h = 14695981039346656037ull) {
  for (unsigned char c : s) {
    h ^= c;
    h *= 1099511628211ull;
  }
  return h;
}

// The path join_path(parent, key), not built; `hash` is fnv1a of it.
struct ChildPath {
  std::string_view parent;
  std::string_view key;
  uint64_t hash;
};

ChildPath child_path(std::string_view parent, uint64_t parent_hash, std::string_view key) {
  uint64_t h = parent.empty() ? parent_hash : fnv1a(".", parent_hash);
  return {parent, key, fnv1a(key, h)};
}

struct PathHash {
  using is_transparent = void;
  size_t operator()(std::string_view s) const { return fnv1a(s); }
  size_t operator()(const ChildPath& c) const { return c.hash; }
};

struct PathEqual {
  using is_transparent = void;
  bool operator()(std::string_view a, std::string_view b) const { return a == b; }
  bool operator()(std::string_view a, const ChildPath& c) const {
    if (c.parent.empty()) return a == c.key;
    return a.size() == c.parent.size() + 1 + c.key.size() && a.starts_with(c.parent) &&
           a[c.parent.size()] == '.' && a.ends_with(c.key);
  }
  bool operator()(const ChildPath& c, std::string_view a) const { return (*this)(a, c); }
};

// Every path an issue may be placed at -> its rank in document order (kNotFound when it is
// not in the document). The views point into the issues' paths.
using Ranks = std::unordered_map<std::string_view, size_t, PathHash, PathEqual>;

// Calls `fn` with each ancestor of `path` position() may fall back to, shortest first:
// the prefixes before its first kIndexedDepth + 1 separators.
template <typename Fn>
void for_each_ancestor(std::string_view path, Fn fn) {
  int separators = 0;
  for (size_t i = 0; i < path.size() && separators <= kIndexedDepth; ++i) {
    if (path[i] == '.' || path[i] == '[') {
      ++separators;
      fn(path.substr(0, i));
    }
  }
}

// Ranks the wanted paths under `v` (whose path is `path`) in document order. Each child key
// costs one hash of the key and one lookup, whatever the length of `path`.
void rank_paths(const Json& v, std::string_view path, uint64_t hash, int depth, Ranks& ranks,
                size_t& next_rank) {
  if (!v.is_object() || depth == kIndexedDepth) return;
  for (const auto& [key, child] : v.items()) {
    ChildPath c = child_path(path, hash, key);
    auto it = ranks.find(c);
    if (it == ranks.end()) continue;
    it->second = next_rank++;
    rank_paths(child, it->first, c.hash, depth + 1, ranks, next_rank);
  }
}

size_t position(std::string_view path, const Ranks& ranks) {
  auto rank_of = [&ranks](std::string_view p) {
    auto it = ranks.find(p);
    return it == ranks.end() ? kNotFound : it->second;
  };
  if (size_t r = rank_of(path); r != kNotFound) return r;
  size_t found = 0;  // the document itself
  // Shortest first: the last hit is the deepest ancestor in the document.
  for_each_ancestor(path, [&](std::string_view p) {
    if (size_t r = rank_of(p); r != kNotFound) found = r;
  });
  return found;
}

// Stable sort of `issues` by `positions`.
void reorder(std::vector<ConfigIssue>& issues, const std::vector<size_t>& positions) {
  std::vector<std::pair<size_t, size_t>> order;  // (position, index in `issues`)
  order.reserve(issues.size());
  for (size_t i = 0; i < issues.size(); ++i) order.emplace_back(positions[i], i);
  std::sort(order.begin(), order.end());
  std::vector<ConfigIssue> sorted;
  sorted.reserve(issues.size());
  for (const auto& [pos, i] : order) sorted.push_back(std::move(issues[i]));
  issues = std::move(sorted);
}

}  // namespace

void sort_by_file_order(const Json& doc, std::vector<ConfigIssue>& errors,
                        std::vector<ConfigIssue>& warnings) {
  Ranks ranks;
  for (const auto* list : {&errors, &warnings}) {
    for (const ConfigIssue& issue : *list) {
      ranks.emplace(issue.json_path, kNotFound);
      for_each_ancestor(issue.json_path, [&](std::string_view p) { ranks.emplace(p, kNotFound); });
    }
  }
  size_t next_rank = 1;
  rank_paths(doc, "", fnv1a(""), 0, ranks, next_rank);
  // Positions are computed before any issue moves: `ranks` points into their paths.
  std::vector<size_t> error_positions, warning_positions;
  for (const ConfigIssue& e : errors) error_positions.push_back(position(e.json_path, ranks));
  for (const ConfigIssue& w : warnings) warning_positions.push_back(position(w.json_path, ranks));
  reorder(errors, error_positions);
  reorder(warnings, warning_positions);
}

}  // namespace outcore::config::detail
