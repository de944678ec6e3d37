// memfit._C as one translation unit: each bind_*.cpp alone parses torch/extension.h and pybind11
// again (about 40 s of CPU each); included here, the headers are parsed once and the extension
// builds in a fraction of the time. The files stay apart for reading, as CMake's unity builds do.
#include "bindings.cpp"
#include "bind_measure.cpp"
#include "bind_plan.cpp"
#include "bind_optim.cpp"
#include "bind_step.cpp"
#include "bind_profile.cpp"
