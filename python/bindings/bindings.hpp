// The parts of outcore._outcore, each bound in its own file. The module is the thin C++ layer
// under the Python package (python/outcore/): it takes raw addresses and lengths, never torch
// objects, so it needs none of torch's headers. See docs/architecture.md, "python".
#pragma once

#include <pybind11/pybind11.h>

namespace outcore::python {

void bind_aio(pybind11::module_& m);       // aio_binding.cpp
void bind_cpu_adam(pybind11::module_& m);  // cpu_adam_binding.cpp
void bind_estimate(pybind11::module_& m);  // estimate_binding.cpp

}  // namespace outcore::python
