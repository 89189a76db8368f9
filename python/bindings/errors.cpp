#include "python/bindings/errors.hpp"

#include "common/error.hpp"

namespace outcore::python {
namespace py = pybind11;

namespace {

// Text of outcore (messages, file names) as a Python str: its bytes decoded as UTF-8, those that
// are not (a file name, a key of a file) kept as surrogates, as os.fsdecode() keeps them.
py::str text(const std::string& s) {
  PyObject* o =
      PyUnicode_DecodeUTF8(s.data(), static_cast<Py_ssize_t>(s.size()), "surrogateescape");
  if (o == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::str>(o);
}

// Raises `cls(errno, message)` with filename, offset and length attributes: an OSError whose
// str() is "[Errno N] <message>" and whose message already names the file and offset.
void raise_io_error(PyObject* cls, const IoError& e) {
  py::object exc = py::reinterpret_borrow<py::object>(cls)(e.error_number(), text(e.what()));
  exc.attr("filename") = text(e.file());
  exc.attr("offset") = e.offset();
  exc.attr("length") = e.length();
  PyErr_SetObject(cls, exc.ptr());
}

// Raises `cls(message)`.
void raise(PyObject* cls, const std::exception& e) { PyErr_SetObject(cls, text(e.what()).ptr()); }

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
      py::object exc = py::reinterpret_borrow<py::object>(config.ptr())(text(e.what()));
      exc.attr("json_path") = text(e.json_path());
      PyErr_SetObject(config.ptr(), exc.ptr());
    } catch (const InvalidArgument& e) {
      raise(invalid.ptr(), e);
    } catch (const OutOfMemory& e) {
      raise(oom.ptr(), e);
    } catch (const CorruptData& e) {
      raise(corrupt.ptr(), e);
    } catch (const Error& e) {
      raise(base.ptr(), e);
    }
  });
}

}  // namespace outcore::python
