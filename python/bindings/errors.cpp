#include "python/bindings/errors.hpp"

#include "common/error.hpp"

namespace outcore::python {
namespace py = pybind11;

namespace {

// Raises `cls(errno, message)` with filename, offset and length attributes: an OSError whose
// str() is "[Errno N] <message>" and whose message already names the file and offset.
void raise_io_error(PyObject* cls, const IoError& e) {
  py::object exc = py::reinterpret_borrow<py::object>(cls)(e.error_number(), e.what());
  exc.attr("filename") = e.file();
  exc.attr("offset") = e.offset();
  exc.attr("length") = e.length();
  PyErr_SetObject(cls, exc.ptr());
}

}  // namespace

void register_errors(py::module_& m) {
  // Static: they live as long as the interpreter, like the module's own types.
  static py::exception<Error> base(m, "Error", PyExc_RuntimeError);
  static py::exception<IoError> io(m, "IoError", PyExc_OSError);
  static py::exception<ConfigError> config(m, "ConfigError", PyExc_ValueError);
  static py::exception<InvalidArgument> invalid(m, "InvalidArgument", PyExc_ValueError);
  static py::exception<OutOfMemory> oom(m, "OutOfMemoryError", PyExc_MemoryError);
  static py::exception<CorruptData> corrupt(m, "CorruptDataError", base.ptr());
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const IoError& e) {
      raise_io_error(io.ptr(), e);
    } catch (const ConfigError& e) {
      py::object exc = py::reinterpret_borrow<py::object>(config.ptr())(e.what());
      exc.attr("json_path") = e.json_path();
      PyErr_SetObject(config.ptr(), exc.ptr());
    } catch (const InvalidArgument& e) {
      invalid(e.what());
    } catch (const OutOfMemory& e) {
      oom(e.what());
    } catch (const CorruptData& e) {
      corrupt(e.what());
    } catch (const Error& e) {
      base(e.what());
    }
  });
}

}  // namespace outcore::python
