#include "memfit/plan/optimizer_costs.h"

#include <torch/torch.h>

#include <limits>
#include <memory>

#include "memfit/runtime/optimizer.h"
#include "memfit/techniques/grads.h"
#include "memfit/techniques/optimizer_8bit.h"
#include "plan/profile_clock.h"

namespace memfit {

OptimizerCost measure_optimizer(const OptimizerSpec& spec, const std::vector<at::Tensor>& params, MemoryTracker& tracker) {
  OptimizerCost cost;
  cost.state = spec.state == StatePrecision::k8Bit ? StatePrecision::k8Bit : StatePrecision::kFP32;
  if (params.empty()) return cost;
  std::vector<at::Tensor> saved;
  {
    at::NoGradGuard no_grad;
    for (const auto& p : params) saved.push_back(p.detach().clone());
    for (auto p : params) p.mutable_grad() = at::zeros_like(p);
  }
  // 8-bit state: its maps are made first (once per process), so that the step measures the
  // state alone; the fronts count them among the resident bytes (make_8bit_maps_if_used).
  if (cost.state == StatePrecision::k8Bit) {
    dynamic_map(true, params.front().device());
    dynamic_map(false, params.front().device());
  }
  {
    std::unique_ptr<torch::optim::Optimizer> optimizer;
    const auto step = [&] {
      if (!optimizer) optimizer = make_optimizer(spec.with_state(cost.state), params);
      optimizer->step();
    };
    cost = measure_optimizer_steps(step, cost.state, tracker, memory_device_of(params.front().device()));
  }
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < params.size(); ++i) params[i].detach().copy_(saved[i]);
  zero_grad(params, true);
  return cost;
}

OptimizerCost measure_optimizer_steps(const std::function<void()>& step, StatePrecision state, MemoryTracker& tracker,
                                      MemoryDevice device) {
  OptimizerCost cost;
  cost.state = state;
  const int64_t before = tracker.current(device);
  step();  // makes the state (and the 8-bit maps, the first time in this process)
  cost.state_bytes = tracker.current(device) - before;
  const int64_t steady = tracker.current(device);
  tracker.reset_peak();
  cost.seconds = std::numeric_limits<double>::infinity();
  for (int i = 0; i < 2; ++i) {  // steady state: the best of two
    const auto t0 = ProfileClock::now();
    step();
    cost.seconds = std::min(cost.seconds, seconds_since(t0));
  }
  cost.step_bytes = std::max<int64_t>(0, tracker.peak(device) - steady);
  return cost;
}

std::vector<OptimizerCost> measure_optimizer_states(const OptimizerSpec& spec, const std::vector<at::Tensor>& params,
                                                    MemoryTracker& tracker) {
  std::vector<OptimizerCost> out{measure_optimizer(spec, params, tracker)};
  if (spec.state == StatePrecision::kAuto && has_8bit_state(spec.family)) {
    out.push_back(measure_optimizer(spec.with_state(StatePrecision::k8Bit), params, tracker));
  }
  return out;
}

}  // namespace memfit
