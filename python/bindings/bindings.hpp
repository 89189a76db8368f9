// The parts of outcore._outcore, each bound in its own file. The module is the thin C++ layer
// under the Python package (python/outcore/): it takes raw addresses and lengths, never torch
// objects, so it needs none of torch's headers. See docs/architecture.md, "python".
#pragma once

#include <pybind11/pybind11.h>

#include <string>

#include "common/error.hpp"

namespace outcore::python {

void bind_aio(pybind11::module_& m);       // aio_binding.cpp
void bind_cpu_adam(pybind11::module_& m);  // cpu_adam_binding.cpp
void bind_estimate(pybind11::module_& m);  // estimate_binding.cpp

// `path`, or InvalidArgument (ValueError) naming `name` when it holds a null byte: the C library
// would take the path as ending there and open another file. The message shows the byte as \x00.
inline const std::string& checked_path(const std::string& path, const char* name) {
  if (path.find('\0') == std::string::npos) return path;
  std::string shown;
  for (char c : path) shown += c == '\0' ? std::string("\\x00") : std::string(1, c);
  throw InvalidArgument(std::string(name) + ": '" + shown + "': embedded null byte");
}

}  // namespace outcore::python
