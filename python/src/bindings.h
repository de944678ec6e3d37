// bindings.h — the parts of the extension module memfit._C, one function per layer bound.
#pragma once

#include <pybind11/pybind11.h>

#include "memfit/plan/plan.h"

namespace memfit::python {

// torch.cuda.OutOfMemoryError: what an allocation past the budget raises in Python.
PyObject* out_of_memory_type();

// Where a Python call raised an out-of-memory error: the C++ one in its place (its message kept),
// so that the core tells it from the model's other errors, which pass through as they are.
void throw_if_out_of_memory(const pybind11::error_already_set& error);

// A plan as the Python package reads it (bind_plan.cpp).
pybind11::dict plan_dict(const Plan& plan);

void bind_measure(pybind11::module_& m);
void bind_plan(pybind11::module_& m);
void bind_optim(pybind11::module_& m);
void bind_step(pybind11::module_& m);
void bind_profile(pybind11::module_& m);

}  // namespace memfit::python
