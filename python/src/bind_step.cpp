// Bindings of runtime/'s step parts that the Python package runs the user's model with: what an
// out-of-memory error in the middle of a step leads to (oom_recovery.h), so that a Python step
// recovers exactly as the C++ Trainer's does; the optimizer on the host (optimizer_offload.h).
#include <torch/extension.h>
#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <optional>
#include <string>
#include <vector>

#include "bindings.h"
#include "memfit/measure/memory_space.h"
#include "memfit/runtime/oom_recovery.h"
#include "memfit/runtime/optimizer_offload.h"

namespace py = pybind11;

namespace memfit::python {

namespace {

// A Python `with` block whose CPU allocations go to the host space (HostSpaceGuard).
struct HostSpace {
  std::optional<HostSpaceGuard> guard;
};

void bind_offload(py::module_& m) {
  py::class_<HostSpace>(m, "HostSpace")
      .def(py::init<>())
      .def("__enter__", [](HostSpace& h) { h.guard.emplace(); })
      .def("__exit__", [](HostSpace& h, const py::args&) { h.guard.reset(); });
  m.def("copy_to_host", [](const at::Tensor& t) { return copy_to_host(t); },
        "A copy of `t` in the host space (pinned CPU memory on CUDA), counted as host bytes.");
  // The Python optimizer is moved onto host_parameters() by the caller (memfit/_offload.py);
  // step(fn) runs fn (the optimizer's step) in the host space, then copies the masters back.
  py::class_<OptimizerOffload>(m, "OptimizerOffload")
      .def(py::init<std::vector<at::Tensor>>(), py::arg("device_parameters"))
      .def("host_parameters", &OptimizerOffload::host_parameters)
      .def("release_device_gradients", &OptimizerOffload::release_device_gradients)
      .def("step", &OptimizerOffload::step, py::arg("step"), py::call_guard<py::gil_scoped_release>());
}

// SplitRecovery (runtime/oom_recovery.h): what a step does after an out-of-memory error.
void bind_recovery(py::module_& m) {
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

}  // namespace

void bind_step(py::module_& m) {
  bind_recovery(m);
  // The one micro-batch loop (runtime/step.h) over the step's micro-batches of size m, `run`
  // running one in Python; returns (sum of weight * loss, the smallest micro-batch that completed).
  m.def(
      "accumulate_micro_batches",
      [](SplitRecovery& recovery, int64_t m, const py::function& run, const std::vector<at::Tensor>& holders,
         const std::vector<at::Tensor>& also_released, const std::string& device) {
        MicroBatchLoop loop;
        loop.device = c10::Device(device);
        loop.gradient_holders = holders;
        loop.also_released = also_released;
        loop.recovery = &recovery;
        const MicroBatchFn run_one = [&run](const PendingMicroBatch& part) {
          try {
            return run(part).cast<double>();
          } catch (const py::error_already_set& e) {
            throw_if_out_of_memory(e);
            throw;
          }
        };
        const StepResult r = accumulate_micro_batches(recovery.split(m), run_one, loop);
        return py::make_tuple(r.loss, r.smallest_micro_batch);
      },
      py::arg("recovery"), py::arg("micro_batch"), py::arg("run"), py::arg("gradient_holders"),
      py::arg("also_released"), py::arg("device"));
  bind_offload(m);
}

}  // namespace memfit::python
