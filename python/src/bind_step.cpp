// Bindings of runtime/'s step policy that the Python package runs the user's model under: what
// an out-of-memory error in the middle of a step leads to (oom_recovery.h), so that a Python
// step recovers exactly as the C++ Trainer's does.
#include <torch/extension.h>
#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "bindings.h"
#include "memfit/runtime/oom_recovery.h"

namespace py = pybind11;

namespace memfit::python {

void bind_step(py::module_& m) {
  py::class_<PendingMicroBatch>(m, "PendingMicroBatch")
      .def_property_readonly("start", [](const PendingMicroBatch& p) { return p.part.start; })
      .def_property_readonly("length", [](const PendingMicroBatch& p) { return p.part.length; })
      .def_property_readonly("weight", [](const PendingMicroBatch& p) { return p.part.weight; })
      .def_readonly("recompute_all", &PendingMicroBatch::recompute_all);
  py::class_<OomDecision>(m, "OomDecision")
      .def_readonly("restart_step", &OomDecision::restart_step)
      .def_readonly("next", &OomDecision::next);
  py::class_<SplitRecovery>(m, "SplitRecovery")
      .def(py::init([](int64_t batch, int blocks, const std::function<void(const std::string&)>& note) {
             return SplitRecovery(batch, batch, blocks, note);
           }),
           py::arg("batch"), py::arg("blocks"), py::arg("note"))
      .def(
          "begin_step",
          [](SplitRecovery& r, int64_t step, const std::vector<std::pair<int, int>>& segments, const std::string& budget) {
            CheckpointPlan planned;
            planned.segments = segments;
            r.begin_step(step, planned, budget);
          },
          py::arg("step"), py::arg("segments"), py::arg("budget_text"))
      // The step's micro-batches of size m, none recomputing every block yet.
      .def("micro_batches",
           [](const SplitRecovery& r, int64_t m) {
             std::vector<PendingMicroBatch> out;
             for (const MicroBatch& part : r.split(m)) out.push_back({part, false});
             return out;
           })
      .def(
          "on_out_of_memory",
          [](SplitRecovery& r, const PendingMicroBatch& failed, bool partial_sums, const std::string& message) {
            const c10::OutOfMemoryError error(c10::SourceLocation{__func__, __FILE__, static_cast<uint32_t>(__LINE__)}, message);
            return r.on_out_of_memory(failed, partial_sums, error);
          },
          py::arg("failed"), py::arg("partial_sums"), py::arg("message"))
      .def("next_steps",
           [](const SplitRecovery& r, int64_t micro_batch, int64_t smallest_completed, bool recomputes_all) {
             const SplitRecovery::NextSteps n = r.next_steps(micro_batch, smallest_completed, recomputes_all);
             return py::make_tuple(n.micro_batch, n.recompute_all);
           })
      .def_property_readonly("real_oom_in_step", &SplitRecovery::real_oom_in_step)
      .def_property_readonly("recoveries", &SplitRecovery::recoveries);
}

}  // namespace memfit::python
