// The replaced global operator new/delete behind AllocationProbe (see alloc_probe.hpp). Kept in
// its own file so that no other translation unit sees both a new-expression and this operator
// delete's free().
#include "tests/model/alloc_probe.hpp"

#include <atomic>
#include <cstdlib>
#include <new>

namespace {
std::atomic<bool> g_armed{false};
std::atomic<size_t> g_bytes{0};
}  // namespace

void* operator new(std::size_t n) {
  if (g_armed.load(std::memory_order_relaxed) &&
      g_bytes.fetch_add(n, std::memory_order_relaxed) + n >
          outcore::model::testing::AllocationProbe::kLimitBytes)
    throw std::bad_alloc();
  if (void* p = std::malloc(n == 0 ? 1 : n)) return p;
  throw std::bad_alloc();
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }

namespace outcore::model::testing {

AllocationProbe::AllocationProbe() {
  g_bytes = 0;
  g_armed = true;
}
AllocationProbe::~AllocationProbe() { g_armed = false; }
size_t AllocationProbe::bytes() const { return g_bytes; }

}  // namespace outcore::model::testing
