// Allocation probe for tests: replaces the global operator new of the test binary so a test can
// check that a call allocates (almost) nothing, e.g. that an absurd model config is refused
// before anything is sized from it.
#pragma once

#include <cstddef>

namespace outcore::model::testing {

// While an AllocationProbe lives, operator new counts the bytes requested and throws
// std::bad_alloc once they pass kLimitBytes, so a missing size check fails fast instead of
// exhausting memory. Other allocation functions (aligned new, malloc) are not counted.
// REQUIRES: one probe at a time, and no other thread allocating while it lives.
class AllocationProbe {
 public:
  static constexpr size_t kLimitBytes = size_t{64} << 20;
  AllocationProbe();
  ~AllocationProbe();
  AllocationProbe(const AllocationProbe&) = delete;
  AllocationProbe& operator=(const AllocationProbe&) = delete;
  // Bytes requested through operator new since construction.
  size_t bytes() const;
};

}  // namespace outcore::model::testing
