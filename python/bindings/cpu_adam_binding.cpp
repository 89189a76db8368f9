// outcore._outcore.adam_step, check_adam_params and Executor: cpu_adam::adam_step on caller
// arrays given as addresses (the Python layer, outcore/optim.py, takes them from tensors and
// checks them).
#include <pybind11/pybind11.h>

#include <string>

#include "common/error.hpp"
#include "cpu_adam/cpu_adam.hpp"
#include "python/bindings/bindings.hpp"

namespace outcore::python {
namespace py = pybind11;

namespace {

// dtype codes shared with outcore/optim.py: 0 fp32, 1 bf16, 2 fp16.
DType dtype_of(int code) {
  switch (code) {
    case 0:
      return DType::F32;
    case 1:
      return DType::BF16;
    case 2:
      return DType::F16;
  }
  throw InvalidArgument("dtype code " + std::to_string(code) +
                        ": allowed 0 (fp32), 1 (bf16), "
                        "2 (fp16)");
}

cpu_adam::Formula formula_of(const std::string& s) {
  if (s == "deepspeed") return cpu_adam::Formula::kDeepSpeed;
  if (s == "pytorch") return cpu_adam::Formula::kPyTorch;
  throw InvalidArgument("formula: got \"" + s + "\"; allowed: \"deepspeed\", \"pytorch\"");
}

template <typename T>
T* ptr(uintptr_t address) {
  return reinterpret_cast<T*>(address);
}

cpu_adam::AdamParams adam_params(double lr, double beta1, double beta2, double eps,
                                 double weight_decay, bool adamw_mode, bool bias_correction,
                                 uint64_t step, const std::string& formula, double grad_scale) {
  cpu_adam::AdamParams hp;
  hp.lr = lr;
  hp.beta1 = beta1;
  hp.beta2 = beta2;
  hp.eps = eps;
  hp.weight_decay = weight_decay;
  hp.adamw_mode = adamw_mode;
  hp.bias_correction = bias_correction;
  hp.step = step;
  hp.formula = formula_of(formula);
  hp.grad_scale = grad_scale;
  return hp;
}

}  // namespace

void bind_cpu_adam(py::module_& m) {
  py::class_<cpu_adam::Executor>(m, "Executor",
                                 "A fixed team of oneTBB threads the kernels split over.")
      .def(py::init<unsigned>(), py::arg("threads"))
      .def_property_readonly("threads", &cpu_adam::Executor::threads);

  // Arguments are checked (hyper-parameters, null pointers) before any memory is touched;
  // the kernel runs with the GIL released.
  m.def(
      "adam_step",
      [](size_t n, uintptr_t params, uintptr_t grads, int grad_dtype, uintptr_t exp_avg,
         uintptr_t exp_avg_sq, uintptr_t out, int out_dtype, double lr, double beta1, double beta2,
         double eps, double weight_decay, bool adamw_mode, bool bias_correction, uint64_t step,
         const std::string& formula, double grad_scale, const cpu_adam::Executor* ex,
         int moments_dtype) {
        const cpu_adam::AdamParams hp = adam_params(lr, beta1, beta2, eps, weight_decay, adamw_mode,
                                                    bias_correction, step, formula, grad_scale);
        const cpu_adam::GradIn g{ptr<const void>(grads), dtype_of(grad_dtype)};
        const cpu_adam::ParamsOut o{ptr<void>(out), out == 0 ? DType::BF16 : dtype_of(out_dtype)};
        const cpu_adam::Moments mv{ptr<void>(exp_avg), ptr<void>(exp_avg_sq),
                                   dtype_of(moments_dtype)};
        py::gil_scoped_release nogil;
        cpu_adam::adam_step(hp, n, ptr<float>(params), g, mv, o, ex);
      },
      py::arg("n"), py::arg("params"), py::arg("grads"), py::arg("grad_dtype"), py::arg("exp_avg"),
      py::arg("exp_avg_sq"), py::arg("out"), py::arg("out_dtype"), py::arg("lr"), py::arg("beta1"),
      py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("adamw_mode"),
      py::arg("bias_correction"), py::arg("step"), py::arg("formula"), py::arg("grad_scale"),
      py::arg("executor"), py::arg("moments_dtype") = 0);

  // The hyper-parameter checks of adam_step alone (cpu_adam::validate): returns None, or raises
  // InvalidArgument naming the field, as adam_step would, touching nothing.
  m.def(
      "check_adam_params",
      [](double lr, double beta1, double beta2, double eps, double weight_decay, bool adamw_mode,
         bool bias_correction, uint64_t step, const std::string& formula, double grad_scale) {
        cpu_adam::validate(adam_params(lr, beta1, beta2, eps, weight_decay, adamw_mode,
                                       bias_correction, step, formula, grad_scale));
      },
      py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"),
      py::arg("adamw_mode"), py::arg("bias_correction"), py::arg("step"), py::arg("formula"),
      py::arg("grad_scale"));

  m.def(
      "active_isa", [] { return std::string(cpu_adam::isa_name(cpu_adam::active_isa())); },
      "The instruction set the Adam kernel uses: \"avx512\", \"avx2\" or \"scalar\".");
  m.def(
      "set_isa", [](const std::string& isa) { cpu_adam::set_isa(cpu_adam::parse_isa(isa)); },
      py::arg("isa"), "Forces the kernel's instruction set (tests and benchmarks).");
}

}  // namespace outcore::python
