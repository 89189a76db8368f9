// Internal: the readers of the larger config sections, shared by parse_config.cpp, and the
// value ranges they use.
#pragma once

#include <limits>
#include <string_view>

#include "engine/config/config.hpp"
#include "engine/config/section_reader.hpp"

namespace outcore::config::detail {

inline constexpr double kInf = std::numeric_limits<double>::infinity();
inline const IntRange kPositive{1};
inline const IntRange kNonNegative{0};
inline const RealRange kNonNegativeReal{0};
inline const RealRange kPositiveReal{0, kInf, true};
inline const RealRange kUnitInterval{0, 1};
// A non-negative number fp32 holds: a learning rate or weight decay, which Adam and the
// schedules apply in fp32 (a larger one is infinite there: the first step's loss is NaN).
inline const RealRange kNonNegativeFp32{0, std::numeric_limits<float>::max()};

// The object at `key` of `parent`, or nullptr when absent or null. Anything else that is
// not an object is an error.
const Json* object_at(SectionReader& parent, std::string_view key);

// Each reads its section of `root` into the struct, recording problems in `d`.
void read_optimizer(SectionReader& root, Diagnostics& d, OptimizerConfig& o);
void read_scheduler(SectionReader& root, Diagnostics& d, SchedulerConfig& sc);
void read_zero(SectionReader& root, Diagnostics& d, ZeroConfig& zc);

}  // namespace outcore::config::detail
