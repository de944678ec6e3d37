// time_model.h — the planner's time model: the plain chain's seconds by micro-batch, from the
// points timed (profile.h; a line through the nearest two between and beyond them, a precision
// not timed yet guessed from the timed one by their blocks' ratio), what the blocks' seconds
// are scaled to, and which sizes a plan runs on a guess. Private to src/plan/ (planner.h).
#pragma once

#include <cstdint>
#include <vector>

#include "memfit/plan/plan.h"
#include "memfit/plan/plan_request.h"
#include "memfit/plan/profile.h"

namespace memfit {

// The profile's measurements at `precision` (c10::Error where it was not profiled).
const PrecisionProfile& precision_profile(const WorkloadProfile& profile, Precision precision);

// A view over the planner's profile and request: make one where needed, never keep it.
class TimeModel {
 public:
  TimeModel(const WorkloadProfile& profile, const PlanRequest& request) : profile_(profile), request_(request) {}

  // The plain chain's forward + backward at micro-batch m.
  double chain_seconds(int64_t m, const PrecisionProfile& p) const;
  // The blocks' seconds of `costs` (at m, precision p) scaled to sum to chain_seconds: they only
  // divide the chain's time among blocks.
  void scale_to_chain(ChainCosts& costs, int64_t m, const PrecisionProfile& p) const;
  // Seconds the host <-> device copies add to a step at micro-batch m.
  double offload_seconds(int64_t m, const OptimizerCost& optimizer) const;
  // The first precision whose chain was timed.
  const PrecisionProfile& timed_precision() const;
  // Planner::timing_reference and Planner::untimed_sizes (planner.h).
  TimingReference timing_reference(Precision precision) const;
  std::vector<int64_t> untimed_sizes(const Plan& plan) const;

 private:
  const WorkloadProfile& profile_;
  const PlanRequest& request_;
};

// Adds (or replaces) a timed point of `precision`'s chain, keeping the points in order.
void add_chain_seconds(WorkloadProfile& profile, Precision precision, int64_t micro_batch, double seconds);

}  // namespace memfit
