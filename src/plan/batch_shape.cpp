#include "memfit/plan/batch_shape.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

#include "memfit/plan/cost_fit.h"
#include "plan/step_costs.h"
#include "plan/time_model.h"

namespace memfit {
namespace {

// A batch longer or larger than this many times the planned one is not searched for.
constexpr int64_t kSearchCap = 64;

// Lagrange weights of the measured lengths nearest `x` (three at most) for the value at x: a
// field's value at x is the weighted sum of its measured values (the polynomial through them).
struct Curve {
  std::vector<size_t> index;  // into the measured profiles
  std::vector<double> weight;
};

Curve curve_at(const std::vector<LengthProfile>& measured, int64_t x) {
  std::vector<size_t> order(measured.size());
  for (size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    return std::llabs(measured[a].length - x) < std::llabs(measured[b].length - x);
  });
  order.resize(std::min<size_t>(3, order.size()));
  Curve c{order, {}};
  for (size_t i : order) {
    double w = 1.0;
    for (size_t j : order) {
      if (j == i) continue;
      const double xi = static_cast<double>(measured[i].length), xj = static_cast<double>(measured[j].length);
      w *= (static_cast<double>(x) - xj) / (xi - xj);
    }
    c.weight.push_back(w);
  }
  return c;
}

// The curve's value from one value per measured length (`at(k)`: the k-th of curve.index).
template <typename At>
double on_curve(const Curve& c, At at) {
  double v = 0;
  for (size_t k = 0; k < c.index.size(); ++k) v += c.weight[k] * static_cast<double>(at(c.index[k]));
  return v;
}

// Profiles of one micro-batch size, one per measured length, in the measured order.
using SizeRuns = std::vector<const ChainProfile*>;

int64_t fit_int(const Curve& c, const SizeRuns& runs, size_t block, int64_t BlockCost::*field, bool signed_value = false) {
  for (size_t i : c.index) {
    if (runs[i]->blocks[block].*field < 0 && !signed_value) return -1;  // a field not measured (-1) at some length
  }
  const double v = on_curve(c, [&](size_t i) { return runs[i]->blocks[block].*field; });
  return signed_value ? std::llround(v) : std::max<int64_t>(0, std::llround(v));
}

double fit_seconds(const Curve& c, const SizeRuns& runs, size_t block, double BlockCost::*field) {
  return std::max(0.0, on_curve(c, [&](size_t i) { return runs[i]->blocks[block].*field; }));
}

BlockCost fit_block(const Curve& c, const SizeRuns& runs, size_t block, const BlockCost& nearest) {
  BlockCost f = nearest;  // flags and parameters: the nearest length's
  for (auto field : {&BlockCost::forward_seconds, &BlockCost::backward_seconds}) f.*field = fit_seconds(c, runs, block, field);
  for (auto field : {&BlockCost::output_bytes, &BlockCost::kept_bytes, &BlockCost::forward_peak, &BlockCost::recompute_peak,
                     &BlockCost::forward_nograd_peak, &BlockCost::backward_peak, &BlockCost::backward_peak_accumulating,
                     &BlockCost::backward_peak_streamed, &BlockCost::backward_held_input_bytes,
                     &BlockCost::backward_held_by_segment_bytes, &BlockCost::backward_held_all_bytes,
                     &BlockCost::recompute_start_extra_bytes, &BlockCost::input_copy_bytes, &BlockCost::segment_kept_bytes,
                     &BlockCost::shared_gradient_bytes, &BlockCost::handed_bytes, &BlockCost::handed_new_bytes,
                     &BlockCost::recomputed_output_copy_bytes}) {
    f.*field = fit_int(c, runs, block, field);
  }
  f.forward_left_bytes = fit_int(c, runs, block, &BlockCost::forward_left_bytes, /*signed_value=*/true);
  return f;
}

// Each moment on the curve where every length's run has the same moments in the same order.
PeakMoments fit_moments(const Curve& c, const std::vector<const PeakMoments*>& runs) {
  const PeakMoments& first = *runs[c.index.front()];
  for (size_t i : c.index) {
    const PeakMoments& r = *runs[i];
    if (!r.usable() || r.pattern != first.pattern || r.bytes.size() != first.bytes.size()) return {};
  }
  PeakMoments out{first.pattern, std::vector<int64_t>(first.bytes.size())};
  for (size_t k = 0; k < out.bytes.size(); ++k) {
    out.bytes[k] = std::llround(on_curve(c, [&](size_t i) { return runs[i]->bytes[k]; }));
  }
  return out;
}

BlockMoments fit_block_moments(const Curve& c, const SizeRuns& runs, size_t block) {
  BlockMoments out;
  for (auto field : {&BlockMoments::forward, &BlockMoments::forward_nograd, &BlockMoments::backward,
                     &BlockMoments::backward_accumulating, &BlockMoments::backward_input_held,
                     &BlockMoments::backward_segment_end, &BlockMoments::backward_all}) {
    std::vector<const PeakMoments*> each;
    for (const ChainProfile* r : runs) each.push_back(block < r->moments.size() ? &(r->moments[block].*field) : nullptr);
    const bool all = std::all_of(c.index.begin(), c.index.end(), [&](size_t i) { return each[i] != nullptr; });
    if (all) out.*field = fit_moments(c, each);
  }
  return out;
}

ChainProfile fit_chain(const Curve& c, const SizeRuns& runs, size_t nearest) {
  ChainProfile out;
  out.micro_batch = runs[nearest]->micro_batch;
  const bool with_moments = std::all_of(c.index.begin(), c.index.end(), [&](size_t i) { return !runs[i]->moments.empty(); });
  for (size_t b = 0; b < runs[nearest]->blocks.size(); ++b) {
    out.blocks.push_back(fit_block(c, runs, b, runs[nearest]->blocks[b]));
    if (with_moments) out.moments.push_back(fit_block_moments(c, runs, b));
  }
  out.forward_nograd_seconds = std::max(0.0, on_curve(c, [&](size_t i) { return runs[i]->forward_nograd_seconds; }));
  return out;
}

// The profile of micro-batch `m` at each length (null where a length did not run it).
SizeRuns runs_of_size(const std::vector<LengthProfile>& measured, int64_t m) {
  SizeRuns runs;
  for (const LengthProfile& l : measured) {
    const PrecisionProfile& p = l.profile;
    const ChainProfile* found = nullptr;
    for (const ChainProfile* c : {&p.small, &p.large}) {
      if (c->micro_batch == m) found = c;
    }
    for (const ChainProfile& c : p.below) {
      if (c.micro_batch == m) found = &c;
    }
    runs.push_back(found);
  }
  return runs;
}

size_t nearest_length(const std::vector<LengthProfile>& measured, int64_t length) {
  size_t best = 0;
  for (size_t i = 1; i < measured.size(); ++i) {
    if (std::llabs(measured[i].length - length) < std::llabs(measured[best].length - length)) best = i;
  }
  return best;
}

// The chain's timed points at L0 scaled by what the parts' seconds say a step at `at` takes.
std::vector<ChainSeconds> scaled_seconds(const PrecisionProfile& planned, const PrecisionProfile& at) {
  const double before = block_seconds(planned.large), after = block_seconds(at.large);
  const double ratio = before > 0 && after > 0 ? after / before : 1.0;
  std::vector<ChainSeconds> out = planned.chain_seconds;
  for (ChainSeconds& c : out) c.seconds *= ratio;
  return out;
}

// The timed precision's points scaled to an untimed one by their parts' seconds (profile.h's guess).
std::vector<ChainSeconds> guessed_seconds(const WorkloadProfile& profile, const PrecisionProfile& untimed) {
  for (const PrecisionProfile& p : profile.precisions) {
    if (!p.chain_seconds.empty()) return scaled_seconds(p, untimed);
  }
  return {};
}

}  // namespace

std::vector<int64_t> lengths_to_profile(int64_t length) {
  if (length < 4) return {};
  return {length / 2, length / 4};
}

PrecisionProfile profile_at_length(const std::vector<LengthProfile>& measured, int64_t length) {
  TORCH_CHECK(!measured.empty(), "memfit::profile_at_length: no length was measured");
  const size_t nearest = nearest_length(measured, length);
  const PrecisionProfile& near = measured[nearest].profile;
  if (measured[nearest].length == length || measured.size() == 1) return near;
  const Curve c = curve_at(measured, length);
  PrecisionProfile out = near;
  const auto fit_size = [&](const ChainProfile& size, ChainProfile& into) {
    const SizeRuns runs = runs_of_size(measured, size.micro_batch);
    const bool everywhere = std::all_of(c.index.begin(), c.index.end(), [&](size_t i) { return runs[i] != nullptr; });
    if (!everywhere) return false;
    into = fit_chain(c, runs, nearest);
    return true;
  };
  fit_size(near.small, out.small);
  fit_size(near.large, out.large);
  out.below.clear();
  for (const ChainProfile& b : near.below) {
    ChainProfile fitted;
    if (fit_size(b, fitted)) out.below.push_back(std::move(fitted));
  }
  out.calibration = on_curve(c, [&](size_t i) { return measured[i].profile.calibration; });
  return out;
}

ShapePlanner::ShapePlanner(const Planner& planner, const Plan& plan, int64_t length, std::vector<LengthProfile> shorter)
    : plan_(plan), profile_(planner.profile()), request_(planner.request()), budget_(plan.budget_bytes), length_(length),
      batch_(planner.profile().batch), lengths_(std::move(shorter)) {
  PrecisionProfile planned = precision_profile(profile_, plan.config.precision);
  if (planned.chain_seconds.empty()) planned.chain_seconds = guessed_seconds(profile_, planned);
  profile_.precisions = {planned};
  lengths_.insert(lengths_.begin(), LengthProfile{length, planned});
  // What a step cannot change between batches: the optimizer's state and where it runs.
  for (const OptimizerCost& c : placed_optimizer_costs(request_)) {
    if (c.state == plan.config.optimizer.state) request_.optimizer = c;
  }
  request_.optimizer.on_host = false;
  request_.optimizer_alternatives.clear();
  request_.optimizer_offload = {plan.config.offload.optimizer};
  request_.step.optimizer.state = plan.config.optimizer.state;
}

Planner ShapePlanner::planner_for(int64_t samples, int64_t length) const {
  WorkloadProfile p = profile_;
  const double tokens = length_ > 0 ? static_cast<double>(samples * length) / static_cast<double>(batch_ * length_)
                                    : static_cast<double>(samples) / static_cast<double>(batch_);
  p.batch = samples;
  p.batch_bytes = std::llround(static_cast<double>(profile_.batch_bytes) * tokens);
  if (length_ > 0 && length != length_) {
    PrecisionProfile at = profile_at_length(lengths_, length);
    at.chain_seconds = scaled_seconds(lengths_.front().profile, at);
    p.precisions = {at};
  }
  PlanRequest r = request_;
  r.step.batch = samples;
  r.step.micro_batch = std::min(r.step.micro_batch, samples);
  return Planner(std::move(p), std::move(r));
}

Plan ShapePlanner::evaluate(int64_t samples, int64_t length, int64_t micro_batch, const CheckpointPlan& checkpoint) const {
  const Planner planner = planner_for(samples, length_ > 0 ? length : 0);
  OffloadPlan offload;
  offload.optimizer = request_.optimizer_offload.front();
  return planner.evaluate(micro_batch, profile_.precisions.front().precision, checkpoint, budget_,
                          request_.step.optimizer.state, 0, offload);
}

const Plan& ShapePlanner::choose(int64_t samples, int64_t length) {
  TORCH_CHECK(samples >= 1, "memfit::ShapePlanner: a batch of ", samples, " samples; expected at least one");
  const int64_t l = length_ > 0 ? std::max<int64_t>(1, length) : 0;
  if (samples == batch_ && l == length_) return plan_;
  auto [it, made] = chosen_.try_emplace({samples, l});
  if (made) it->second = plan_shape(samples, l);
  return it->second;
}

int64_t ShapePlanner::highest_fitting(int64_t lo, int64_t cap, const std::function<bool(int64_t)>& fits) const {
  if (!fits(lo)) return 0;
  int64_t hi = lo;  // fits; grow until one does not (or the cap)
  while (hi < cap && fits(std::min(cap, hi * 2))) hi = std::min(cap, hi * 2);
  if (hi == cap) return -1;
  int64_t bad = std::min(cap, hi * 2);
  while (bad - hi > 1) {
    const int64_t mid = hi + (bad - hi) / 2;
    (fits(mid) ? hi : bad) = mid;
  }
  return hi;
}

int64_t ShapePlanner::longest(int64_t samples) {
  if (length_ == 0) return 0;
  return highest_fitting(1, kSearchCap * length_, [&](int64_t l) { return choose(samples, l).feasible; });
}

int64_t ShapePlanner::largest(int64_t length) {
  return highest_fitting(1, kSearchCap * batch_, [&](int64_t s) { return choose(s, length).feasible; });
}

}  // namespace memfit
