// step_costs.h — the planner's cost model: what a step holds on the device and on the host, and
// its seconds, at a precision, micro-batch, optimizer state and placement and ZeRO 3 prefetch
// depth, from the profile and the request; the bytes a budget leaves usable, and the smallest
// budget any plan reaches. Private to src/plan/ (planner.h).
#pragma once

#include <cstdint>
#include <vector>

#include "memfit/plan/plan_request.h"
#include "memfit/plan/profile.h"
#include "memfit/plan/schedule.h"
#include "plan/time_model.h"

namespace memfit {

// Each state precision the request measured (its optimizer first, then the alternatives) at
// each placement it allows, in the order of PlanRequest::optimizer_offload.
std::vector<OptimizerCost> placed_optimizer_costs(const PlanRequest& request);

// A view over the planner's profile, request and placed optimizer costs: make one where needed,
// never keep it.
class StepCosts {
 public:
  StepCosts(const WorkloadProfile& profile, const PlanRequest& request, const std::vector<OptimizerCost>& placed)
      : profile_(profile), request_(request), placed_(placed), time_(profile, request) {}

  // The optimizer's cost with `state` at a placement; throws where not measured or not allowed.
  const OptimizerCost& optimizer_cost(StatePrecision state, bool on_host = false) const;
  // The optimizer's state precisions at one placement (the spec's first), or at every one.
  std::vector<const OptimizerCost*> optimizer_candidates(bool on_host) const;
  std::vector<const OptimizerCost*> optimizer_candidates() const;

  // The modelled costs at micro-batch m (fitted, seconds scaled to the chain's), with the step's
  // fixed bytes, and at ZeRO 3 the gathered blocks and those in flight at `prefetch_depth`.
  ChainCosts costs_at(int64_t m, const PrecisionProfile& p, const OptimizerCost& optimizer, int prefetch_depth = 0) const;
  // The device's bytes through the optimizer step.
  int64_t optimizer_peak(const OptimizerCost& optimizer) const;
  // Seconds of one whole step: forward + backward of every micro-batch under `schedule` at
  // micro-batch m, then the optimizer's step (measured: 8-bit state costs more than fp32) and
  // the copies offloading it adds.
  double step_seconds(int64_t m, const PrecisionProfile& p, const Schedule& schedule, const OptimizerCost& optimizer) const;

  // Host bytes at their peak: the optimizer's, offloaded (fp32 masters and state, with the
  // gradients and the step's temporaries through the step), and what a micro-batch's passes
  // hold there (`passes`: passes_on_host).
  int64_t host_peak(const OptimizerCost& optimizer, int64_t passes) const;
  // The host's peak during micro-batch passes of size m under `schedule`: its offloaded
  // activations, and, the optimizer offloaded, the gradients there (all of them where they
  // stay from an earlier micro-batch or step, else those streamed so far).
  int64_t passes_on_host(const OptimizerCost& optimizer, int64_t m, const Schedule& schedule) const;
  bool fits_host(const OptimizerCost& optimizer) const;
  // The fewest host bytes a plan offloading the optimizer holds (0: the request allows none).
  int64_t smallest_host_bytes() const;

  // The allocated bytes a plan for `budget` may peak at: outside memory, the allocator's
  // reserved/allocated relation and the margin taken off.
  int64_t usable_bytes(int64_t budget) const;
  // The smallest budget any plan reaches (margin included).
  int64_t floor_bytes() const;

 private:
  // Whether a pass at micro-batch m finds every gradient there already (a later micro-batch of
  // the step, or gradients kept between steps), on the device or, offloaded, on the host.
  bool gradients_stay(int64_t m) const;
  int64_t weight_bytes() const;  // held through the step: all weights, or this rank's shards (ZeRO 3)
  void add_gathered_blocks(ChainCosts& costs, int prefetch_depth) const;
  // The smallest peak with the checkpoint schedule pinned (offloading what it may).
  int64_t pinned_smallest_peak(const ChainCosts& costs, const CheckpointPlan& pinned) const;

  const WorkloadProfile& profile_;
  const PlanRequest& request_;
  const std::vector<OptimizerCost>& placed_;
  TimeModel time_;
};

}  // namespace memfit
