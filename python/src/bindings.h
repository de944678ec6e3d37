// bindings.h — the parts of the extension module memfit._C, one function per layer bound.
#pragma once

#include <pybind11/pybind11.h>

namespace memfit::python {

void bind_measure(pybind11::module_& m);
void bind_plan(pybind11::module_& m);
void bind_optim(pybind11::module_& m);
void bind_step(pybind11::module_& m);

}  // namespace memfit::python
