// planner.h — the fastest step configuration that fits a budget, searched over measured costs.
//
// 1. Costs: a WorkloadProfile (profile.h), measured or written by hand, and this process's
//    optimizer cost (measured: profile.h's measure_optimizer), gradients and extra bytes.
// 2. Solve: for each profiled precision and micro-batch size, the least-recompute checkpoint
//    schedule under the budget minus a margin (schedule.h's DP).
// 3. Search: precision, micro-batch x accumulation and schedule minimizing the predicted step
//    time; ties go to the first precision (the baseline, fp32) and the larger micro-batch.
//    With the optimizer's state precision auto, the state is one more dimension: the spec's
//    fp32 state is kept unless the 8-bit state lets a faster plan fit (optimizer step
//    included) or nothing fits otherwise.
//
// The Planner runs no model: everything it says follows from the numbers it was given. What
// measures those numbers and times what the search guessed is plan/job.h; what runs a plan to
// check it is verify.h. The Planner is the search; what it searches over is private to
// src/plan/: the cost model (step_costs.h), the time model (time_model.h) and the notes'
// text (explain.h). The request is plan_request.h, the plan plan.h.
#pragma once

#include <cstdint>
#include <optional>
#include <utility>
#include <vector>

#include "memfit/plan/plan.h"
#include "memfit/plan/plan_request.h"
#include "memfit/plan/profile.h"
#include "memfit/plan/profile_cache.h"
#include "memfit/plan/schedule.h"

namespace memfit {

class StepCosts;  // the cost model (src/plan/step_costs.h)
class TimeModel;  // the time model (src/plan/time_model.h)

class Planner {
 public:
  Planner(WorkloadProfile profile, PlanRequest request);
  // The plan for a budget (request.budget_bytes unless given).
  Plan plan(int64_t budget_bytes = 0) const;
  // The prediction for one configuration, fitting or not (feasible says whether it fits);
  // state: the optimizer's state precision (unset: request.optimizer's).
  Plan evaluate(int64_t micro_batch, Precision precision, const CheckpointPlan& checkpoint, int64_t budget_bytes = 0,
                std::optional<StatePrecision> state = std::nullopt, int prefetch_depth = 0,
                const OffloadPlan& offload = {}) const;
  // The smallest budget any plan reaches (margin included): Plan::floor_bytes without planning.
  int64_t floor_bytes() const;
  // The fewest host bytes a plan offloading the optimizer holds (0: the request allows none).
  int64_t smallest_host_bytes() const;
  // The modelled costs at micro-batch m (fitted), with the step's fixed bytes; precision: the
  // baseline unless given.
  ChainCosts costs_at(int64_t m) const;
  ChainCosts costs_at(int64_t m, Precision precision) const;
  // checkpoint_sequential's schedule at micro-batch m: `segments` runs of equal length, all
  // but the last recomputed (baseline precision).
  Schedule uniform(int64_t m, int segments) const;
  const WorkloadProfile& profile() const { return profile_; }
  // What it plans from, in the profile cache's form: the profile (grown by sizes timed for the
  // search) and the optimizer costs.
  MeasuredCosts measured_costs() const;
  // The micro-batch sizes `plan` runs (its own, and a smaller last one) that its precision's
  // chain was not timed at: there the time model guessed (a line through timed sizes, which
  // misses per-call costs below them and cache effects above them). A precision not timed at
  // all adds its two profiled sizes: its first timing makes its line.
  std::vector<int64_t> untimed_sizes(const Plan& plan) const;
  // The untimed sizes (with their precision) of `plan` and of each precision's best plan at
  // each micro-batch size that fits plan.budget_bytes and is predicted within `slack` of it
  // (`extrapolated_slack` above the precision's largest timed size).
  std::vector<std::pair<Precision, int64_t>> untimed_rival_sizes(const Plan& plan, double slack,
                                                                 double extrapolated_slack) const;
  // Whether `precision` was profiled (a mixed precision may have been dropped: profile.h).
  bool profiled(Precision precision) const;
  // Adds a precision profiled later (profile_precision in profile.h; its chain untimed: it is
  // guessed from its blocks until timed). Throws if it is there already.
  void add_precision(PrecisionProfile profile);
  // Raises the reserved/allocated relation plans are made with from now on (PlanRequest::
  // reserved_per_allocated: what a replay on the caching allocator showed); never lowers it.
  void require_relation(double reserved_per_allocated);
  // Adds a timed point to a precision's time model (time_plain_chain in profile.h).
  void add_chain_seconds(Precision precision, int64_t micro_batch, double seconds);
  // What sizes timed later at `precision` are timed beside: its smaller profiled size (cheap),
  // or its first timed point; for a precision not timed yet, the timed precision's.
  TimingReference timing_reference(Precision precision) const;
  const PlanRequest& request() const { return request_; }

 private:
  // Views over the members (the cost model and the time model), made per use: a Planner is copied.
  StepCosts cost_model() const;
  TimeModel time_model() const;
  Plan prediction_base(int64_t budget) const;
  // The pinned micro-batch, or B, B/2, B/4, ... 1, none under a precision's fewest_samples.
  std::vector<int64_t> candidate_sizes() const;
  Plan unfitted_plan(Precision precision, StatePrecision state) const;  // feasible false, config defaults
  // The best plan at micro-batch m (not feasible when none fits `usable`): at the first of the
  // request's prefetch depths that fits, or at one.
  Plan best_plan_at(int64_t m, const PrecisionProfile& p, const OptimizerCost& optimizer, int64_t usable) const;
  Plan best_plan_at(int64_t m, const PrecisionProfile& p, const OptimizerCost& optimizer, int prefetch_depth,
                    int64_t usable) const;
  // The best plan of one precision (over micro-batch sizes), of every precision with one
  // optimizer cost, and with the optimizer at one placement (its state chosen), or not
  // feasible; the last two say why in its notes (explain.h).
  Plan best_plan_of(const PrecisionProfile& p, const OptimizerCost& optimizer, int64_t usable) const;
  Plan best_plan_with(const OptimizerCost& optimizer, int64_t usable) const;
  Plan best_plan_placed(bool on_host, int64_t usable, int64_t budget) const;

  WorkloadProfile profile_;
  PlanRequest request_;
  std::vector<OptimizerCost> placed_;  // each state precision at each placement the request allows
};

}  // namespace memfit
