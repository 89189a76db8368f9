// A micro-batch's token positions grouped by token id, for the embedding's backward on a GPU: one
// block per id adds that id's rows of dy in token order, the host's order, with no atomics and
// no serial loop over all tokens.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace outcore::device {

// Packed as one int32 array, so it travels to the device in one copy:
//   [0, n)                 token positions, grouped by id; in token order within a group
//   [n, n + G + 1)         group g's positions are [start[g], start[g+1]) of the first part
//   [n + G + 1, n + 2G + 1) group g's token id
// Groups are in increasing id order. G = groups().
class TokenGroups {
 public:
  explicit TokenGroups(std::span<const int32_t> ids);
  int64_t tokens() const { return n_; }
  int64_t groups() const { return g_; }
  const std::vector<int32_t>& packed() const { return packed_; }
  const int32_t* order() const { return packed_.data(); }
  const int32_t* start() const { return packed_.data() + n_; }
  const int32_t* id() const { return packed_.data() + n_ + g_ + 1; }

 private:
  int64_t n_ = 0, g_ = 0;
  std::vector<int32_t> packed_;
};

}  // namespace outcore::device
