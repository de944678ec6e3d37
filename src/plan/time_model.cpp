#include "plan/time_model.h"

#include <algorithm>

#include "memfit/plan/cost_fit.h"

namespace memfit {

const PrecisionProfile& precision_profile(const WorkloadProfile& profile, Precision precision) {
  for (const auto& p : profile.precisions) {
    if (p.precision == precision) return p;
  }
  TORCH_CHECK(false, "memfit::Planner: precision ", precision_name(precision), " was not profiled");
}

double TimeModel::chain_seconds(int64_t m, const PrecisionProfile& p) const {
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

void TimeModel::scale_to_chain(ChainCosts& c, int64_t m, const PrecisionProfile& p) const {
  double block_seconds = 0;
  for (const auto& b : c.blocks) block_seconds += b.forward_seconds + b.backward_seconds;
  if (block_seconds > 0) {
    const double scale = chain_seconds(m, p) / block_seconds;  // the blocks' seconds only divide the chain's
    for (auto& b : c.blocks) {
      b.forward_seconds *= scale;
      b.backward_seconds *= scale;
    }
  }
}

double TimeModel::offload_seconds(int64_t m, const OptimizerCost& optimizer) const {
  if (!optimizer.on_host || request_.host_copy_bytes_per_second <= 0) return 0;
  // Each micro-batch's gradients go to the host; the updated weights come back once.
  const int64_t micro_batches = (profile_.batch + m - 1) / m;
  const double bytes = static_cast<double>(micro_batches + 1) * static_cast<double>(profile_.weight_bytes);
  return bytes / request_.host_copy_bytes_per_second;
}

const PrecisionProfile& TimeModel::timed_precision() const {
  for (const auto& p : profile_.precisions) {
    if (!p.chain_seconds.empty()) return p;
  }
  TORCH_CHECK(false, "memfit::Planner: no precision of the profile has chain times");
}

TimingReference TimeModel::timing_reference(Precision precision) const {
  const PrecisionProfile& own = precision_profile(profile_, precision);
  const PrecisionProfile& p = own.chain_seconds.empty() ? timed_precision() : own;
  for (const auto& c : p.chain_seconds) {
    if (c.micro_batch == p.small.micro_batch) return {p.precision, c};
  }
  return {p.precision, p.chain_seconds.front()};
}

std::vector<int64_t> TimeModel::untimed_sizes(const Plan& plan) const {
  std::vector<int64_t> sizes;
  if (!plan.feasible) return sizes;
  const PrecisionProfile& p = precision_profile(profile_, plan.config.precision);
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

void add_chain_seconds(WorkloadProfile& profile, Precision precision, int64_t m, double seconds) {
  for (auto& pp : profile.precisions) {
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

}  // namespace memfit
