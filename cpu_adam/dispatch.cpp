// Instruction set detection and the process-wide choice of kernels.
#include "cpu_adam/dispatch.hpp"

#include <atomic>
#include <string>

#include "common/error.hpp"
#include "common/log.hpp"
#include "cpu_adam/cpu_adam.hpp"

namespace outcore::cpu_adam {
namespace {

std::atomic<Isa>& isa_slot() {
  static std::atomic<Isa> slot{detect_isa()};
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

void request_isa(std::string_view text, std::string_view source) {
  if (text.empty()) return;
  const Isa current = active_isa();
  try {
    const Isa wanted = parse_isa(text);
    if (isa_supported(wanted)) {
      isa_slot().store(wanted, std::memory_order_relaxed);
      return;
    }
    log::warn("{}={}: this CPU cannot run it; using {}", source, text, isa_name(current));
  } catch (const InvalidArgument& e) {
    log::warn("{}: {}; using {}", source, e.what(), isa_name(current));
  }
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
