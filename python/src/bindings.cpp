// memfit._C: the C++ library as the Python package `memfit` uses it. Errors cross as Python
// exceptions: an allocation past the budget as torch's out-of-memory error, a bad option or
// value as ValueError, other LibTorch errors as RuntimeError (without the C++ backtrace).
#include <torch/extension.h>

#include <torch/version.h>

#include "bindings.h"
#include "memfit/errors.h"

namespace py = pybind11;

PyObject* memfit::python::out_of_memory_type() {
  static PyObject* type = py::object(py::module_::import("torch.cuda").attr("OutOfMemoryError")).release().ptr();
  return type;
}

namespace {

void translate(std::exception_ptr p) {
  try {
    if (p) std::rethrow_exception(p);
  } catch (const c10::OutOfMemoryError& e) {
    PyErr_SetString(memfit::python::out_of_memory_type(), e.what_without_backtrace());
  } catch (const c10::Error& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what_without_backtrace());
  } catch (const memfit::OptionError& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
  }
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "memfit's C++ core: exact allocator bytes, the budget, the planner, 8-bit optimizer state";
  m.attr("torch_version") = TORCH_VERSION;
  m.attr("with_cuda") = MEMFIT_WITH_CUDA != 0;
  memfit::python::out_of_memory_type();
  py::register_exception_translator(&translate);
  memfit::python::bind_measure(m);
  memfit::python::bind_plan(m);
  memfit::python::bind_optim(m);
  memfit::python::bind_step(m);
  memfit::python::bind_profile(m);
}
