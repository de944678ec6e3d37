#include "memfit/plan/profile.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>
#include <optional>
#include <unordered_set>
#include <utility>

#include "memfit/errors.h"
#include "memfit/plan/cost_fit.h"
#include "memfit/plan/timing_rounds.h"
#include "memfit/techniques/rng.h"
#include "plan/part_costs.h"
#include "plan/part_measure.h"

namespace memfit {
namespace {

// A mixed precision that runs this many times slower than the baseline is not profiled: on a
// CPU without bf16 instructions bf16 autocast runs many times slower than fp32, and profiling
// it would take most of planning; no plan of it can be the fastest while the baseline fits
// (recomputing everything costs well under 3x).
constexpr double kSlowPrecisionRatio = 3.0;

// Timing rounds of that comparison stop once one lands this far from the threshold, either way:
// noise between rounds is a few percent, so more rounds could not carry the ratio across it. A
// precision 20x slower then costs one forward of it.
constexpr double kClearMargin = 2.0;

// Bytes of the storages of `tensors`, each storage once.
int64_t unique_storage_bytes(const std::vector<at::Tensor>& tensors) {
  std::unordered_set<const void*> seen;
  int64_t total = 0;
  for (const auto& t : tensors) {
    if (t.defined() && t.has_storage() && seen.insert(t.storage().data()).second) total += t.storage().nbytes();
  }
  return total;
}

// Each size's median of runs as in a step, by timing_rounds.h's rule: a first use of each size
// the model has not run, then alternating rounds. Gradients are released after.
std::vector<double> step_medians(PartwiseModel& model, const std::vector<PartRun>& sizes) {
  TimingRounds rounds(sizes.size());
  for (size_t i = 0; i < sizes.size(); ++i) {
    if (!model.warm(sizes[i])) rounds.first_use(i, time_parts(model, sizes[i]));
  }
  for (auto round = rounds.next_round(); !round.empty(); round = rounds.next_round()) {
    for (size_t i : round) rounds.add(i, time_parts(model, sizes[i]));
  }
  release_gradients(model);
  return rounds.medians();
}

// The first line of what went wrong, fit for a note.
std::string cause_of(const std::exception& e) {
  if (const auto* c10_error = dynamic_cast<const c10::Error*>(&e)) return printable(error_cause(c10_error->what_without_backtrace()), 160);
  return printable(error_cause(e.what()), 160);
}

class Profiler {
 public:
  Profiler(PartwiseModel& model, MemoryTracker& tracker, const ProfileOptions& options)
      : model_(model), tracker_(tracker), device_(memory_device_of(model.device())), options_(options) {}

  ChainProfile chain_profile(Precision precision, int64_t m) {
    const PartRun run{m, precision, false};
    const PartsMeasured plain = measure_parts(model_, tracker_, device_, run, PartRunKind::kPlain);
    note_state_changes(plain);
    PartCosts parts = part_costs(model_, tracker_, device_, plain);
    add_accumulating(parts, tracker_, device_, plain,
                     measure_parts(model_, tracker_, device_, run, PartRunKind::kAccumulating));
    const PartsMeasured nograd = measure_parts_nograd(model_, tracker_, device_, run);
    add_nograd(parts, tracker_, device_, nograd);
    if (options_.streamed) add_streamed(parts, plain, measure_parts(model_, tracker_, device_, run, PartRunKind::kStreamed));
    ChainProfile profile;
    profile.micro_batch = m;
    profile.blocks = std::move(parts.costs);
    profile.moments = std::move(parts.moments);
    for (int i = 0; i < model_.parts(); ++i) {
      if (model_.recomputable(i)) profile.forward_nograd_seconds += nograd.forward_seconds[static_cast<size_t>(i)];
    }
    return profile;
  }

  // The parts at the sizes under the quarter (their bytes fit the sizes between: some ops keep
  // more at one sample than the line through larger sizes says), each left out where the model
  // cannot train on it, as BatchNorm on a 1x1 map at one sample.
  std::vector<ChainProfile> below(Precision precision, int64_t small) {
    std::vector<ChainProfile> out;
    for (int64_t m = 1; m <= 2 && m < small; ++m) {
      try {
        out.push_back(chain_profile(precision, m));
      } catch (const c10::OutOfMemoryError&) {
        throw;
      } catch (const std::exception&) {
        release_gradients(model_);
      }
    }
    return out;
  }

  PrecisionProfile precision_profile(Precision precision) {
    const auto [a, b] = profiled_sizes(model_.samples());
    PrecisionProfile p;
    p.precision = precision;
    // A forward first: what a model makes on its first call and keeps (a mask or table built
    // lazily, at this length) is not counted as the first part's activations.
    if (!model_.warm({b, precision, false})) time_forward(model_, {b, precision, false});
    p.large = chain_profile(precision, b);
    progress(std::string(precision_name(precision)) + ", " + std::to_string(b) + " samples");
    p.small = a < b ? chain_profile(precision, a) : p.large;
    progress(std::string(precision_name(precision)) + ", " + std::to_string(a) + " samples");
    p.below = below(precision, a);
    p.fewest_samples = p.below.empty() ? a : p.below.front().micro_batch;
    release_gradients(model_);
    return p;
  }

  // Why a mixed precision is not profiled, or nothing where it is (`baseline`: the precision
  // profiled first).
  std::optional<std::string> dropped(Precision precision, const PrecisionProfile& baseline) {
    const int64_t samples = std::min(baseline.fewest_samples, model_.samples());
    double ratio = 1.0;
    try {
      ratio = slowdown(precision, baseline.precision, samples);
    } catch (const c10::OutOfMemoryError&) {
      throw;
    } catch (const std::exception& e) {
      release_gradients(model_);
      return std::string(precision_name(precision)) + " not considered: it fails on this model (" + cause_of(e) + ")";
    }
    if (ratio <= kSlowPrecisionRatio) return std::nullopt;
    char text[32];
    std::snprintf(text, sizeof text, "%.1fx", ratio);
    return std::string(precision_name(precision)) + " not considered: it ran " + text + " slower than " +
           precision_name(baseline.precision) + " here (a step of " + std::to_string(samples) + " sample" +
           (samples == 1 ? "" : "s") + "; over " +
           std::to_string(static_cast<int>(kSlowPrecisionRatio)) + "x: too slow to be the fastest); `precision` " +
           precision_name(precision) + " plans with it alone";
  }

  // The step timed at the precision whose parts ran fastest at half the batch (both sizes ran
  // before: first uses are paid).
  void time_fastest(std::vector<PrecisionProfile>& profiles) {
    PrecisionProfile& fastest = *std::min_element(profiles.begin(), profiles.end(), [](const auto& x, const auto& y) {
      return block_seconds(x.large) < block_seconds(y.large);
    });
    const int64_t a = fastest.small.micro_batch, b = fastest.large.micro_batch;
    std::vector<PartRun> sizes{{a, fastest.precision, false}};
    if (b != a) sizes.push_back({b, fastest.precision, false});
    const std::vector<double> seconds = step_medians(model_, sizes);
    fastest.chain_seconds.clear();
    for (size_t i = 0; i < sizes.size(); ++i) fastest.chain_seconds.push_back({sizes[i].samples, seconds[i]});
    progress("timed");
  }

  // A note for each part whose forward changes state that outlives it, once.
  std::vector<std::string> take_notes() { return std::move(notes_); }

  void expect_steps(int total) { total_ = total; }
  void skip_steps(int n) { done_ += n; }

 private:
  // How many times slower `precision` runs a step of `samples` (the fewest the baseline's profile
  // trained on: one, or two where BatchNorm meets a 1x1 map) than the baseline. The forwards are
  // compared first: where their ratio is clear of the threshold it decides, and the slow
  // precision's backward (the longer half) never runs; else whole steps are.
  double slowdown(Precision precision, Precision baseline, int64_t samples) {
    const PartRun base{samples, baseline, false};
    PartRun run = base;
    run.precision = precision;
    const auto forward = [this](const PartRun& r) { return time_forward(model_, r); };
    const auto step = [this](const PartRun& r) { return time_parts(model_, r); };
    double ratio = timed_ratio(forward, base, run);
    if (!clear_of_threshold(ratio)) ratio = timed_ratio(step, base, run);
    release_gradients(model_);
    return ratio;
  }

  // `run`'s seconds over `base`'s by `time`: best of up to three rounds, alternating, ended once
  // clear of the threshold. `base` ran in the profile (first use paid); `run`'s first use is
  // kept as a timed run by timing_rounds.h's rule (one of kMinTimedSeconds or more: what first
  // use adds is small beside it), so a precision many times slower runs once.
  static double timed_ratio(const std::function<double(const PartRun&)>& time, const PartRun& base, const PartRun& run) {
    double slow = time(run);
    if (slow < TimingRounds::kMinTimedSeconds) slow = std::numeric_limits<double>::infinity();
    double fast = std::numeric_limits<double>::infinity();
    for (int i = 0; i < 3; ++i) {
      fast = std::min(fast, time(base));
      if (i > 0 || std::isinf(slow)) slow = std::min(slow, time(run));
      if (clear_of_threshold(slow / fast)) break;
    }
    return fast > 0 ? slow / fast : 1.0;
  }

  static bool clear_of_threshold(double ratio) {
    return ratio > kSlowPrecisionRatio * kClearMargin || ratio < kSlowPrecisionRatio / kClearMargin;
  }

  void note_state_changes(const PartsMeasured& r) {
    for (size_t i = 0; i < r.state_changes.size(); ++i) {
      if (r.state_changes[i].empty() || !noted_.insert(i).second || !model_.recomputable(static_cast<int>(i))) continue;
      notes_.push_back(model_.part_name(static_cast<int>(i)) + " is never recomputed: its forward changes state that "
                       "outlives it (" + r.state_changes[i] + "), which a recompute would change again");
    }
  }

  void progress(const std::string& what) {
    ++done_;
    if (options_.progress) options_.progress(std::min(done_, total_), total_, what);
  }

  PartwiseModel& model_;
  MemoryTracker& tracker_;
  MemoryDevice device_;
  const ProfileOptions& options_;
  int done_ = 0, total_ = 1;
  std::vector<std::string> notes_;
  std::unordered_set<size_t> noted_;
};

// Profiles one precision, or says why it is dropped: a mixed precision the model cannot run
// through a whole profile (e.g. GroupNorm under CPU bf16 autocast in 1.13) is left out, the
// baseline's errors reach the caller.
std::optional<PrecisionProfile> profile_or_note(Profiler& profiler, PartwiseModel& model, Precision precision,
                                                const PrecisionProfile* baseline, std::vector<std::string>& notes) {
  if (baseline != nullptr) {
    if (auto why = profiler.dropped(precision, *baseline)) {
      notes.push_back(*why);
      profiler.skip_steps(2);
      return std::nullopt;
    }
  }
  try {
    return profiler.precision_profile(precision);
  } catch (const c10::OutOfMemoryError&) {
    throw;
  } catch (const std::exception& e) {
    release_gradients(model);
    if (baseline == nullptr) throw;
    notes.push_back(std::string(precision_name(precision)) + " not considered: it fails on this model (" + cause_of(e) + ")");
    return std::nullopt;
  }
}

// The gradients the caller's parameters held, put back after the profile (it runs steps).
class GradientsKept {
 public:
  explicit GradientsKept(std::vector<at::Tensor> parameters) : parameters_(std::move(parameters)) {
    for (auto& p : parameters_) gradients_.push_back(std::exchange(p.mutable_grad(), at::Tensor()));
  }
  ~GradientsKept() {
    for (size_t i = 0; i < parameters_.size(); ++i) parameters_[i].mutable_grad() = gradients_[i];
  }
  GradientsKept(const GradientsKept&) = delete;
  GradientsKept& operator=(const GradientsKept&) = delete;

 private:
  std::vector<at::Tensor> parameters_, gradients_;
};

}  // namespace

WorkloadProfile profile_parts(PartwiseModel& model, const std::vector<Precision>& precisions, MemoryTracker& tracker,
                              const ProfileOptions& options) {
  TORCH_CHECK(!precisions.empty(), "memfit::profile_parts: precisions must name at least one candidate");
  RngScope rng(model.device());  // dropout draws
  GradientsKept gradients(model.parameters());
  WorkloadProfile profile;
  profile.batch = model.samples();
  profile.weight_bytes = model.weight_bytes();
  profile.batch_bytes = unique_storage_bytes(model.batch_tensors());
  profile.segment_overhead_bytes = static_cast<int64_t>(capture_rng(model.device()).cpu.storage().nbytes());
  profile.non_reentrant_checkpoint = model.non_reentrant_checkpoint();
  Profiler profiler(model, tracker, options);
  profiler.expect_steps(2 * static_cast<int>(precisions.size()) + 1);
  for (Precision precision : precisions) {
    // The baseline, profiled first (its errors reach the caller), is what the others are timed against.
    const PrecisionProfile* baseline = precision == precisions.front() ? nullptr : &profile.precisions.front();
    auto p = profile_or_note(profiler, model, precision, baseline, profile.notes);
    if (p) profile.precisions.push_back(std::move(*p));
  }
  profiler.time_fastest(profile.precisions);
  for (auto& text : profiler.take_notes()) profile.notes.push_back(std::move(text));
  return profile;
}

PrecisionProfile profile_precision(PartwiseModel& model, Precision precision, MemoryTracker& tracker,
                                   const ProfileOptions& options) {
  RngScope rng(model.device());
  GradientsKept gradients(model.parameters());
  Profiler profiler(model, tracker, options);
  return profiler.precision_profile(precision);
}

ChainProfile profile_parts_at(PartwiseModel& model, int64_t micro_batch, Precision precision, MemoryTracker& tracker,
                              const ProfileOptions& options) {
  RngScope rng(model.device());
  GradientsKept gradients(model.parameters());
  Profiler profiler(model, tracker, options);
  return profiler.chain_profile(precision, micro_batch);
}

std::vector<double> time_step_sizes(PartwiseModel& model, Precision precision, const std::vector<int64_t>& sizes,
                                    const TimingReference& reference) {
  RngScope rng(model.device());
  GradientsKept gradients(model.parameters());
  std::vector<PartRun> runs;
  for (int64_t m : sizes) runs.push_back({m, precision, false});
  runs.push_back({reference.point.micro_batch, reference.precision, false});
  std::vector<double> seconds;
  try {
    seconds = step_medians(model, runs);
  } catch (const c10::OutOfMemoryError&) {
    release_gradients(model);  // the failed run's partial gradients
    for (auto& run : runs) run.recompute_all = true;
    seconds = step_medians(model, runs);
  }
  return on_reference_scale(std::move(seconds), reference.point.seconds);
}

WorkloadProfile profile_workload(Workload& workload, const Batch& batch, const std::vector<Precision>& precisions,
                                 MemoryTracker& tracker, const ProfileOptions& options) {
  ChainParts parts(workload, batch);
  return profile_parts(parts, precisions, tracker, options);
}

}  // namespace memfit
