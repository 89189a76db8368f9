// Instruction set detection and the process-wide choice of kernels.
#include "cpu_adam/dispatch.hpp"

#include <atomic>
#include <cstdlib>
#include <string>

#include "common/error.hpp"
#include "common/log.hpp"
#include "cpu_adam/cpu_adam.hpp"

namespace outcore::cpu_adam {
namespace {

Isa initial_isa() {
  const Isa best = detect_isa();
  const char* env = std::getenv("OUTCORE_CPU_ADAM_ISA");
  if (env == nullptr || *env == '\0') return best;
  try {
    const Isa wanted = parse_isa(env);
    if (isa_supported(wanted)) return wanted;
    log::warn("OUTCORE_CPU_ADAM_ISA={}: this CPU cannot run it; using {}", env, isa_name(best));
  } catch (const InvalidArgument& e) {
    log::warn("OUTCORE_CPU_ADAM_ISA: {}; using {}", e.what(), isa_name(best));
  }
  return best;
}

std::atomic<Isa>& isa_slot() {
  static std::atomic<Isa> slot{initial_isa()};
  return slot;
}

}  // namespace

std::string_view isa_name(Isa isa) {
  switch (isa) {
    case Isa::kScalar:
      return "scalar";
    case Isa::kAvx2:
      return "avx2";
    case Isa::kAvx512:
      return "avx512";
  }
  return "unknown";
}

Isa parse_isa(std::string_view text) {
  for (Isa isa : {Isa::kScalar, Isa::kAvx2, Isa::kAvx512}) {
    if (text == isa_name(isa)) return isa;
  }
  throw InvalidArgument("unknown instruction set '" + std::string(text) +
                        "' (expected scalar, avx2 or avx512)");
}

bool isa_supported(Isa isa) {
  __builtin_cpu_init();
  switch (isa) {
    case Isa::kScalar:
      return true;
    case Isa::kAvx2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
    case Isa::kAvx512:
      return isa_supported(Isa::kAvx2) && __builtin_cpu_supports("avx512f") &&
             __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
             __builtin_cpu_supports("avx512dq");
  }
  return false;
}

Isa detect_isa() {
  if (isa_supported(Isa::kAvx512)) return Isa::kAvx512;
  if (isa_supported(Isa::kAvx2)) return Isa::kAvx2;
  return Isa::kScalar;
}

Isa active_isa() { return isa_slot().load(std::memory_order_relaxed); }

void set_isa(Isa isa) {
  if (!isa_supported(isa)) {
    throw InvalidArgument("cpu_adam: this CPU cannot run the " + std::string(isa_name(isa)) +
                          " kernels");
  }
  isa_slot().store(isa, std::memory_order_relaxed);
}

namespace detail {

const KernelTable& kernels_for(Isa isa) {
  switch (isa) {
    case Isa::kAvx512:
      return avx512_kernels();
    case Isa::kAvx2:
      return avx2_kernels();
    case Isa::kScalar:
      break;
  }
  return scalar_kernels();
}

const KernelTable& active_kernels() { return kernels_for(active_isa()); }

}  // namespace detail
}  // namespace outcore::cpu_adam
