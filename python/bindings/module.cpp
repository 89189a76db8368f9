// outcore._outcore: the compiled half of the `outcore` Python package.
#include <pybind11/pybind11.h>

#include "python/bindings/bindings.hpp"
#include "python/bindings/errors.hpp"
#include "tools/env_settings.hpp"

PYBIND11_MODULE(_outcore, m) {
  outcore::tools::apply_environment_settings();
  m.doc() = "outcore's aio engine, CPU Adam and placement planner (use the `outcore` package)";
  outcore::python::register_errors(m);
  outcore::python::bind_aio(m);
  outcore::python::bind_cpu_adam(m);
  outcore::python::bind_estimate(m);
}
