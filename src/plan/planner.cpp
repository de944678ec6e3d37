#include "memfit/plan/planner.h"

#include <algorithm>
#include <string>
#include <utility>

#include "memfit/errors.h"
#include "plan/explain.h"
#include "plan/step_costs.h"
#include "plan/time_model.h"

namespace memfit {
namespace {

// Of plans compared in order of preference, the index of the one taken: the first that fits,
// unless a later one is faster (by more than 1%: ties go to the earlier); plans.size() when
// none fits.
size_t fastest_fitting(const std::vector<Plan>& plans) {
  size_t chosen = plans.size();
  for (size_t i = 0; i < plans.size(); ++i) {
    if (!plans[i].feasible) continue;
    if (chosen == plans.size() || plans[i].predicted_seconds < 0.99 * plans[chosen].predicted_seconds) chosen = i;
  }
  return chosen;
}

}  // namespace

Planner::Planner(WorkloadProfile profile, PlanRequest request) : profile_(std::move(profile)), request_(std::move(request)) {
  const int64_t B = request_.step.batch;
  check_option(B >= 1 && B == profile_.batch, "batch", B,
               "expected the batch the profile was measured for (" + std::to_string(profile_.batch) + ")");
  check_option(request_.step.micro_batch >= 0 && request_.step.micro_batch <= B, "micro_batch", request_.step.micro_batch,
               "expected 0 (searched) or 1 to batch (" + std::to_string(B) + ")");
  TORCH_CHECK(!profile_.precisions.empty(), "memfit::Planner: the profile holds no precision");
  TORCH_CHECK(std::any_of(profile_.precisions.begin(), profile_.precisions.end(),
                          [](const PrecisionProfile& p) { return !p.chain_seconds.empty(); }),
              "memfit::Planner: the profile holds no chain times (expected at least one precision timed)");
  TORCH_CHECK(!request_.optimizer_offload.empty(), "memfit::Planner: the request allows the optimizer nowhere");
  placed_ = placed_optimizer_costs(request_);
}

StepCosts Planner::cost_model() const { return StepCosts(profile_, request_, placed_); }
TimeModel Planner::time_model() const { return TimeModel(profile_, request_); }

int64_t Planner::smallest_host_bytes() const { return cost_model().smallest_host_bytes(); }
int64_t Planner::floor_bytes() const { return cost_model().floor_bytes(); }

ChainCosts Planner::costs_at(int64_t m) const { return cost_model().costs_at(m, profile_.precisions.front(), request_.optimizer); }
ChainCosts Planner::costs_at(int64_t m, Precision precision) const {
  return cost_model().costs_at(m, precision_profile(profile_, precision), request_.optimizer);
}

MeasuredCosts Planner::measured_costs() const {
  MeasuredCosts costs;
  costs.profile = profile_;
  costs.optimizer = {request_.optimizer};
  costs.optimizer.insert(costs.optimizer.end(), request_.optimizer_alternatives.begin(), request_.optimizer_alternatives.end());
  return costs;
}

std::vector<int64_t> Planner::untimed_sizes(const Plan& plan) const { return time_model().untimed_sizes(plan); }

std::vector<std::pair<Precision, int64_t>> Planner::untimed_rival_sizes(const Plan& plan, double slack,
                                                                       double extrapolated_slack) const {
  std::vector<std::pair<Precision, int64_t>> out;
  const auto add = [&out, this](const Plan& p) {
    for (int64_t m : untimed_sizes(p)) {
      const std::pair<Precision, int64_t> size{p.config.precision, m};
      if (std::find(out.begin(), out.end(), size) == out.end()) out.push_back(size);
    }
  };
  add(plan);
  if (!plan.feasible) return out;
  const StepCosts costs = cost_model();
  const auto usable = costs.usable_bytes(plan.budget_bytes);
  const OptimizerCost& optimizer = costs.optimizer_cost(plan.config.optimizer.state, plan.config.offload.optimizer);
  for (const auto& pp : profile_.precisions) {
    const int64_t largest_timed = pp.chain_seconds.empty() ? 0 : pp.chain_seconds.back().micro_batch;
    for (int64_t m : candidate_sizes()) {
      const Plan rival = best_plan_at(m, pp, optimizer, usable);
      const double allowed = m > largest_timed ? extrapolated_slack : slack;
      if (rival.feasible && rival.predicted_seconds <= (1.0 + allowed) * plan.predicted_seconds) add(rival);
    }
  }
  return out;
}

bool Planner::profiled(Precision precision) const {
  return std::any_of(profile_.precisions.begin(), profile_.precisions.end(),
                     [precision](const PrecisionProfile& p) { return p.precision == precision; });
}

void Planner::add_precision(PrecisionProfile profile) {
  TORCH_CHECK(!profiled(profile.precision), "memfit::Planner::add_precision: ", precision_name(profile.precision),
              " was profiled already");
  profile_.precisions.push_back(std::move(profile));
}

void Planner::add_chain_seconds(Precision precision, int64_t m, double seconds) {
  memfit::add_chain_seconds(profile_, precision, m, seconds);
}

TimingReference Planner::timing_reference(Precision precision) const { return time_model().timing_reference(precision); }

void Planner::require_relation(double reserved_per_allocated) {
  request_.reserved_per_allocated = std::max(request_.reserved_per_allocated, reserved_per_allocated);
}

Schedule Planner::uniform(int64_t m, int segments) const {
  const ChainCosts c = costs_at(m);
  const int n = static_cast<int>(c.blocks.size());
  const int length = (n + segments - 1) / segments;
  std::vector<std::pair<int, int>> s;
  for (int start = 0; start + length < n; start += length) s.emplace_back(start, std::min(n, start + length) - 1);
  return evaluate_schedule(c, s);
}

Plan Planner::prediction_base(int64_t budget) const {
  Plan p;
  p.budget_bytes = budget;
  p.margin = request_.margin;
  p.config = request_.step;
  p.baseline_precision = profile_.precisions.front().precision;
  p.config.precision = p.baseline_precision;
  const Schedule plain = evaluate_schedule(costs_at(profile_.batch), {});
  p.plain_predicted_peak = std::max(plain.peak_bytes, cost_model().optimizer_peak(request_.optimizer));
  p.plain_predicted_seconds = plain.seconds + request_.optimizer.seconds;
  p.floor_bytes = floor_bytes();
  p.checkpoint_pinned = request_.checkpoint.has_value();
  return p;
}

Plan Planner::evaluate(int64_t m, Precision precision, const CheckpointPlan& checkpoint, int64_t budget,
                       std::optional<StatePrecision> state, int prefetch_depth, const OffloadPlan& offload) const {
  if (budget <= 0) budget = request_.budget_bytes;
  check_option(m >= 1 && m <= profile_.batch, "micro_batch", m, "expected 1 to batch (" + std::to_string(profile_.batch) + ")");
  const PrecisionProfile& pp = precision_profile(profile_, precision);
  const StepCosts costs = cost_model();
  const OptimizerCost& optimizer = costs.optimizer_cost(state ? *state : request_.optimizer.state, offload.optimizer);
  Plan p = prediction_base(budget);
  p.config.micro_batch = m;
  p.config.precision = precision;
  p.config.checkpoint = checkpoint;
  p.config.optimizer = request_.step.optimizer.with_state(optimizer.state);
  p.config.prefetch_depth = prefetch_depth;
  p.config.offload = offload;
  const Schedule s = evaluate_schedule(costs.costs_at(m, pp, optimizer, prefetch_depth), checkpoint.segments,
                                       offload.activation_blocks);
  p.predicted_peak = std::max(s.peak_bytes, costs.optimizer_peak(optimizer));
  p.predicted_host_peak = costs.host_peak(optimizer, costs.passes_on_host(optimizer, m, s));
  p.predicted_seconds = costs.step_seconds(m, pp, s, optimizer);
  const auto usable = costs.usable_bytes(budget);
  p.feasible = p.predicted_peak <= usable && costs.fits_host(optimizer);
  return p;
}

std::vector<int64_t> Planner::candidate_sizes() const {
  if (request_.step.micro_batch > 0) return {request_.step.micro_batch};
  // A size some precision could not train on fails when run, and timing it as a rival would fail the plan.
  int64_t fewest = 1;
  for (const auto& p : profile_.precisions) fewest = std::max(fewest, p.fewest_samples);
  std::vector<int64_t> sizes;
  for (int64_t m = profile_.batch; m >= 1; m = m == 1 ? 0 : (m + 1) / 2) {
    if (m >= fewest) sizes.push_back(m);
  }
  return sizes;
}

Plan Planner::unfitted_plan(Precision precision, StatePrecision state) const {
  Plan p;
  p.config = request_.step;
  p.config.precision = precision;
  p.config.optimizer = request_.step.optimizer.with_state(state);
  return p;
}

Plan Planner::best_plan_at(int64_t m, const PrecisionProfile& pp, const OptimizerCost& optimizer, int64_t usable) const {
  Plan p = unfitted_plan(pp.precision, optimizer.state);
  for (int depth : request_.prefetch_depths) {
    p = best_plan_at(m, pp, optimizer, depth, usable);
    if (p.feasible) break;
  }
  return p;
}

Plan Planner::best_plan_at(int64_t m, const PrecisionProfile& pp, const OptimizerCost& optimizer, int prefetch_depth,
                           int64_t usable) const {
  Plan p = unfitted_plan(pp.precision, optimizer.state);
  const StepCosts costs = cost_model();
  if (costs.optimizer_peak(optimizer) > usable || !costs.fits_host(optimizer)) return p;
  const ChainCosts c = costs.costs_at(m, pp, optimizer, prefetch_depth);
  // A pinned schedule still leaves which other blocks are offloaded to choose, where allowed.
  const Schedule s = !request_.checkpoint ? solve_schedule(c, usable)
                     : c.activation_offload ? solve_schedule(c, usable, 0, &request_.checkpoint->segments)
                                            : evaluate_schedule(c, request_.checkpoint->segments);
  if (!s.feasible || s.peak_bytes > usable) return p;
  const int64_t host = costs.host_peak(optimizer, costs.passes_on_host(optimizer, m, s));
  if (request_.host_budget_bytes > 0 && host > request_.host_budget_bytes) return p;
  p.feasible = true;
  p.config.micro_batch = m;
  p.config.checkpoint.segments = s.segments;
  p.config.prefetch_depth = prefetch_depth;
  p.config.offload.optimizer = optimizer.on_host;
  p.config.offload.activation_blocks = s.offloaded;
  p.predicted_peak = std::max(s.peak_bytes, costs.optimizer_peak(optimizer));
  p.predicted_host_peak = host;
  p.predicted_seconds = costs.step_seconds(m, pp, s, optimizer);
  return p;
}

Plan Planner::best_plan_of(const PrecisionProfile& pp, const OptimizerCost& optimizer, int64_t usable) const {
  // Micro-batch sizes tried: the pinned one, or B, B/2, B/4, ... 1. Ties (within 1%) go to
  // the larger micro-batch.
  Plan best = unfitted_plan(pp.precision, optimizer.state);
  for (int64_t m : candidate_sizes()) {
    Plan p = best_plan_at(m, pp, optimizer, usable);
    if (p.feasible && !(best.feasible && p.predicted_seconds >= 0.99 * best.predicted_seconds)) best = std::move(p);
  }
  return best;
}

Plan Planner::best_plan_with(const OptimizerCost& optimizer, int64_t usable) const {
  // The fastest fitting plan of each precision, then the fastest of those (ties, within 1%, go
  // to the earlier precision), with the reasons for its precision in its notes.
  std::vector<Plan> best_of;
  for (const auto& pp : profile_.precisions) best_of.push_back(best_plan_of(pp, optimizer, usable));
  const size_t chosen = fastest_fitting(best_of);
  if (chosen == best_of.size()) return best_of.front();
  Plan p = best_of[chosen];
  explain_choice(p, best_of, profile_);
  return p;
}

Plan Planner::best_plan_placed(bool on_host, int64_t usable, int64_t budget) const {
  // The best plan with each optimizer state; the first (the spec's, fp32 under auto) is kept
  // unless another fits when it does not, or is faster (within 1%) with its optimizer step.
  const StepCosts costs = cost_model();
  std::vector<Plan> best_with;
  for (const OptimizerCost* optimizer : costs.optimizer_candidates(on_host)) {
    best_with.push_back(best_plan_with(*optimizer, usable));
  }
  const size_t chosen = fastest_fitting(best_with);
  if (chosen == best_with.size()) return best_with.front();
  Plan p = best_with[chosen];
  explain_state_choice(p, best_with, budget, costs);
  return p;
}

Plan Planner::plan(int64_t budget) const {
  if (budget <= 0) budget = request_.budget_bytes;
  Plan p = prediction_base(budget);
  p.notes = profile_.notes;
  const StepCosts costs = cost_model();
  const auto usable = costs.usable_bytes(budget);
  // The best plan at each placement of the optimizer; the first (the device, unless pinned) is
  // kept unless another fits when it does not, or is faster (within 1%).
  std::vector<Plan> best_placed;
  for (bool on_host : request_.optimizer_offload) best_placed.push_back(best_plan_placed(on_host, usable, budget));
  const size_t chosen = fastest_fitting(best_placed);
  if (chosen == best_placed.size()) {
    explain_nothing_fits(p, budget, request_, costs);
    return p;
  }
  Plan& best = best_placed[chosen];
  explain_placement(best, best_placed, request_);
  p.feasible = true;
  p.config = best.config;
  p.predicted_peak = best.predicted_peak;
  p.predicted_host_peak = best.predicted_host_peak;
  p.predicted_seconds = best.predicted_seconds;
  p.notes.insert(p.notes.end(), best.notes.begin(), best.notes.end());
  explain_offload_and_prefetch(p, request_);
  return p;
}

}  // namespace memfit
