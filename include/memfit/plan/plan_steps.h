// plan_steps.h — a plan's configuration run for real: a few training steps with a fresh
// optimizer, as verify_plan (verify.h) times and measures them and fit_reserved
// (reserved_fit.h) records them, and a guard that puts back what those steps change.
//
//   {
//     memfit::ModelStateGuard keep(workload);          // weights, gradients, buffers, random state
//     memfit::PlanSteps run = memfit::run_plan_steps(workload, batch, plan.config, tracker, 3);
//   }                                                  // all put back, bit for bit
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

#include "memfit/measure/memory_tracker.h"
#include "memfit/runtime/step_config.h"
#include "memfit/runtime/workload.h"
#include "memfit/techniques/rng.h"

namespace memfit {

struct PlanSteps {
  double best_seconds = 0;  // the fastest steady-state step (the first only makes the state)
  int64_t peak = 0;         // the highest peak of the steady-state steps on the batch's device
};

// `steps` (>= 2) steps of `config` on `batch` with a fresh optimizer (config.optimizer; on the
// host where config.offload says so): the first makes the optimizer's state, the others run in
// steady state. An out-of-memory error propagates, with the step's gradients released.
PlanSteps run_plan_steps(Workload& workload, const Batch& batch, const StepConfig& config, MemoryTracker& tracker,
                         int steps);

// What training steps change, copied to the host when made and put back when it goes: the
// chain's weights and buffers (values), its gradients (present or not) and the random state.
// The copies live in the host space (memory_space.h), not on the device being measured.
class ModelStateGuard {
 public:
  explicit ModelStateGuard(Workload& workload);
  ~ModelStateGuard();
  ModelStateGuard(const ModelStateGuard&) = delete;
  ModelStateGuard& operator=(const ModelStateGuard&) = delete;

 private:
  std::vector<at::Tensor> tensors_;  // parameters, then buffers
  std::vector<at::Tensor> values_, gradients_;
  RngState rng_;
};

}  // namespace memfit
