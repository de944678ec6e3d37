// Bindings of the one profiler (plan/profile.h) over a model the Python package runs part by
// part (plan/partwise.h): memfit._C.PartwiseModel, which python/memfit/_parts.py's ModuleParts
// derives from, is called back only to run the user's model; every measurement, its turning into
// costs, the timing and the precision probe are the C++ core's.
#include <torch/extension.h>
#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <optional>
#include <string>
#include <vector>

#include "bindings.h"
#include "memfit/plan/job.h"
#include "memfit/plan/partwise.h"
#include "memfit/plan/profile.h"
#include "tracker.h"

namespace py = pybind11;

namespace memfit::python {
namespace {

// The Python model's methods, called with the GIL taken. An out-of-memory error raised in Python
// comes back as the C++ one, so that the profile tells it from the model's other errors (it
// reaches the caller as torch's out-of-memory error again); any other Python error passes
// through unchanged, its traceback kept.
class PyPartwiseModel : public PartwiseModel {
 public:
  int parts() const override { PYBIND11_OVERRIDE_PURE(int, PartwiseModel, parts); }
  std::string part_name(int part) const override { PYBIND11_OVERRIDE_PURE(std::string, PartwiseModel, part_name, part); }
  bool recomputable(int part) const override { PYBIND11_OVERRIDE_PURE(bool, PartwiseModel, recomputable, part); }
  bool non_reentrant_checkpoint() const override {
    PYBIND11_OVERRIDE_PURE(bool, PartwiseModel, non_reentrant_checkpoint);
  }
  int64_t input_copy_bytes(int part, const at::Tensor& input) const override { return 0; }
  int64_t samples() const override { PYBIND11_OVERRIDE_PURE(int64_t, PartwiseModel, samples); }
  c10::Device device() const override {
    py::gil_scoped_acquire gil;
    return c10::Device(call("device")().cast<std::string>());
  }
  std::vector<at::Tensor> parameters() const override {
    PYBIND11_OVERRIDE_PURE(std::vector<at::Tensor>, PartwiseModel, parameters);
  }
  int64_t weight_bytes() const override { PYBIND11_OVERRIDE_PURE(int64_t, PartwiseModel, weight_bytes); }
  std::vector<at::Tensor> batch_tensors() const override {
    PYBIND11_OVERRIDE_PURE(std::vector<at::Tensor>, PartwiseModel, batch_tensors);
  }
  at::Tensor forward(const PartRun& run, PartObserver* observer) override {
    py::gil_scoped_acquire gil;
    try {
      return call("forward")(run, observer).cast<at::Tensor>();
    } catch (const py::error_already_set& e) {
      throw_if_out_of_memory(e);
      throw;
    }
  }

 private:
  py::function call(const char* name) const {
    py::function f = py::get_override(static_cast<const PartwiseModel*>(this), name);
    if (!f) throw std::logic_error(std::string("memfit: the partwise model does not define ") + name + "()");
    return f;
  }
};

void bind_model(py::module_& m) {
  py::class_<PartRun>(m, "PartRun")
      .def_readonly("samples", &PartRun::samples)
      .def_property_readonly("precision", [](const PartRun& r) { return std::string(precision_name(r.precision)); })
      .def_readonly("recompute_all", &PartRun::recompute_all)
      .def_readonly("blocks_without_grad", &PartRun::blocks_without_grad);
  py::class_<PartObserver>(m, "PartObserver")
      .def("enter", [](PartObserver& o, int part, std::optional<at::Tensor> input) { o.enter(part, input.value_or(at::Tensor())); })
      .def("watches_saved_reads", &PartObserver::watches_saved_reads)
      .def("saved_tensor_read", &PartObserver::saved_tensor_read)
      .def("state_changed", &PartObserver::state_changed)
      .def("block_returned", &PartObserver::block_returned)
      .def("handed", &PartObserver::handed)
      .def("block_output", &PartObserver::block_output);
  py::class_<PartwiseModel, PyPartwiseModel>(m, "PartwiseModel").def(py::init<>());
  py::class_<ProfileOptions>(m, "ProfileOptions")
      .def(py::init<>())
      .def_readwrite("streamed", &ProfileOptions::streamed)
      .def_readwrite("progress", &ProfileOptions::progress);
}

void bind_profiler(py::module_& m) {
  m.def(
      "profile_parts",
      [](PartwiseModel& model, const std::vector<std::string>& precisions, Tracker& tracker, const ProfileOptions& o) {
        std::vector<Precision> candidates;
        for (const auto& p : precisions) candidates.push_back(parse_precision(p));
        TrackerScope scope(tracker.tracker);
        py::gil_scoped_release release;  // autograd runs without it; the model's calls take it back
        return profile_parts(model, candidates, *tracker.tracker, o);
      },
      py::arg("model"), py::arg("precisions"), py::arg("tracker"), py::arg("options") = ProfileOptions{});
  m.def(
      "profile_parts_at",
      [](PartwiseModel& model, int64_t micro_batch, const std::string& precision, Tracker& tracker) {
        TrackerScope scope(tracker.tracker);
        py::gil_scoped_release release;
        return profile_parts_at(model, micro_batch, parse_precision(precision), *tracker.tracker);
      },
      py::arg("model"), py::arg("micro_batch"), py::arg("precision"), py::arg("tracker"));
  m.def(
      "profile_precision",
      [](PartwiseModel& model, const std::string& precision, Tracker& tracker, const ProfileOptions& o) {
        TrackerScope scope(tracker.tracker);
        py::gil_scoped_release release;
        return profile_precision(model, parse_precision(precision), *tracker.tracker, o);
      },
      py::arg("model"), py::arg("precision"), py::arg("tracker"), py::arg("options") = ProfileOptions{});
  // The plan for the request's budget, the sizes it (or a close rival) would run timed first on
  // the model (job.h).
  m.def(
      "plan_timing_as_needed",
      [](Planner& planner, PartwiseModel& model) {
        const ChainTimer timer = [&model](Precision precision, const std::vector<int64_t>& sizes,
                                          const TimingReference& reference) {
          return time_step_sizes(model, precision, sizes, reference);
        };
        int timed = 0;
        Plan plan;
        {
          py::gil_scoped_release release;
          plan = plan_timing_as_needed(planner, 0, timer, &timed);
        }
        py::dict d = plan_dict(plan);
        d["sizes_timed"] = timed;
        return d;
      },
      py::arg("planner"), py::arg("model"));
}

}  // namespace

void bind_profile(py::module_& m) {
  bind_model(m);
  bind_profiler(m);
}

}  // namespace memfit::python
