#include "plan/step_costs.h"

#include <algorithm>
#include <cmath>
#include <limits>

#include "memfit/plan/cost_fit.h"

namespace memfit {
namespace {

// Copies of the random state alive through a training step's forward and backward: the
// trainer's from the step's start (a non-finite loss stops with the stream as the step found
// it) and the micro-batch's (an out-of-memory error takes back the failed attempt's draws).
constexpr int64_t kStepRandomStates = 2;

}  // namespace

std::vector<OptimizerCost> placed_optimizer_costs(const PlanRequest& request) {
  std::vector<OptimizerCost> placed;
  std::vector<OptimizerCost> states{request.optimizer};  // the spec's first
  states.insert(states.end(), request.optimizer_alternatives.begin(), request.optimizer_alternatives.end());
  for (bool on_host : request.optimizer_offload) {
    for (OptimizerCost c : states) {
      c.on_host = on_host;
      placed.push_back(c);
    }
  }
  return placed;
}

const OptimizerCost& StepCosts::optimizer_cost(StatePrecision state, bool on_host) const {
  for (const OptimizerCost& c : placed_) {
    if (c.state == state && c.on_host == on_host) return c;
  }
  TORCH_CHECK(false, "memfit::Planner: the optimizer was not measured with ", state_precision_name(state), " state",
              on_host ? " or is not allowed on the host" : "");
}

std::vector<const OptimizerCost*> StepCosts::optimizer_candidates(bool on_host) const {
  std::vector<const OptimizerCost*> out;
  for (const OptimizerCost& c : placed_) {
    if (c.on_host == on_host) out.push_back(&c);
  }
  return out;
}

std::vector<const OptimizerCost*> StepCosts::optimizer_candidates() const {
  std::vector<const OptimizerCost*> out;
  for (const OptimizerCost& c : placed_) out.push_back(&c);
  return out;
}

int64_t StepCosts::host_peak(const OptimizerCost& optimizer, int64_t passes) const {
  if (!optimizer.on_host) return passes;
  // fp32 masters of the weights and the state all along; every gradient in the step.
  const int64_t held = profile_.weight_bytes + optimizer.state_bytes;
  return held + std::max(profile_.weight_bytes + optimizer.step_bytes, passes);
}

bool StepCosts::gradients_stay(int64_t m) const { return m < profile_.batch || !request_.step.set_to_none; }

int64_t StepCosts::passes_on_host(const OptimizerCost& optimizer, int64_t m, const Schedule& schedule) const {
  if (!optimizer.on_host) return schedule.host_bytes;
  return gradients_stay(m) ? schedule.host_bytes + profile_.weight_bytes : schedule.host_first_pass_bytes;
}

int64_t StepCosts::smallest_host_bytes() const {
  int64_t smallest = std::numeric_limits<int64_t>::max();
  for (const OptimizerCost& c : placed_) {
    if (c.on_host) smallest = std::min(smallest, host_peak(c, 0));
  }
  return smallest == std::numeric_limits<int64_t>::max() ? 0 : smallest;
}

bool StepCosts::fits_host(const OptimizerCost& optimizer) const {
  return request_.host_budget_bytes <= 0 || host_peak(optimizer, 0) <= request_.host_budget_bytes;
}

ChainCosts StepCosts::costs_at(int64_t m, const PrecisionProfile& p, const OptimizerCost& optimizer, int prefetch_depth) const {
  ChainCosts c = block_costs_at(p, m);
  time_.scale_to_chain(c, m, p);
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

int64_t StepCosts::weight_bytes() const {
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

void StepCosts::add_gathered_blocks(ChainCosts& c, int prefetch_depth) const {
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

int64_t StepCosts::optimizer_peak(const OptimizerCost& optimizer) const {
  // The optimizer step: weights, gradients, the optimizer's state and temporaries (both
  // measured), the batch, and what else lives then (state gathered for saving).
  // Offloaded, the device holds the weights alone (the step runs on the host).
  const int64_t gradients = request_.gradient_bytes >= 0 ? request_.gradient_bytes : profile_.weight_bytes;
  const int64_t optimizer_bytes = optimizer.on_host ? 0 : gradients + optimizer.state_bytes + optimizer.step_bytes;
  return weight_bytes() + optimizer_bytes + profile_.batch_bytes + request_.extra_bytes + request_.resident_bytes;
}

double StepCosts::step_seconds(int64_t m, const PrecisionProfile& p, const Schedule& schedule,
                               const OptimizerCost& optimizer) const {
  const int64_t B = profile_.batch;
  const int64_t full = B / m, rest = B % m;
  // (The chain's seconds do not depend on the optimizer's bytes.)
  const auto seconds_at = [&](int64_t size) {
    return evaluate_schedule(costs_at(size, p, request_.optimizer), schedule.segments, schedule.offloaded).seconds;
  };
  double seconds = static_cast<double>(full) * seconds_at(m);
  if (rest > 0) seconds += seconds_at(rest);
  return seconds + optimizer.seconds + time_.offload_seconds(m, optimizer);
}

int64_t StepCosts::floor_bytes() const {
  // The smallest peak over precisions (and optimizer states) at the smallest micro-batch
  // allowed (the pinned one, or the fewest samples the precision's profile trained on), margin included.
  const int depth = request_.prefetch_depths.empty()
                        ? 0 : *std::min_element(request_.prefetch_depths.begin(), request_.prefetch_depths.end());
  int64_t smallest = std::numeric_limits<int64_t>::max();
  const auto candidates = optimizer_candidates();
  const bool any_fits_host = std::any_of(candidates.begin(), candidates.end(), [this](auto* o) { return fits_host(*o); });
  for (const OptimizerCost* optimizer : candidates) {
    if (any_fits_host && !fits_host(*optimizer)) continue;  // (none fits: the host budget is what fails)
    for (const auto& pp : profile_.precisions) {
      const int64_t m = request_.step.micro_batch > 0 ? request_.step.micro_batch : pp.fewest_samples;
      const ChainCosts c = costs_at(m, pp, *optimizer, depth);
      const int64_t s = request_.checkpoint ? pinned_smallest_peak(c, *request_.checkpoint) : smallest_peak(c);
      smallest = std::min(smallest, std::max(s, optimizer_peak(*optimizer)));
    }
  }
  return static_cast<int64_t>(std::ceil(static_cast<double>(smallest) * request_.reserved_per_allocated /
                                        (1.0 - request_.margin))) +
         request_.outside_bytes;
}

int64_t StepCosts::pinned_smallest_peak(const ChainCosts& c, const CheckpointPlan& pinned) const {
  // Offloading a block only takes its activations off the device: every block not recomputed
  // offloaded is the least a pinned schedule holds.
  std::vector<int> offloaded;
  for (int k = 0; c.activation_offload && k < static_cast<int>(c.blocks.size()); ++k) {
    if (!pinned.recomputes(k)) offloaded.push_back(k);
  }
  return evaluate_schedule(c, pinned.segments, offloaded).peak_bytes;
}

int64_t StepCosts::usable_bytes(int64_t budget) const {
  const double allocator_share = static_cast<double>(budget - request_.outside_bytes) / request_.reserved_per_allocated;
  return static_cast<int64_t>(allocator_share * (1.0 - request_.margin));
}

}  // namespace memfit
