// memfit._C: the C++ library as the Python package `memfit` uses it. Errors cross as Python
// exceptions: an allocation past the budget as torch's out-of-memory error, a bad option or
// value as ValueError, other LibTorch errors as RuntimeError (without the C++ backtrace).
#include <torch/extension.h>

#include <torch/version.h>

#include <map>
#include <string>

#include "bindings.h"
#include "memfit/errors.h"
#include "memfit/plan/plan.h"

namespace py = pybind11;

PyObject* memfit::python::out_of_memory_type() {
  static PyObject* type = py::object(py::module_::import("torch.cuda").attr("OutOfMemoryError")).release().ptr();
  return type;
}

void memfit::python::throw_if_out_of_memory(const py::error_already_set& error) {
  if (!error.matches(out_of_memory_type())) return;
  throw c10::OutOfMemoryError(c10::SourceLocation{__func__, __FILE__, static_cast<uint32_t>(__LINE__)},
                              py::str(error.value()).cast<std::string>());
}

namespace {

// An option as memfit's Python functions name their argument ("precisions", not the core's
// "precision"), said in their style: "precisions 'fp64': expected fp32, bf16 or fp16".
std::string in_python_terms(const memfit::OptionError& e) {
  static const std::map<std::string, std::string> arguments = {{"precision", "precisions"},
                                                               {"optimizer.state", "optimizer_state"}};
  const auto it = arguments.find(e.option());
  return (it != arguments.end() ? it->second : e.option()) + " " + e.value() + ": " + e.expected();
}

void translate(std::exception_ptr p) {
  try {
    if (p) std::rethrow_exception(p);
  } catch (const c10::OutOfMemoryError& e) {
    PyErr_SetString(memfit::python::out_of_memory_type(), e.what_without_backtrace());
  } catch (const c10::Error& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
  } catch (const memfit::OptionError& e) {
    PyErr_SetString(PyExc_ValueError, in_python_terms(e).c_str());
  }
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "memfit's C++ core: exact allocator bytes, the budget, the planner, 8-bit optimizer state";
  m.attr("torch_version") = TORCH_VERSION;
  m.attr("with_cuda") = MEMFIT_WITH_CUDA != 0;
  m.attr("plan_margin") = memfit::kPlanMargin;
  memfit::python::out_of_memory_type();
  py::register_exception_translator(&translate);
  memfit::python::bind_measure(m);
  memfit::python::bind_plan(m);
  memfit::python::bind_optim(m);
  memfit::python::bind_step(m);
  memfit::python::bind_profile(m);
}
