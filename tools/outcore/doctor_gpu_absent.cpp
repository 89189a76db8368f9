// The GPU side of `outcore doctor` in builds without CUDA.
#include "engine/device/device.hpp"
#include "tools/outcore/doctor.hpp"

namespace outcore::cli::doctor {

std::vector<Line> gpu_checks() { return {{"gpu", Verdict::kNone, device::probe().summary()}}; }

}  // namespace outcore::cli::doctor
