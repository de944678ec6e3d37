#include "memfit/plan/planner.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>

#include "memfit/errors.h"
#include "memfit/measure/size.h"

namespace memfit {
namespace {

// Copies of the random state alive through a training step's forward and backward: the
// trainer's from the step's start (a non-finite loss stops with the stream as the step found
// it) and the micro-batch's (an out-of-memory error takes back the failed attempt's draws).
constexpr int64_t kStepRandomStates = 2;

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
  std::vector<OptimizerCost> states{request_.optimizer};  // the spec's first
  states.insert(states.end(), request_.optimizer_alternatives.begin(), request_.optimizer_alternatives.end());
  for (bool on_host : request_.optimizer_offload) {
    for (OptimizerCost c : states) {
      c.on_host = on_host;
      placed_.push_back(c);
    }
  }
}

const PrecisionProfile& Planner::precision_profile(Precision precision) const {
  for (const auto& p : profile_.precisions) {
    if (p.precision == precision) return p;
  }
  TORCH_CHECK(false, "memfit::Planner: precision ", precision_name(precision), " was not profiled");
}

const OptimizerCost& Planner::optimizer_cost(StatePrecision state, bool on_host) const {
  for (const OptimizerCost& c : placed_) {
    if (c.state == state && c.on_host == on_host) return c;
  }
  TORCH_CHECK(false, "memfit::Planner: the optimizer was not measured with ", state_precision_name(state), " state",
              on_host ? " or is not allowed on the host" : "");
}

std::vector<const OptimizerCost*> Planner::optimizer_candidates(bool on_host) const {
  std::vector<const OptimizerCost*> out;
  for (const OptimizerCost& c : placed_) {
    if (c.on_host == on_host) out.push_back(&c);
  }
  return out;
}

std::vector<const OptimizerCost*> Planner::optimizer_candidates() const {
  std::vector<const OptimizerCost*> out;
  for (const OptimizerCost& c : placed_) out.push_back(&c);
  return out;
}

int64_t Planner::host_peak(const OptimizerCost& optimizer, int64_t passes) const {
  if (!optimizer.on_host) return passes;
  // fp32 masters of the weights and the state all along; every gradient in the step.
  const int64_t held = profile_.weight_bytes + optimizer.state_bytes;
  return held + std::max(profile_.weight_bytes + optimizer.step_bytes, passes);
}

bool Planner::gradients_stay(int64_t m) const { return m < profile_.batch || !request_.step.set_to_none; }

int64_t Planner::passes_on_host(const OptimizerCost& optimizer, int64_t m, const Schedule& schedule) const {
  if (!optimizer.on_host) return schedule.host_bytes;
  return gradients_stay(m) ? schedule.host_bytes + profile_.weight_bytes : schedule.host_first_pass_bytes;
}

double Planner::offload_seconds(int64_t m, const OptimizerCost& optimizer) const {
  if (!optimizer.on_host || request_.host_copy_bytes_per_second <= 0) return 0;
  // Each micro-batch's gradients go to the host; the updated weights come back once.
  const int64_t micro_batches = (profile_.batch + m - 1) / m;
  const double bytes = static_cast<double>(micro_batches + 1) * static_cast<double>(profile_.weight_bytes);
  return bytes / request_.host_copy_bytes_per_second;
}

int64_t Planner::smallest_host_bytes() const {
  int64_t smallest = std::numeric_limits<int64_t>::max();
  for (const OptimizerCost& c : placed_) {
    if (c.on_host) smallest = std::min(smallest, host_peak(c, 0));
  }
  return smallest == std::numeric_limits<int64_t>::max() ? 0 : smallest;
}

bool Planner::fits_host(const OptimizerCost& optimizer) const {
  return request_.host_budget_bytes <= 0 || host_peak(optimizer, 0) <= request_.host_budget_bytes;
}

ChainCosts Planner::costs_at(int64_t m) const { return costs_at(m, profile_.precisions.front(), request_.optimizer); }
ChainCosts Planner::costs_at(int64_t m, Precision precision) const {
  return costs_at(m, precision_profile(precision), request_.optimizer);
}

double Planner::chain_seconds(int64_t m, const PrecisionProfile& p) const {
  // The plain chain's seconds at m: a measured point, or the line between the two around m;
  // beyond either end, the line through the two nearest points continued (never falling with
  // m; below the smallest point never under proportional: a fixed cost per micro-batch is real,
  // a negative one is not). Off the measured points the line is a guess: plan_timing_as_needed
  // times such a size when a plan would run it.
  const auto& t = p.chain_seconds;
  if (t.empty()) {
    // Not timed yet (profile.h): the timed precision's time, scaled by the blocks' ratio.
    const PrecisionProfile& timed = timed_precision();
    const double timed_blocks = block_seconds(timed.large);
    const double ratio = timed_blocks > 0 ? block_seconds(p.large) / timed_blocks : 1.0;
    return chain_seconds(m, timed) * ratio;
  }
  const double proportional = t.front().seconds * static_cast<double>(m) / static_cast<double>(t.front().micro_batch);
  if (t.size() == 1) return proportional;
  size_t hi = 1;  // the first point at or above m (at least the second), or the last
  while (hi < t.size() - 1 && t[hi].micro_batch < m) ++hi;
  const ChainSeconds& lo_point = t[hi - 1];
  const ChainSeconds& hi_point = t[hi];
  const double slope = std::max(0.0, (hi_point.seconds - lo_point.seconds) /
                                         static_cast<double>(hi_point.micro_batch - lo_point.micro_batch));
  const double line = lo_point.seconds + slope * static_cast<double>(m - lo_point.micro_batch);
  return m < t.front().micro_batch ? std::max(line, proportional) : line;
}

MeasuredCosts Planner::measured_costs() const {
  MeasuredCosts costs{profile_, {request_.optimizer}};
  costs.optimizer.insert(costs.optimizer.end(), request_.optimizer_alternatives.begin(), request_.optimizer_alternatives.end());
  return costs;
}

std::vector<int64_t> Planner::untimed_sizes(const Plan& plan) const {
  std::vector<int64_t> sizes;
  if (!plan.feasible) return sizes;
  const PrecisionProfile& p = precision_profile(plan.config.precision);
  const auto& t = p.chain_seconds;
  const int64_t m = plan.config.micro_batch_size(), rest = profile_.batch % m;
  const auto timed = [&t](int64_t size) {
    return std::any_of(t.begin(), t.end(), [size](const ChainSeconds& c) { return c.micro_batch == size; });
  };
  std::vector<int64_t> runs{m, rest};
  if (t.empty()) runs.insert(runs.begin(), {p.small.micro_batch, p.large.micro_batch});
  for (int64_t size : runs) {
    if (size > 0 && !timed(size) && std::find(sizes.begin(), sizes.end(), size) == sizes.end()) sizes.push_back(size);
  }
  return sizes;
}

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
  const auto usable = usable_bytes(plan.budget_bytes);
  const OptimizerCost& optimizer = optimizer_cost(plan.config.optimizer.state, plan.config.offload.optimizer);
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
  for (auto& pp : profile_.precisions) {
    if (pp.precision != precision) continue;
    auto& t = pp.chain_seconds;
    auto at = std::find_if(t.begin(), t.end(), [m](const ChainSeconds& c) { return c.micro_batch >= m; });
    if (at != t.end() && at->micro_batch == m) {
      at->seconds = seconds;
    } else {
      t.insert(at, ChainSeconds{m, seconds});
    }
  }
}

const PrecisionProfile& Planner::timed_precision() const {
  for (const auto& p : profile_.precisions) {
    if (!p.chain_seconds.empty()) return p;
  }
  TORCH_CHECK(false, "memfit::Planner: no precision of the profile has chain times");
}

TimingReference Planner::timing_reference(Precision precision) const {
  const PrecisionProfile& own = precision_profile(precision);
  const PrecisionProfile& p = own.chain_seconds.empty() ? timed_precision() : own;
  for (const auto& c : p.chain_seconds) {
    if (c.micro_batch == p.small.micro_batch) return {p.precision, c};
  }
  return {p.precision, p.chain_seconds.front()};
}


ChainCosts Planner::costs_at(int64_t m, const PrecisionProfile& p, const OptimizerCost& optimizer, int prefetch_depth) const {
  ChainCosts c = block_costs_at(p, m);
  double block_seconds = 0;
  for (const auto& b : c.blocks) block_seconds += b.forward_seconds + b.backward_seconds;
  if (block_seconds > 0) {
    const double scale = chain_seconds(m, p) / block_seconds;  // the blocks' seconds only divide the chain's
    for (auto& b : c.blocks) {
      b.forward_seconds *= scale;
      b.backward_seconds *= scale;
    }
  }
  c.fixed_bytes = weight_bytes() + (optimizer.on_host ? 0 : optimizer.state_bytes) + profile_.batch_bytes +
                  request_.resident_bytes + kStepRandomStates * profile_.segment_overhead_bytes;
  // Offloaded, the gradients leave for the host as backward makes them: none wait on the device.
  c.gradients_streamed = optimizer.on_host;
  c.gradients_present = !optimizer.on_host && gradients_stay(m);
  c.segment_overhead_bytes = profile_.segment_overhead_bytes;
  c.non_reentrant = profile_.non_reentrant_checkpoint;
  // Under autocast a block's graph keeps weight copies made before it runs (the cast cache):
  // they stay on the device (Model::stays in schedule.cpp). Not at ZeRO 3, which gathers weights.
  c.activation_offload = request_.activation_offload && request_.gathered_blocks.empty();
  c.copy_bytes_per_second = request_.host_copy_bytes_per_second;
  if (!request_.gathered_blocks.empty()) add_gathered_blocks(c, prefetch_depth);
  return c;
}

int64_t Planner::weight_bytes() const {
  if (request_.gathered_blocks.empty()) return profile_.weight_bytes;
  int64_t shards = 0;
  for (const auto& b : request_.gathered_blocks) shards += b.shard;
  return shards;
}

namespace {

// ZeRO 3 with prefetch depth d: gathering block p_i (the i-th block with parameters) starts
// the gathers of the next d such blocks in the pass's order, each alive from then until its
// own use. So while any block j runs, the pending ones are those the last gathered block
// started: in forward the d after the last p_i <= j, in backward the d before the first
// p_i >= j. In backward, the reduction of the last block done (the first p_i > j) is in
// flight too: its full gradients and the pieces its owner sums. Its owner adds the sum into
// the shard's gradient only when block j's backward is done: in a step's first micro-batch
// that gradient does not exist yet (the shards' bytes count it from the block's backward on).
struct InFlight {
  int64_t forward = 0;        // gathers started ahead
  int64_t backward = 0;       // gathers started ahead, and the reduction in flight
  int64_t unsummed_shard = 0; // the in-flight block's shard gradient, not made yet
};
std::vector<InFlight> in_flight_bytes(const std::vector<GatheredBlockBytes>& blocks, int depth) {
  std::vector<size_t> with_params;  // p_0, p_1, ...
  for (size_t k = 0; k < blocks.size(); ++k) {
    if (blocks[k].full > 0) with_params.push_back(k);
  }
  const auto ahead = [&](ptrdiff_t from, int step) {  // bytes of the d blocks after p_from in a pass
    int64_t bytes = 0;
    for (int t = 1; t <= depth; ++t) {
      const ptrdiff_t i = from + step * t;
      if (i >= 0 && i < static_cast<ptrdiff_t>(with_params.size())) bytes += blocks[with_params[static_cast<size_t>(i)]].full;
    }
    return bytes;
  };
  std::vector<InFlight> out(blocks.size());
  if (depth == 0 || with_params.empty()) return out;
  for (size_t j = 0; j < blocks.size(); ++j) {
    const auto last_before = std::upper_bound(with_params.begin(), with_params.end(), j) - with_params.begin() - 1;
    const auto first_after = std::lower_bound(with_params.begin(), with_params.end(), j) - with_params.begin();
    out[j].forward = last_before >= 0 ? ahead(last_before, +1) : 0;
    out[j].backward = first_after < static_cast<ptrdiff_t>(with_params.size()) ? ahead(first_after, -1) : 0;
    const auto done = std::upper_bound(with_params.begin(), with_params.end(), j);
    if (done != with_params.end()) {
      out[j].backward += blocks[*done].full + blocks[*done].pieces;
      out[j].unsummed_shard = blocks[*done].shard;
    }
  }
  return out;
}

}  // namespace

void Planner::add_gathered_blocks(ChainCosts& c, int prefetch_depth) const {
  // ZeRO 3: the profile measured each block with its weights present all along and its full
  // gradients kept; here a block's full weights exist only while it runs (forward, recompute,
  // backward: its peaks grow by them, and by the blocks gathered ahead of it), and what stays
  // of its gradients is the shard's. Autocast's weight copies are made per block while
  // gathered (part of its forward peak), not cached ahead.
  TORCH_CHECK(request_.gathered_blocks.size() == c.blocks.size(), "memfit::Planner: ", request_.gathered_blocks.size(),
              " gathered blocks for a chain of ", c.blocks.size());
  const auto ahead = in_flight_bytes(request_.gathered_blocks, prefetch_depth);
  for (size_t k = 0; k < c.blocks.size(); ++k) {
    BlockCost& b = c.blocks[k];
    const GatheredBlockBytes& g = request_.gathered_blocks[k];
    // Every block is recomputed: its forward runs without grad in the forward pass, with grad
    // (the recompute) in the backward pass.
    b.forward_nograd_peak += g.full + ahead[k].forward;
    b.forward_peak += g.full + ahead[k].backward;
    b.backward_peak += g.full + ahead[k].backward;
    // Its full gradients are made afresh in every micro-batch (only the shards' sums stay), as
    // in a step's first: never added into.
    b.backward_peak_accumulating = b.backward_peak;
    // Where the step has one micro-batch, the in-flight block's shard gradient is made only
    // after this block's recompute and backward (a later micro-batch finds it there).
    if (!c.gradients_present) {
      b.forward_peak -= ahead[k].unsummed_shard;
      b.backward_peak -= ahead[k].unsummed_shard;
    }
    b.param_bytes = g.shard;
    b.cast_bytes = 0;
  }
}

int64_t Planner::optimizer_peak(const OptimizerCost& optimizer) const {
  // The optimizer step: weights, gradients, the optimizer's state and temporaries (both
  // measured), the batch, and what else lives then (state gathered for saving).
  // Offloaded, the device holds the weights alone (the step runs on the host).
  const int64_t gradients = request_.gradient_bytes >= 0 ? request_.gradient_bytes : profile_.weight_bytes;
  const int64_t optimizer_bytes = optimizer.on_host ? 0 : gradients + optimizer.state_bytes + optimizer.step_bytes;
  return weight_bytes() + optimizer_bytes + profile_.batch_bytes + request_.extra_bytes + request_.resident_bytes;
}

double Planner::step_seconds(int64_t m, const PrecisionProfile& p, const Schedule& schedule,
                             const OptimizerCost& optimizer) const {
  const int64_t B = profile_.batch;
  const int64_t full = B / m, rest = B % m;
  // (The chain's seconds do not depend on the optimizer's bytes.)
  const auto seconds_at = [&](int64_t size) {
    return evaluate_schedule(costs_at(size, p, request_.optimizer), schedule.segments, schedule.offloaded).seconds;
  };
  double seconds = static_cast<double>(full) * seconds_at(m);
  if (rest > 0) seconds += seconds_at(rest);
  return seconds + optimizer.seconds + offload_seconds(m, optimizer);
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
  p.plain_predicted_peak = std::max(plain.peak_bytes, optimizer_peak(request_.optimizer));
  p.plain_predicted_seconds = plain.seconds + request_.optimizer.seconds;
  p.floor_bytes = floor_bytes();
  p.checkpoint_pinned = request_.checkpoint.has_value();
  return p;
}

Plan Planner::evaluate(int64_t m, Precision precision, const CheckpointPlan& checkpoint, int64_t budget,
                       std::optional<StatePrecision> state, int prefetch_depth, const OffloadPlan& offload) const {
  if (budget <= 0) budget = request_.budget_bytes;
  check_option(m >= 1 && m <= profile_.batch, "micro_batch", m, "expected 1 to batch (" + std::to_string(profile_.batch) + ")");
  const PrecisionProfile& pp = precision_profile(precision);
  const OptimizerCost& optimizer = optimizer_cost(state ? *state : request_.optimizer.state, offload.optimizer);
  Plan p = prediction_base(budget);
  p.config.micro_batch = m;
  p.config.precision = precision;
  p.config.checkpoint = checkpoint;
  p.config.optimizer = request_.step.optimizer.with_state(optimizer.state);
  p.config.prefetch_depth = prefetch_depth;
  p.config.offload = offload;
  const Schedule s = evaluate_schedule(costs_at(m, pp, optimizer, prefetch_depth), checkpoint.segments,
                                       offload.activation_blocks);
  p.predicted_peak = std::max(s.peak_bytes, optimizer_peak(optimizer));
  p.predicted_host_peak = host_peak(optimizer, passes_on_host(optimizer, m, s));
  p.predicted_seconds = step_seconds(m, pp, s, optimizer);
  const auto usable = usable_bytes(budget);
  p.feasible = p.predicted_peak <= usable && fits_host(optimizer);
  return p;
}

int64_t Planner::floor_bytes() const {
  // The smallest peak over precisions (and optimizer states) at the smallest micro-batch
  // allowed, margin included.
  const int64_t m = request_.step.micro_batch > 0 ? request_.step.micro_batch : 1;
  const int depth = request_.prefetch_depths.empty()
                        ? 0 : *std::min_element(request_.prefetch_depths.begin(), request_.prefetch_depths.end());
  int64_t smallest = std::numeric_limits<int64_t>::max();
  const auto candidates = optimizer_candidates();
  const bool any_fits_host = std::any_of(candidates.begin(), candidates.end(), [this](auto* o) { return fits_host(*o); });
  for (const OptimizerCost* optimizer : candidates) {
    if (any_fits_host && !fits_host(*optimizer)) continue;  // (none fits: the host budget is what fails)
    for (const auto& pp : profile_.precisions) {
      const ChainCosts c = costs_at(m, pp, *optimizer, depth);
      const int64_t s = request_.checkpoint ? pinned_smallest_peak(c, *request_.checkpoint) : smallest_peak(c);
      smallest = std::min(smallest, std::max(s, optimizer_peak(*optimizer)));
    }
  }
  return static_cast<int64_t>(std::ceil(static_cast<double>(smallest) * request_.reserved_per_allocated /
                                        (1.0 - request_.margin))) +
         request_.outside_bytes;
}

int64_t Planner::pinned_smallest_peak(const ChainCosts& c, const CheckpointPlan& pinned) const {
  // Offloading a block only takes its activations off the device: every block not recomputed
  // offloaded is the least a pinned schedule holds.
  std::vector<int> offloaded;
  for (int k = 0; c.activation_offload && k < static_cast<int>(c.blocks.size()); ++k) {
    if (!pinned.recomputes(k)) offloaded.push_back(k);
  }
  return evaluate_schedule(c, pinned.segments, offloaded).peak_bytes;
}
void Planner::require_relation(double reserved_per_allocated) {
  request_.reserved_per_allocated = std::max(request_.reserved_per_allocated, reserved_per_allocated);
}

int64_t Planner::usable_bytes(int64_t budget) const {
  const double allocator_share = static_cast<double>(budget - request_.outside_bytes) / request_.reserved_per_allocated;
  return static_cast<int64_t>(allocator_share * (1.0 - request_.margin));
}

std::vector<int64_t> Planner::candidate_sizes() const {
  if (request_.step.micro_batch > 0) return {request_.step.micro_batch};
  std::vector<int64_t> sizes;
  for (int64_t m = profile_.batch; m >= 1; m = m == 1 ? 0 : (m + 1) / 2) sizes.push_back(m);
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
  if (optimizer_peak(optimizer) > usable || !fits_host(optimizer)) return p;
  const ChainCosts costs = costs_at(m, pp, optimizer, prefetch_depth);
  // A pinned schedule still leaves which other blocks are offloaded to choose, where allowed.
  const Schedule s = !request_.checkpoint ? solve_schedule(costs, usable)
                     : costs.activation_offload ? solve_schedule(costs, usable, 0, &request_.checkpoint->segments)
                                                : evaluate_schedule(costs, request_.checkpoint->segments);
  if (!s.feasible || s.peak_bytes > usable) return p;
  const int64_t host = host_peak(optimizer, passes_on_host(optimizer, m, s));
  if (request_.host_budget_bytes > 0 && host > request_.host_budget_bytes) return p;
  p.feasible = true;
  p.config.micro_batch = m;
  p.config.checkpoint.segments = s.segments;
  p.config.prefetch_depth = prefetch_depth;
  p.config.offload.optimizer = optimizer.on_host;
  p.config.offload.activation_blocks = s.offloaded;
  p.predicted_peak = std::max(s.peak_bytes, optimizer_peak(optimizer));
  p.predicted_host_peak = host;
  p.predicted_seconds = step_seconds(m, pp, s, optimizer);
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

void Planner::explain_choice(Plan& p, const std::vector<Plan>& best_of) const {
  // Say plainly why this precision, when there was a choice.
  const char* chosen = precision_name(p.config.precision);
  char buf[224];
  for (const auto& b : best_of) {
    if (b.config.precision == p.config.precision) continue;
    const char* name = precision_name(b.config.precision);
    if (!b.feasible) {
      std::snprintf(buf, sizeof buf, "%s considered: no %s plan fits", name, name);
    } else {
      const bool guessed = precision_profile(b.config.precision).chain_seconds.empty();
      std::snprintf(buf, sizeof buf, "%s: its best plan is predicted %.2fx the time of the %s plan chosen%s", name,
                    b.predicted_seconds / p.predicted_seconds, chosen,
                    guessed ? " (guessed from its blocks: not close enough to be timed)" : "");
    }
    p.notes.push_back(buf);
  }
  if (best_of.size() > 1 && p.config.precision != p.baseline_precision) {
    p.notes.push_back(std::string("precision ") + chosen +
                      " chosen: mixed precision measured faster on this device (`precision` fp32 forbids it)");
  }
}

Plan Planner::best_plan_with(const OptimizerCost& optimizer, int64_t usable) const {
  // The fastest fitting plan of each precision, then the fastest of those (ties, within 1%, go
  // to the earlier precision), with the reasons for its precision in its notes.
  std::vector<Plan> best_of;
  for (const auto& pp : profile_.precisions) best_of.push_back(best_plan_of(pp, optimizer, usable));
  const Plan* chosen = nullptr;
  for (const auto& b : best_of) {
    if (b.feasible && (chosen == nullptr || b.predicted_seconds < 0.99 * chosen->predicted_seconds)) chosen = &b;
  }
  if (chosen == nullptr) return best_of.front();
  Plan p = *chosen;
  explain_choice(p, best_of);
  return p;
}

void Planner::explain_state_choice(Plan& p, const std::vector<Plan>& best_with, int64_t budget) const {
  const auto candidates = optimizer_candidates(p.config.offload.optimizer);
  if (candidates.size() < 2) return;
  const OptimizerCost& chosen = optimizer_cost(p.config.optimizer.state, p.config.offload.optimizer);
  const OptimizerCost& base = *candidates.front();
  const std::string state = state_precision_name(chosen.state), base_name = state_precision_name(base.state);
  const std::string bytes = " (state " + format_bytes(chosen.state_bytes) + " vs " + format_bytes(base.state_bytes) + ")";
  if (&chosen == &base) {
    for (size_t i = 1; i < candidates.size(); ++i) {
      const Plan& b = best_with[i];
      const std::string name = state_precision_name(candidates[i]->state);
      char buf[200];
      std::snprintf(buf, sizeof buf, "optimizer state %s kept: %s state's best plan is predicted %.2fx the time", state.c_str(),
                    name.c_str(), b.predicted_seconds / p.predicted_seconds);
      p.notes.push_back(b.feasible ? buf : "optimizer state " + state + " kept: no " + name + " plan fits either");
    }
    return;
  }
  if (!best_with.front().feasible) {
    p.notes.push_back("optimizer state " + state + " chosen: no plan with " + base_name + " state fits " + format_bytes(budget) + bytes);
    return;
  }
  char buf[200];
  std::snprintf(buf, sizeof buf, "optimizer state %s chosen: its best plan is predicted %.2fx the time of %s state's, optimizer step included",
                state.c_str(), p.predicted_seconds / best_with.front().predicted_seconds, base_name.c_str());
  p.notes.push_back(buf + bytes + " (`optimizer.state` fp32 forbids it)");
}

Plan Planner::best_plan_placed(bool on_host, int64_t usable, int64_t budget) const {
  // The best plan with each optimizer state; the first (the spec's, fp32 under auto) is kept
  // unless another fits when it does not, or is faster (within 1%) with its optimizer step.
  const auto candidates = optimizer_candidates(on_host);
  std::vector<Plan> best_with;
  size_t chosen = candidates.size();
  for (size_t i = 0; i < candidates.size(); ++i) {
    best_with.push_back(best_plan_with(*candidates[i], usable));
    if (!best_with[i].feasible) continue;
    if (chosen == candidates.size() || best_with[i].predicted_seconds < 0.99 * best_with[chosen].predicted_seconds) {
      chosen = i;
    }
  }
  if (chosen == candidates.size()) return best_with.front();
  Plan p = best_with[chosen];
  explain_state_choice(p, best_with, budget);
  return p;
}

void Planner::explain_placement(Plan& p, const std::vector<Plan>& best_placed) const {
  if (best_placed.size() < 2) return;
  const Plan& other = best_placed[p.config.offload.optimizer == request_.optimizer_offload.front() ? 1 : 0];
  const std::string host = format_bytes(p.predicted_host_peak) + " on the host";
  if (!p.config.offload.optimizer) {
    char buf[160];
    std::snprintf(buf, sizeof buf, "optimizer kept on the device: offloaded, its best plan is predicted %.2fx the time",
                  other.predicted_seconds / p.predicted_seconds);
    p.notes.push_back(other.feasible ? buf : "optimizer kept on the device: no plan offloading it fits either");
    return;
  }
  const bool copies = request_.host_copy_bytes_per_second > 0;
  std::string why = other.feasible ? "its best plan is predicted faster" : "no plan with it on the device fits";
  p.notes.push_back("optimizer offloaded to the host (" + host + "): " + why +
                    (copies ? "" : "; copy time not counted"));
}

Plan Planner::plan(int64_t budget) const {
  if (budget <= 0) budget = request_.budget_bytes;
  Plan p = prediction_base(budget);
  p.notes = profile_.notes;
  const auto usable = usable_bytes(budget);
  // The best plan at each placement of the optimizer; the first (the device, unless pinned) is
  // kept unless another fits when it does not, or is faster (within 1%).
  std::vector<Plan> best_placed;
  size_t chosen = request_.optimizer_offload.size();
  for (size_t i = 0; i < request_.optimizer_offload.size(); ++i) {
    best_placed.push_back(best_plan_placed(request_.optimizer_offload[i], usable, budget));
    if (!best_placed[i].feasible) continue;
    const bool faster = chosen < best_placed.size() &&
                        best_placed[i].predicted_seconds < 0.99 * best_placed[chosen].predicted_seconds;
    if (chosen == request_.optimizer_offload.size() || faster) chosen = i;
  }
  if (chosen == request_.optimizer_offload.size()) {
    p.notes.push_back("no plan fits " + format_bytes(budget) + ": the smallest budget that works is " +
                      format_bytes(p.floor_bytes) + " (" + std::to_string(p.floor_bytes) + " bytes)");
    if (request_.host_budget_bytes > 0 && smallest_host_bytes() > request_.host_budget_bytes) {
      p.notes.push_back("the host budget " + format_bytes(request_.host_budget_bytes) +
                        " is below what offloading the optimizer needs there: " + format_bytes(smallest_host_bytes()) +
                        " (" + std::to_string(smallest_host_bytes()) + " bytes)");
    }
    return p;
  }
  Plan& best = best_placed[chosen];
  explain_placement(best, best_placed);
  p.feasible = true;
  p.config = best.config;
  p.predicted_peak = best.predicted_peak;
  p.predicted_host_peak = best.predicted_host_peak;
  p.predicted_seconds = best.predicted_seconds;
  p.notes.insert(p.notes.end(), best.notes.begin(), best.notes.end());
  if (!p.config.offload.activation_blocks.empty()) {
    char buf[200];
    std::snprintf(buf, sizeof buf, "; copies modelled at %.2f GB/s each way", request_.host_copy_bytes_per_second / 1e9);
    p.notes.push_back("activations of " + std::to_string(p.config.offload.activation_blocks.size()) +
                      " blocks offloaded to the host: copying them there and back is predicted faster than recomputing"
                      " them or a smaller micro-batch" + (request_.host_copy_bytes_per_second > 0 ? buf : ""));
  }
  if (request_.prefetch_depths.size() > 1 && p.config.prefetch_depth != request_.prefetch_depths.front()) {
    p.notes.push_back("prefetch depth " + std::to_string(p.config.prefetch_depth) + ": deeper does not fit at micro-batch " +
                      std::to_string(p.config.micro_batch_size()));
  }
  return p;
}

}  // namespace memfit
