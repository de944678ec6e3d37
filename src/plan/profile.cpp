#include "memfit/plan/profile.h"
#include "memfit/plan/timing_rounds.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <limits>
#include <optional>

#include "memfit/errors.h"
#include "memfit/runtime/step.h"
#include "memfit/techniques/optimizer_8bit.h"
#include "memfit/techniques/grads.h"
#include "memfit/techniques/rng.h"
#include "plan/profile_block.h"

namespace memfit {
namespace {

using Clock = ProfileClock;

int64_t storage_bytes(const at::Tensor& t) { return t.defined() ? static_cast<int64_t>(t.storage().nbytes()) : 0; }

// One size at one precision, as the runs below take it.
struct RunSize {
  Precision precision;
  int64_t micro_batch;
};

// Forward + backward of the plain chain (or with every block recomputed) on the first m
// samples: its seconds, and its peak above the live bytes at its start. Gradients are left
// in place between runs, as between a step's micro-batches: all but a step's first
// micro-batch add into gradients already there, which takes measurably longer than writing
// fresh ones, so a micro-batch smaller than the batch is timed accumulating.
struct ChainRun {
  Workload& workload;
  const Batch& batch;
  MemoryTracker& tracker;
  StepOptions options;

  double operator()(int64_t m, int64_t* peak = nullptr) {
    const MemoryDevice device = memory_device_of(batch.input.device());
    const int64_t live0 = tracker.current(device);
    tracker.reset_peak();
    const auto t0 = Clock::now();
    forward_backward(workload, batch.slice(0, m), 1.0, options);
    const double s = seconds_since(t0);
    if (peak) *peak = tracker.peak(device) - live0;
    return s;
  }
  void release_gradients() { zero_grad(workload.chain->parameters(), true); }
  // Zero gradients where there are none: what a step's later micro-batches add into, made
  // without a run.
  void ensure_gradients() {
    for (auto& p : workload.chain->parameters()) {
      if (p.requires_grad() && !p.grad().defined()) p.mutable_grad() = at::zeros_like(p);
    }
  }
  // Without gradients, as a step's first (or only) micro-batch: its peak is the calibration's.
  double fresh(int64_t m, int64_t* peak = nullptr) {
    release_gradients();
    return (*this)(m, peak);
  }
  // One run as a step runs m: accumulating, unless m is the whole batch.
  double as_in_a_step(const RunSize& size) {
    options.config.precision = size.precision;
    const int64_t m = size.micro_batch;
    return m < batch.size() ? (*this)(m) : fresh(m);
  }
  // Each size's median of its runs as in a step, by timing_rounds.h's rule: first uses (the
  // profile may come from a cache: a size may be new), then alternating rounds.
  std::vector<double> medians(const std::vector<RunSize>& sizes, bool first_use) {
    ensure_gradients();
    TimingRounds rounds(sizes.size());
    for (size_t i = 0; first_use && i < sizes.size(); ++i) rounds.first_use(i, as_in_a_step(sizes[i]));
    for (auto round = rounds.next_round(); !round.empty(); round = rounds.next_round()) {
      for (size_t i : round) rounds.add(i, as_in_a_step(sizes[i]));
    }
    release_gradients();
    return rounds.medians();
  }
};

// The time model's points at a and b (see profile.h), both having run before (b first): the
// median of three or more runs as in a step each, alternating.
// Above b, a CPU's time starts as the line continued: a first guess, timed when a plan would
// run such a size (plan_timing_as_needed, job.h). Elsewhere (a GPU's occupancy bends
// the line) the whole batch runs once with every block recomputed (little memory), and the
// forward without grad that recomputing adds (its share measured on the blocks at b) is taken
// out again.
void time_chain(Workload& w, const Batch& batch, PrecisionProfile& pp, MemoryTracker& tracker) {
  StepConfig config;
  config.precision = pp.precision;
  ChainRun run{w, batch, tracker, StepOptions{config}};
  const int64_t B = batch.size(), a = pp.small.micro_batch, b = pp.large.micro_batch;
  std::vector<RunSize> sizes{{pp.precision, a}, {pp.precision, b}};
  if (a == b) sizes.pop_back();
  const auto t = run.medians(sizes, /*first_use=*/false);  // a and b ran before (profile_chain)
  pp.chain_seconds.clear();
  for (size_t i = 0; i < sizes.size(); ++i) pp.chain_seconds.push_back({sizes[i].micro_batch, t[i]});
  if (B > b && batch.input.device().type() != c10::kCPU) {
    const double blocks = block_seconds(pp.large);
    const double share = blocks > 0 ? pp.large.forward_nograd_seconds / blocks : 0.0;
    run.options.config.checkpoint = CheckpointPlan::all(w.chain->size());
    pp.chain_seconds.push_back({B, run.fresh(B) / (1.0 + share)});
    run.release_gradients();
  }
}

// The precision whose blocks ran fastest at half the batch (each block warm there: the whole
// chain ran at that size first).
PrecisionProfile& fastest_by_blocks(std::vector<PrecisionProfile>& precisions) {
  return *std::min_element(precisions.begin(), precisions.end(), [](const PrecisionProfile& x, const PrecisionProfile& y) {
    return block_seconds(x.large) < block_seconds(y.large);
  });
}

// The plain chain's measured bytes at b against the blocks' model of them: what the per-block
// model misses (the loss's buffers, engine bookkeeping) is mostly proportional to activations.
void calibrate(PrecisionProfile& pp, int64_t measured) {
  const int64_t predicted = evaluate_schedule(block_costs_at(pp, pp.large.micro_batch), {}).peak_bytes;
  if (predicted > 0) pp.calibration = std::clamp(static_cast<double>(measured) / static_cast<double>(predicted), 0.8, 1.5);
}

}  // namespace


namespace {

// A mixed precision that runs this many times slower than the baseline is not profiled: on a
// CPU without bf16 instructions bf16 autocast runs many times slower than fp32, and profiling
// it would take most of planning; no plan of it can be the fastest while the baseline fits
// (recomputing everything costs well under 3x).
constexpr double kSlowPrecisionRatio = 3.0;

// How many times slower `precision` runs the baseline's heaviest block (by its forward +
// backward at half the batch) than the baseline does, on one sample, each warm: the best of
// three runs after a first use, the two precisions alternating (a busy spell on a shared
// machine must not fall on one of them only). One sample of one
// block costs little even where the precision is slow; tiny shapes weigh per-call costs more,
// which only brings the ratio nearer 1 (so a precision is profiled in doubt).
struct Slowdown {
  double ratio = 1.0;
  int block = 0;
};
Slowdown probe_slowdown(Workload& w, const Batch& batch, const PrecisionProfile& baseline, Precision precision,
                        MemoryTracker& tracker) {
  const auto& blocks = baseline.large.blocks;
  const auto heaviest = std::max_element(blocks.begin(), blocks.end(), [](const BlockCost& x, const BlockCost& y) {
    return x.forward_seconds + x.backward_seconds < y.forward_seconds + y.backward_seconds;
  });
  const int i = static_cast<int>(heaviest - blocks.begin());
  const RngState rng = capture_rng(batch.input.device());  // dropout draws
  const Batch one = batch.slice(0, 1);
  at::Tensor x = one.input;
  if (i > 0) {
    at::NoGradGuard no_grad;
    Autocast autocast(x.device().type(), baseline.precision);
    x = w.chain->run_blocks(x, 0, i - 1);
  }
  const auto seconds = [&](Precision p) {
    const BlockCost c = run_block(w, i, x, one.target, p, tracker).cost;
    return c.forward_seconds + c.backward_seconds;
  };
  seconds(baseline.precision);  // first uses
  seconds(precision);
  double base = std::numeric_limits<double>::infinity(), slow = base;
  for (int run = 0; run < 3; ++run) {  // alternating: a busy spell slows both alike
    base = std::min(base, seconds(baseline.precision));
    slow = std::min(slow, seconds(precision));
  }
  restore_rng(rng);
  return {base > 0 ? slow / base : 1.0, i};
}

std::string slow_precision_note(const Workload& w, const Slowdown& slow, Precision precision, Precision baseline) {
  char ratio[32];
  std::snprintf(ratio, sizeof ratio, "%.1fx", slow.ratio);
  return std::string(precision_name(precision)) + " not considered: it ran " + ratio + " slower than " +
         precision_name(baseline) + " here (block " + std::to_string(slow.block) + " " + w.chain->block(slow.block).name +
         ", one sample; over " + std::to_string(static_cast<int>(kSlowPrecisionRatio)) +
         "x: too slow to be the fastest); `precision` " + precision_name(precision) + " plans with it alone";
}

// The blocks at one sample, or none (micro_batch 0) where the model cannot train on one
// (BatchNorm on a 1x1 map): plans of one sample then fail when run, as the model would.
ChainProfile profile_one_sample(Workload& w, const Batch& batch, Precision precision, MemoryTracker& tracker) {
  const RngState rng = capture_rng(batch.input.device());
  try {
    return profile_chain(w, batch, 1, precision, tracker);
  } catch (const c10::OutOfMemoryError&) {
    throw;
  } catch (const c10::Error&) {
    zero_grad(w.chain->parameters(), true);  // the failed run's partial gradients
    restore_rng(rng);
    return {};
  }
}

}  // namespace

PrecisionProfile profile_precision(Workload& w, const Batch& batch, Precision precision, MemoryTracker& tracker) {
  PrecisionProfile pp;
  pp.precision = precision;
  const auto [a, b] = profiled_sizes(batch.size());
  StepConfig config;
  config.precision = precision;
  ChainRun run{w, batch, tracker, StepOptions{config}};
  {
    // Which blocks write into their input decides what the runs copy: known before the first.
    const RngState rng = capture_rng(batch.input.device());
    w.chain->learn_input_writes(batch.slice(0, b).input);
    restore_rng(rng);
  }
  int64_t measured = 0;
  run.fresh(b, &measured);  // first use of this size (and of the chain); its peak calibrates
  pp.large = profile_chain(w, batch, b, precision, tracker);
  pp.small = b > a ? profile_chain(w, batch, a, precision, tracker) : pp.large;
  if (a > 1) pp.one_sample = profile_one_sample(w, batch, precision, tracker);
  calibrate(pp, measured);
  return pp;
}

WorkloadProfile profile_workload(Workload& w, const Batch& batch, const std::vector<Precision>& precisions,
                                 MemoryTracker& tracker) {
  TORCH_CHECK(!precisions.empty(), "memfit::profile_workload: precisions must name at least one candidate");
  WorkloadProfile profile;
  profile.batch = batch.size();
  profile.weight_bytes = parameter_bytes(*w.chain);
  profile.batch_bytes = storage_bytes(batch.input) + storage_bytes(batch.target);
  profile.segment_overhead_bytes = storage_bytes(capture_rng(batch.input.device()).cpu);
  auto params = w.chain->parameters();
  for (Precision precision : precisions) {
    try {
      if (precision != precisions.front()) {
        const Slowdown slow = probe_slowdown(w, batch, profile.precisions.front(), precision, tracker);
        if (slow.ratio > kSlowPrecisionRatio) {
          profile.notes.push_back(slow_precision_note(w, slow, precision, precisions.front()));
          continue;
        }
      }
      profile.precisions.push_back(profile_precision(w, batch, precision, tracker));
    } catch (const c10::OutOfMemoryError&) {
      throw;
    } catch (const c10::Error& e) {
      // A mixed precision this model cannot run (e.g. GroupNorm under CPU bf16 autocast in
      // 1.13) is dropped from the search, and the plan says why.
      zero_grad(params, true);
      if (precision == precisions.front()) throw;
      profile.notes.push_back(std::string(precision_name(precision)) + " not considered: it fails on this model (" +
                              error_cause(e.what_without_backtrace()) + ")");
    }
  }
  time_chain(w, batch, fastest_by_blocks(profile.precisions), tracker);
  return profile;
}

std::vector<double> time_plain_chain(Workload& w, const Batch& batch, Precision precision,
                                     const std::vector<int64_t>& sizes, const TimingReference& reference,
                                     MemoryTracker& tracker) {
  const RngState rng = capture_rng(batch.input.device());  // dropout draws
  ChainRun run{w, batch, tracker, StepOptions{}};
  std::vector<RunSize> all;
  for (int64_t m : sizes) all.push_back({precision, m});
  all.push_back({reference.precision, reference.point.micro_batch});
  const auto first_uses_then_medians = [&] { return run.medians(all, /*first_use=*/true); };
  std::vector<double> seconds;
  try {
    seconds = first_uses_then_medians();
  } catch (const c10::OutOfMemoryError&) {
    zero_grad(w.chain->parameters(), true);  // the failed run's partial gradients
    run.options.config.checkpoint = CheckpointPlan::all(w.chain->size());
    seconds = first_uses_then_medians();
  }
  restore_rng(rng);
  return on_reference_scale(std::move(seconds), reference.point.seconds);
}

namespace {

// A block's bytes at m from two measured sizes (lo at m1, hi at m2): each on the line through
// them, a peak the highest of its moments' lines where both runs' moments match (a held peak's
// excess then the difference of two such), those inside the block calibrated against the
// whole chain's measured peak. `lo_moments`/`hi_moments` may be null (not recorded).
void fit_block_bytes(const BlockCost& lo, const BlockMoments* lo_moments, int64_t m1, const BlockCost& hi,
                     const BlockMoments* hi_moments, int64_t m2, int64_t m, double calibration, BlockCost& f) {
  const auto fit = [&](int64_t BlockCost::*field) { return fit_bytes(m1, lo.*field, m2, hi.*field, m); };
  const auto moments = [&](PeakMoments BlockMoments::*whole) -> std::optional<int64_t> {
    if (lo_moments == nullptr || hi_moments == nullptr) return std::nullopt;
    return highest_moment(lo_moments->*whole, m1, hi_moments->*whole, m2, m);
  };
  const auto peak = [&](int64_t BlockCost::*field, PeakMoments BlockMoments::*whole) {
    return calibrated(moments(whole).value_or(fit(field)), calibration);
  };
  // What holding some tensors to the end adds to the backward's peak.
  const auto held = [&](int64_t BlockCost::*field, PeakMoments BlockMoments::*whole) {
    const auto with = moments(whole), without = moments(&BlockMoments::backward);
    return with && without ? std::max<int64_t>(0, *with - *without) : fit(field);
  };
  f.output_bytes = fit(&BlockCost::output_bytes);
  f.input_copy_bytes = fit(&BlockCost::input_copy_bytes);
  f.kept_bytes = calibrated(fit(&BlockCost::kept_bytes), calibration);
  f.forward_peak = peak(&BlockCost::forward_peak, &BlockMoments::forward);
  f.forward_nograd_peak = peak(&BlockCost::forward_nograd_peak, &BlockMoments::forward_nograd);
  f.forward_left_bytes = calibrated(fit(&BlockCost::forward_left_bytes), calibration);
  f.backward_peak = peak(&BlockCost::backward_peak, &BlockMoments::backward);
  f.backward_peak_accumulating = peak(&BlockCost::backward_peak_accumulating, &BlockMoments::backward_accumulating);
  f.backward_held_input_bytes = held(&BlockCost::backward_held_input_bytes, &BlockMoments::backward_input_held);
  f.backward_held_by_segment_bytes = held(&BlockCost::backward_held_by_segment_bytes, &BlockMoments::backward_segment_end);
  f.backward_held_all_bytes = held(&BlockCost::backward_held_all_bytes, &BlockMoments::backward_all);
  f.recompute_start_extra_bytes = calibrated(fit(&BlockCost::recompute_start_extra_bytes), calibration);
  const bool streamed = lo.backward_peak_streamed >= 0 && hi.backward_peak_streamed >= 0;
  f.backward_peak_streamed = streamed ? calibrated(fit(&BlockCost::backward_peak_streamed), calibration) : -1;
}

// Each byte count of f, the larger of f's and g's (two fits of one block at one size).
void keep_larger_bytes(BlockCost& f, const BlockCost& g) {
  for (int64_t BlockCost::*field :
       {&BlockCost::output_bytes, &BlockCost::input_copy_bytes, &BlockCost::kept_bytes, &BlockCost::forward_peak,
        &BlockCost::forward_nograd_peak, &BlockCost::forward_left_bytes, &BlockCost::backward_peak,
        &BlockCost::backward_peak_accumulating, &BlockCost::backward_held_input_bytes,
        &BlockCost::backward_held_by_segment_bytes, &BlockCost::backward_held_all_bytes,
        &BlockCost::recompute_start_extra_bytes, &BlockCost::backward_peak_streamed}) {
    f.*field = std::max(f.*field, g.*field);
  }
}

// Block i's moments in c, or null where not recorded.
const BlockMoments* moments_of(const ChainProfile& c, size_t i) {
  return i < c.moments.size() ? &c.moments[i] : nullptr;
}

}  // namespace

ChainCosts block_costs_at(const PrecisionProfile& p, int64_t m) {
  ChainCosts c;
  const int64_t m1 = p.small.micro_batch, m2 = p.large.micro_batch;
  // Below the smallest measured size a block is not assumed any faster: fixed per-call costs
  // dominate there (these seconds only divide the chain's time among blocks).
  const int64_t mt = std::max(m, m1);
  // Bytes below small: on the line from one sample, where it was measured; between one sample
  // and small, the higher of that line and the one through small and large (a library may take
  // another path for one sample: oneDNN's convolution backward makes one weight-sized buffer at
  // one sample, two from two samples on).
  const bool below = m < m1 && p.one_sample.micro_batch > 0 && p.one_sample.micro_batch < m1;
  const bool between = below && m > p.one_sample.micro_batch && m2 > m1;
  const ChainProfile& lo = below ? p.one_sample : p.small;
  const ChainProfile& hi = below ? p.small : p.large;
  for (size_t i = 0; i < p.small.blocks.size(); ++i) {
    const BlockCost& s = p.small.blocks[i];
    const BlockCost& l = p.large.blocks[i];
    BlockCost f;
    f.forward_seconds = fit_line(m1, s.forward_seconds, m2, l.forward_seconds, mt);
    f.backward_seconds = fit_line(m1, s.backward_seconds, m2, l.backward_seconds, mt);
    fit_block_bytes(lo.blocks[i], moments_of(lo, i), lo.micro_batch, hi.blocks[i], moments_of(hi, i), hi.micro_batch, m,
                    p.calibration, f);
    if (between) {
      BlockCost above;
      fit_block_bytes(s, moments_of(p.small, i), m1, l, moments_of(p.large, i), m2, m, p.calibration, above);
      keep_larger_bytes(f, above);
    }
    f.output_kept = l.output_kept;
    f.recomputable = l.recomputable;
    f.input_copy_kept = l.input_copy_kept;
    f.keeps_own_output = l.keeps_own_output;
    f.shared_gradient_bytes = l.shared_gradient_bytes;
    f.param_bytes = s.param_bytes;
    f.cast_bytes = s.cast_bytes;
    c.blocks.push_back(f);
  }
  return c;
}

double block_seconds(const ChainProfile& c) {
  double s = 0;
  for (const auto& b : c.blocks) s += b.forward_seconds + b.backward_seconds;
  return s;
}

double fit_line(int64_t m1, double v1, int64_t m2, double v2, int64_t m) {
  if (m2 == m1) return v1;
  const double slope = (v2 - v1) / static_cast<double>(m2 - m1);
  return std::max(0.0, v1 + slope * static_cast<double>(m - m1));
}

int64_t fit_bytes(int64_t m1, int64_t v1, int64_t m2, int64_t v2, int64_t m) {
  return static_cast<int64_t>(std::llround(fit_line(m1, static_cast<double>(v1), m2, static_cast<double>(v2), m)));
}

int64_t calibrated(int64_t bytes, double calibration) {
  return static_cast<int64_t>(std::llround(static_cast<double>(bytes) * calibration));
}

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
  // state alone; they stay alive, so the cost counts their bytes too.
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
    const Clock::time_point t0 = Clock::now();
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
