// Internal: the kernel table of an ISA and of the active one.
#pragma once

#include "cpu_adam/cpu_adam.hpp"
#include "cpu_adam/kernels.hpp"

namespace outcore::cpu_adam::detail {

const KernelTable& kernels_for(Isa isa);
const KernelTable& active_kernels();

}  // namespace outcore::cpu_adam::detail
