// Bindings of techniques/optimizer_8bit.h: Adam/AdamW whose moments are kept blockwise in 8
// bits, stepping the user's own parameters (python/memfit/_optim8bit.py wraps it as a
// torch.optim.Optimizer), and its cost as the planner measures it. Also where an offloaded
// optimizer's state goes back to (runtime/optimizer_offload.h), for memfit.remove.
#include <torch/extension.h>
#include <pybind11/stl.h>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "bindings.h"
#include "memfit/plan/profile.h"
#include "memfit/runtime/optimizer.h"
#include "memfit/runtime/optimizer_offload.h"
#include "memfit/techniques/optimizer_8bit.h"
#include "tracker.h"

namespace py = pybind11;

namespace memfit::python {
namespace {

// The hyperparameters of one param group, as torch.optim.AdamW's group holds them.
struct GroupOptions {
  double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 1e-2;
};

Adam8bitOptions options_of(const GroupOptions& g, bool decoupled) {
  Adam8bitOptions o(g.lr);
  o.betas({g.beta1, g.beta2}).eps(g.eps).weight_decay(g.weight_decay).decoupled_weight_decay(decoupled);
  return o;
}

const char* const kStateNames[] = {"exp_avg", "exp_avg_sq", "exp_avg_codes", "exp_avg_absmax", "exp_avg_sq_codes",
                                   "exp_avg_sq_absmax"};

OptimizerSpec spec_8bit(bool decoupled) {
  OptimizerSpec spec;
  spec.family = decoupled ? OptimizerFamily::kAdamW : OptimizerFamily::kAdam;
  spec.state = StatePrecision::k8Bit;
  return spec;
}

class Adam8bitHandle {
 public:
  Adam8bitHandle(const std::vector<std::vector<at::Tensor>>& groups, const std::vector<GroupOptions>& options, bool decoupled)
      : decoupled_(decoupled) {
    TORCH_CHECK(groups.size() == options.size() && !groups.empty(), "memfit: one option set per param group");
    std::vector<torch::optim::OptimizerParamGroup> param_groups;
    for (size_t i = 0; i < groups.size(); ++i) {
      param_groups.emplace_back(groups[i], std::make_unique<Adam8bitOptions>(options_of(options[i], decoupled)));
    }
    optimizer_ = std::make_unique<Adam8bit>(std::move(param_groups), options_of(options[0], decoupled));
  }

  void set_group(size_t index, const GroupOptions& g) {
    auto& o = static_cast<Adam8bitOptions&>(optimizer_->param_groups().at(index).options());
    o.lr(g.lr).betas({g.beta1, g.beta2}).eps(g.eps).weight_decay(g.weight_decay);
  }
  void step() { optimizer_->step(); }
  int64_t skipped_updates() const { return optimizer_->skipped_updates(); }

  // The parameter's state: {"step": n, "exp_avg": ..., ...} (undefined tensors left out), or None.
  py::object state(const at::Tensor& param) const {
    auto it = optimizer_->state().find(param_state_key(param));
    if (it == optimizer_->state().end()) return py::none();
    const ParamStateRecord r = read_param_state(*it->second);
    py::dict d;
    d["step"] = r.step;
    for (size_t i = 0; i < r.tensors.size(); ++i) {
      if (r.tensors[i].defined()) d[kStateNames[i]] = r.tensors[i];
    }
    return std::move(d);
  }
  // The parameter's state carried over from fp32 Adam/AdamW moments (adam8bit_state_from_fp32).
  void set_state_from_fp32(const at::Tensor& param, int64_t step, const at::Tensor& exp_avg, const at::Tensor& exp_avg_sq) {
    optimizer_->state()[param_state_key(param)] = adam8bit_state_from_fp32(step, exp_avg, exp_avg_sq);
  }
  // The parameter's state as fp32 Adam/AdamW keeps it, (step, exp_avg, exp_avg_sq), taken out of
  // this optimizer (fp32_state_from_adam8bit), or None: the 8-bit codes go as the fp32 moments come.
  py::object take_state_as_fp32(const at::Tensor& param) {
    auto it = optimizer_->state().find(param_state_key(param));
    if (it == optimizer_->state().end()) return py::none();
    const AdamFp32State s = fp32_state_from_adam8bit(static_cast<const Adam8bitParamState&>(*it->second), param);
    optimizer_->state().erase(it);
    return py::make_tuple(s.step, s.exp_avg, s.exp_avg_sq);
  }
  // Puts a state read by state() back (a loaded state_dict).
  void set_state(const at::Tensor& param, int64_t step, const py::dict& tensors) {
    ParamStateRecord r;
    r.step = step;
    for (const char* name : kStateNames) {
      r.tensors.push_back(tensors.contains(name) ? tensors[name].cast<at::Tensor>() : at::Tensor());
    }
    optimizer_->state()[param_state_key(param)] = make_param_state(spec_8bit(decoupled_), r);
  }

 private:
  bool decoupled_;
  std::unique_ptr<Adam8bit> optimizer_;
};

}  // namespace

void bind_optim(py::module_& m) {
  py::class_<GroupOptions>(m, "Adam8bitGroupOptions")
      .def(py::init([](double lr, double beta1, double beta2, double eps, double weight_decay) {
             return GroupOptions{lr, beta1, beta2, eps, weight_decay};
           }),
           py::arg("lr"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"));
  py::class_<Adam8bitHandle>(m, "Adam8bit")
      .def(py::init<const std::vector<std::vector<at::Tensor>>&, const std::vector<GroupOptions>&, bool>())
      .def("set_group", &Adam8bitHandle::set_group)
      .def("step", &Adam8bitHandle::step, py::call_guard<py::gil_scoped_release>())
      .def("skipped_updates", &Adam8bitHandle::skipped_updates)
      .def("state", &Adam8bitHandle::state)
      .def("set_state", &Adam8bitHandle::set_state)
      .def("set_state_from_fp32", &Adam8bitHandle::set_state_from_fp32)
      .def("take_state_as_fp32", &Adam8bitHandle::take_state_as_fp32)
      .def_static("max_error", [](bool is_signed) { return dynamic_map(is_signed).max_error(); });
  m.def("make_dynamic_maps", [](const std::string& device) {
    dynamic_map(true, c10::Device(device));
    dynamic_map(false, c10::Device(device));
  }, "Makes the 8-bit state's maps on `device` (once per process; they are constants kept for its life).");
  m.def("dynamic_maps_bytes", &dynamic_maps_bytes);
  m.def("state_tensor_to_device", &state_tensor_to_device, py::arg("host_state"), py::arg("device_parameter"),
        "An offloaded optimizer's state tensor brought back where the optimizer keeps it for the device parameter.");
  m.def(
      "dequantize_8bit",
      [](const at::Tensor& codes, const at::Tensor& absmax, bool is_signed) {
        return dequantize_blockwise(codes, absmax, dynamic_map(is_signed, codes.device()));
      },
      "The fp32 values of 8-bit codes (flat): an Adam8bit moment as the step reads it.");
  m.def(
      "measure_8bit_cost",
      [](Tracker& tracker, const std::vector<at::Tensor>& params, double lr, double beta1, double beta2,
         double weight_decay, bool decoupled) {
        OptimizerSpec spec = spec_8bit(decoupled);
        spec.lr = lr;
        spec.beta1 = beta1;
        spec.beta2 = beta2;
        spec.weight_decay = weight_decay;
        TrackerScope scope(tracker.tracker);
        py::gil_scoped_release release;
        return measure_optimizer(spec, params, *tracker.tracker);
      },
      "Three real 8-bit Adam steps on `params` (zero gradients; put back after): state bytes, step bytes, seconds.");
  // An optimizer as the planner knows it: torch.optim's class name -> its family (None: another).
  m.def("optimizer_family", [](const std::string& class_name) -> std::optional<std::string> {
    const auto family = optimizer_family_of_class(class_name);
    return family ? std::optional<std::string>(optimizer_family_name(*family)) : std::nullopt;
  });
  m.def("has_8bit_state", [](const std::string& family, bool amsgrad, bool maximize) {
    return has_8bit_state(parse_optimizer_family(family), amsgrad, maximize);
  });
}

}  // namespace memfit::python
