// The Python exceptions outcore errors become. Every outcore::Error thrown by a binding reaches
// Python as one of these (registered by register_errors), its message unchanged:
//   outcore.IoError(OSError)              outcore::IoError; errno, filename, offset, length set
//   outcore.ConfigError(ValueError)       outcore::ConfigError; json_path set
//   outcore.InvalidArgument(ValueError)   outcore::InvalidArgument
//   outcore.OutOfMemoryError(MemoryError) outcore::OutOfMemory
//   outcore.CorruptDataError(Error)       outcore::CorruptData
//   outcore.Error(RuntimeError)           any other outcore::Error (base of CorruptDataError)
#pragma once

#include <pybind11/pybind11.h>

namespace outcore::python {

// Creates the exception classes in `m` and installs the translator. Call once, at import.
void register_errors(pybind11::module_& m);

}  // namespace outcore::python
