#include "engine/device/token_groups.hpp"

#include <algorithm>
#include <numeric>

namespace outcore::device {

TokenGroups::TokenGroups(std::span<const int32_t> ids) : n_(static_cast<int64_t>(ids.size())) {
  std::vector<int32_t> order(ids.size());
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int32_t a, int32_t b) { return ids[a] < ids[b]; });
  std::vector<int32_t> start, id;
  for (size_t k = 0; k < order.size(); ++k) {
    if (k == 0 || ids[order[k]] != ids[order[k - 1]]) {
      start.push_back(static_cast<int32_t>(k));
      id.push_back(ids[order[k]]);
    }
  }
  start.push_back(static_cast<int32_t>(order.size()));
  g_ = static_cast<int64_t>(id.size());
  packed_ = std::move(order);
  packed_.insert(packed_.end(), start.begin(), start.end());
  packed_.insert(packed_.end(), id.begin(), id.end());
}

}  // namespace outcore::device
