// Bindings of plan/: the measured costs (profile.h's structs, which the profile of the user's
// module returns: bind_profile.cpp), the Planner (the pure search) and the optimizer's costs.
#include <torch/extension.h>
#include <pybind11/functional.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include "bindings.h"
#include "memfit/errors.h"
#include "memfit/plan/batch_shape.h"
#include "memfit/plan/cost_fit.h"
#include "memfit/plan/job.h"
#include "memfit/plan/plan_ask.h"
#include "memfit/plan/planner.h"
#include "memfit/plan/profile.h"
#include "memfit/plan/schedule.h"
#include "tracker.h"

namespace py = pybind11;

namespace memfit::python {
namespace {

// The request of a setup with the optimizer's measured costs: the first is the spec's (fp32 under
// auto), the others what the plan may choose instead; several make the state auto.
PlanRequest request_with_costs(const PlanSetup& setup, const std::vector<OptimizerCost>& costs) {
  TORCH_CHECK(!costs.empty(), "memfit: the optimizer's cost was not measured");
  PlanRequest r = setup.request;
  r.optimizer = costs.front();
  r.optimizer_alternatives.assign(costs.begin() + 1, costs.end());
  r.step.optimizer.state = costs.size() > 1 ? StatePrecision::kAuto : costs.front().state;
  return r;
}

// A PlanAsk's field of its step, as a Python property.
template <typename T>
void step_field(py::class_<PlanAsk>& c, const char* name, T StepConfig::*field) {
  c.def_property(name, [field](const PlanAsk& a) { return a.step.*field; }, [field](PlanAsk& a, T v) { a.step.*field = v; });
}

void bind_request(py::module_& m) {
  py::class_<PlanAsk> ask(m, "PlanAsk");
  ask.def(py::init([] {
        PlanAsk a;
        a.activations_movable = false;  // Python's autograd keeps saved activations where they were made
        a.step.set_to_none = true;
        return a;
      }))
      .def_readwrite("budget_bytes", &PlanAsk::budget_bytes)
      .def_readwrite("margin", &PlanAsk::margin)
      .def_readwrite("precisions", &PlanAsk::precisions)
      .def_readwrite("offload", &PlanAsk::offload)
      .def_readwrite("host_budget_bytes", &PlanAsk::host_budget_bytes)
      .def_readwrite("resident_bytes", &PlanAsk::resident_bytes)
      .def_readwrite("outside_bytes", &PlanAsk::outside_bytes)
      .def_property("device", [](const PlanAsk& a) { return a.step.device.str(); },
                    [](PlanAsk& a, const std::string& d) { a.step.device = c10::Device(d); })
      .def_property("optimizer_family", [](const PlanAsk& a) { return std::string(optimizer_family_name(a.step.optimizer.family)); },
                    [](PlanAsk& a, const std::string& f) { a.step.optimizer.family = parse_optimizer_family(f); })
      .def_property("optimizer_state", [](const PlanAsk& a) { return std::string(state_precision_name(a.step.optimizer.state)); },
                    [](PlanAsk& a, const std::string& s) { a.step.optimizer.state = parse_state_precision(s); })
      .def_property("lr", [](const PlanAsk& a) { return a.step.optimizer.lr; }, [](PlanAsk& a, double lr) { a.step.optimizer.lr = lr; });
  step_field(ask, "batch", &StepConfig::batch);
  step_field(ask, "micro_batch", &StepConfig::micro_batch);
  py::class_<PlanRequest>(m, "PlanRequest");
  py::class_<PlanSetup>(m, "PlanSetup")
      .def_readonly("notes", &PlanSetup::notes)
      .def_property_readonly("precisions", [](const PlanSetup& s) {
        std::vector<std::string> names;
        for (Precision p : s.precisions) names.push_back(precision_name(p));
        return names;
      })
      .def("request", &request_with_costs, py::arg("optimizer_costs"));
  m.def("set_up_plan", &set_up_plan);
  m.def("below_floor_text", &below_floor_text);
}

}  // namespace

py::dict plan_dict(const Plan& p) {
  py::dict d;
  d["feasible"] = p.feasible;
  d["budget_bytes"] = p.budget_bytes;
  d["floor_bytes"] = p.floor_bytes;
  d["margin"] = p.margin;
  d["micro_batch"] = p.config.micro_batch_size();
  d["accumulation"] = p.config.accumulation();
  d["precision"] = std::string(precision_name(p.config.precision));
  d["segments"] = p.config.checkpoint.segments;
  d["optimizer_state"] = std::string(state_precision_name(p.config.optimizer.state));
  d["optimizer_offloaded"] = p.config.offload.optimizer;
  d["predicted_host_peak_bytes"] = p.predicted_host_peak;
  d["predicted_peak_bytes"] = p.predicted_peak;
  d["predicted_step_seconds"] = p.predicted_seconds;
  d["plain_predicted_peak_bytes"] = p.plain_predicted_peak;
  d["plain_predicted_step_seconds"] = p.plain_predicted_seconds;
  d["notes"] = p.notes;
  d["json"] = plan_json(p).dump();
  return d;
}

namespace {

// A block's costs in the schedule's terms, and the profile of one micro-batch size.
void bind_block_costs(py::module_& m) {
  py::class_<BlockCost>(m, "BlockCost")
      .def(py::init<>())
      .def_readwrite("forward_seconds", &BlockCost::forward_seconds)
      .def_readwrite("backward_seconds", &BlockCost::backward_seconds)
      .def_readwrite("output_bytes", &BlockCost::output_bytes)
      .def_readwrite("output_kept", &BlockCost::output_kept)
      .def_readwrite("kept_bytes", &BlockCost::kept_bytes)
      .def_readwrite("forward_peak", &BlockCost::forward_peak)
      .def_readwrite("forward_nograd_peak", &BlockCost::forward_nograd_peak)
      .def_readwrite("forward_left_bytes", &BlockCost::forward_left_bytes)
      .def_readwrite("backward_peak", &BlockCost::backward_peak)
      .def_readwrite("param_bytes", &BlockCost::param_bytes)
      .def_readwrite("cast_bytes", &BlockCost::cast_bytes)
      .def_readwrite("recomputable", &BlockCost::recomputable)
      .def_readwrite("keeps_own_output", &BlockCost::keeps_own_output)
      .def_readwrite("backward_peak_accumulating", &BlockCost::backward_peak_accumulating)
      .def_readwrite("backward_peak_streamed", &BlockCost::backward_peak_streamed)
      .def_readwrite("backward_held_by_segment_bytes", &BlockCost::backward_held_by_segment_bytes)
      .def_readwrite("backward_held_all_bytes", &BlockCost::backward_held_all_bytes)
      .def_readwrite("recompute_start_extra_bytes", &BlockCost::recompute_start_extra_bytes);
  py::class_<PeakMoments>(m, "PeakMoments")
      .def(py::init<>())
      .def_readonly("pattern", &PeakMoments::pattern)
      .def_readonly("bytes", &PeakMoments::bytes)
      .def("usable", &PeakMoments::usable);
  py::class_<BlockMoments>(m, "BlockMoments")
      .def(py::init<>())
      .def_readwrite("forward", &BlockMoments::forward)
      .def_readwrite("forward_nograd", &BlockMoments::forward_nograd)
      .def_readwrite("backward", &BlockMoments::backward)
      .def_readwrite("backward_accumulating", &BlockMoments::backward_accumulating);
  py::class_<ChainProfile>(m, "ChainProfile")
      .def(py::init<>())
      .def_readwrite("micro_batch", &ChainProfile::micro_batch)
      .def_readwrite("blocks", &ChainProfile::blocks)
      .def_readwrite("moments", &ChainProfile::moments)
      .def_readwrite("forward_nograd_seconds", &ChainProfile::forward_nograd_seconds);
}

// A precision's profiles, the workload's, and the optimizer's costs.
void bind_costs(py::module_& m) {
  bind_block_costs(m);
  py::class_<PrecisionProfile>(m, "PrecisionProfile")
      .def(py::init([](const std::string& precision) {
        PrecisionProfile p;
        p.precision = parse_precision(precision);
        return p;
      }))
      .def_property_readonly("precision", [](const PrecisionProfile& p) { return std::string(precision_name(p.precision)); })
      .def_readwrite("small", &PrecisionProfile::small)
      .def_readwrite("large", &PrecisionProfile::large)
      .def_readwrite("below", &PrecisionProfile::below)
      .def_readwrite("calibration", &PrecisionProfile::calibration)
      .def_property(
          "chain_seconds",
          [](const PrecisionProfile& p) {
            std::vector<std::pair<int64_t, double>> out;
            for (const auto& c : p.chain_seconds) out.emplace_back(c.micro_batch, c.seconds);
            return out;
          },
          [](PrecisionProfile& p, const std::vector<std::pair<int64_t, double>>& points) {
            p.chain_seconds.clear();
            for (const auto& [mb, s] : points) p.chain_seconds.push_back({mb, s});
          });
  py::class_<WorkloadProfile>(m, "WorkloadProfile")
      .def(py::init<>())
      .def_readwrite("batch", &WorkloadProfile::batch)
      .def_readwrite("weight_bytes", &WorkloadProfile::weight_bytes)
      .def_readwrite("batch_bytes", &WorkloadProfile::batch_bytes)
      .def_readwrite("segment_overhead_bytes", &WorkloadProfile::segment_overhead_bytes)
      .def_readwrite("precisions", &WorkloadProfile::precisions)
      .def_readwrite("notes", &WorkloadProfile::notes)
      .def_readwrite("non_reentrant_checkpoint", &WorkloadProfile::non_reentrant_checkpoint)
      .def("to_json", [](const WorkloadProfile& p) { return profile_json(p).dump(); })
      .def_static("from_json", [](const std::string& text) { return profile_from_json(nlohmann::json::parse(text)); });
  py::class_<OptimizerCost>(m, "OptimizerCost")
      .def(py::init([](int64_t state_bytes, int64_t step_bytes, double seconds, const std::string& state) {
             OptimizerCost c;
             c.state_bytes = state_bytes;
             c.step_bytes = step_bytes;
             c.seconds = seconds;
             c.state = parse_state_precision(state);
             return c;
           }),
           py::arg("state_bytes"), py::arg("step_bytes"), py::arg("seconds"), py::arg("state") = "fp32")
      .def_readonly("state_bytes", &OptimizerCost::state_bytes)
      .def_readonly("step_bytes", &OptimizerCost::step_bytes)
      .def_readonly("seconds", &OptimizerCost::seconds)
      .def_property_readonly("state", [](const OptimizerCost& c) { return std::string(state_precision_name(c.state)); });
}

void bind_planner(py::module_& m) {
  py::class_<Planner>(m, "Planner")
      .def(py::init<WorkloadProfile, PlanRequest>())
      .def("plan",
           [](const Planner& p, int64_t budget) {
             Plan plan;
             {
               py::gil_scoped_release release;  // the search; the dict below needs the GIL
               plan = p.plan(budget);
             }
             return plan_dict(plan);
           })
      .def(
          "evaluate",
          [](const Planner& p, int64_t micro_batch, const std::string& precision, const std::vector<std::pair<int, int>>& segments,
             int64_t budget, const std::string& state, bool optimizer_offloaded) {
            CheckpointPlan checkpoint;
            checkpoint.segments = segments;
            OffloadPlan offload;
            offload.optimizer = optimizer_offloaded;
            return plan_dict(p.evaluate(micro_batch, parse_precision(precision), checkpoint, budget,
                                        parse_state_precision(state), 0, offload));
          },
          py::arg("micro_batch"), py::arg("precision"), py::arg("segments"), py::arg("budget"), py::arg("state"),
          py::arg("optimizer_offloaded") = false)
      .def("profile", &Planner::profile)
      .def("floor_bytes", &Planner::floor_bytes, py::call_guard<py::gil_scoped_release>())
      .def("profile_json", [](const Planner& p) { return profile_json(p.profile()).dump(); });
  // The optimizer's costs by the C++ rule (profile.h): `step` steps the caller's optimizer (the
  // user's, a copy), with the GIL taken back while it runs.
  m.def(
      "measure_optimizer_steps",
      [](const std::function<void()>& step, const std::string& state, Tracker& tracker) {
        TrackerScope scope(tracker.tracker);
        py::gil_scoped_release release;
        return measure_optimizer_steps(step, parse_state_precision(state), *tracker.tracker, tracker.counted);
      },
      py::arg("step"), py::arg("state"), py::arg("tracker"));
  m.def("block_costs_at", [](const PrecisionProfile& p, int64_t micro_batch) { return block_costs_at(p, micro_batch).blocks; });
  m.def("modelled_plain_peak", [](const PrecisionProfile& p, int64_t micro_batch) {
    return evaluate_schedule(block_costs_at(p, micro_batch), {}).peak_bytes;
  });
  m.def("precision_supported", [](const std::string& precision, const std::string& device) {
    std::string why;
    const bool ok = precision_supported(parse_precision(precision), c10::Device(device).type(), &why);
    return py::make_tuple(ok, why);
  });
}

// A plan per batch shape (batch_shape.h): `plan_json` is the plan `planner` made (plan_dict's "json").
void bind_shapes(py::module_& m) {
  py::class_<LengthProfile>(m, "LengthProfile")
      .def(py::init([](int64_t length, PrecisionProfile profile) { return LengthProfile{length, std::move(profile)}; }))
      .def_readonly("length", &LengthProfile::length)
      .def_readonly("profile", &LengthProfile::profile);
  m.def("lengths_to_profile", &lengths_to_profile);
  m.def("profile_at_length", &profile_at_length, py::arg("measured"), py::arg("length"));
  py::class_<ShapePlanner>(m, "ShapePlanner")
      .def(py::init([](const Planner& planner, const std::string& plan_json, int64_t length, std::vector<LengthProfile> shorter) {
        const int blocks = static_cast<int>(planner.profile().precisions.front().large.blocks.size());
        return ShapePlanner(planner, plan_from_json(nlohmann::json::parse(plan_json), blocks), length, std::move(shorter));
      }))
      .def("choose", [](ShapePlanner& s, int64_t samples, int64_t length) { return plan_dict(s.choose(samples, length)); },
           py::arg("samples"), py::arg("length"))
      .def(
          "evaluate",
          [](const ShapePlanner& s, int64_t samples, int64_t length, int64_t micro_batch,
             const std::vector<std::pair<int, int>>& segments) {
            CheckpointPlan checkpoint;
            checkpoint.segments = segments;
            return plan_dict(s.evaluate(samples, length, micro_batch, checkpoint));
          },
          py::arg("samples"), py::arg("length"), py::arg("micro_batch"), py::arg("segments"))
      .def("longest", &ShapePlanner::longest, py::call_guard<py::gil_scoped_release>())
      .def("largest", &ShapePlanner::largest, py::call_guard<py::gil_scoped_release>())
      .def_property_readonly("planned_length", &ShapePlanner::planned_length)
      .def_property_readonly("planned_samples", &ShapePlanner::planned_samples);
}

}  // namespace

void bind_plan(py::module_& m) {
  bind_costs(m);
  bind_request(m);
  bind_planner(m);
  bind_shapes(m);
}

}  // namespace memfit::python
