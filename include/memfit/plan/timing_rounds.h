// timing_rounds.h — how the plain chain is timed at several micro-batch sizes: the one rule the
// C++ profile (profile.h) and the Python package (memfit.plan, which runs the user's model)
// both follow. No torch: the caller runs the chain, this says what to run and what it was.
//
// Each size the model has not run yet (PartwiseModel::warm) first runs once as in a step, paying
// for first use (oneDNN builds kernels per shape); a first run of kMinTimedSeconds or more is kept
// as a timed run (what first use adds is small beside it, and a slow first run is outvoted by the
// median). Then the sizes run in
// rounds, alternating, so that a burst of slowness (seconds long on a small shared machine)
// falls on every size alike: each size three times, and more (up to kMaxTimedRuns) until its
// runs add up to kMinTimedSeconds — a short run meets the machine's hiccups as often as a long
// one but weighs them more, and one fast timing of a tiny micro-batch would draw plans to it.
// Each point is the median of an odd number of runs: every timed point takes this one
// statistic (a fastest-of-two point beside medians looks faster than its neighbours on a
// machine whose noise only slows runs).
//
//   memfit::TimingRounds rounds(sizes.size());
//   for (size_t i = 0; i < sizes.size(); ++i) rounds.first_use(i, run(sizes[i]));
//   for (auto round = rounds.next_round(); !round.empty(); round = rounds.next_round())
//     for (size_t i : round) rounds.add(i, run(sizes[i]));
//   std::vector<double> seconds = rounds.medians();
#pragma once

#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace memfit {

class TimingRounds {
 public:
  static constexpr size_t kMinTimedRuns = 3;
  static constexpr size_t kMaxTimedRuns = 9;
  static constexpr double kMinTimedSeconds = 0.25;

  explicit TimingRounds(size_t sizes);
  // Size i's first run (first use): kept as a timed run where it took kMinTimedSeconds or more.
  void first_use(size_t i, double seconds);
  // The sizes that still need a run, in order: the next round (empty: every size is done).
  std::vector<size_t> next_round() const;
  void add(size_t i, double seconds);
  // Each size's median (all done).
  std::vector<double> medians() const;

 private:
  bool done(size_t i) const;
  std::vector<std::vector<double>> runs_;
  std::vector<double> total_;
};

// The two sizes the profile measures every block at: a quarter and a half of the batch, small
// enough to be quick, large enough that timings are not noise and per-sample parts dominate.
// From a batch of 4 the line through them starts at 2: one sample is no point on it (a model
// may keep a copy more per block there, which tilts a line through 1 and 2: a GPT's plain step
// at 4 came out 2% low). So batches of 4 and 5 are profiled at 2 and 3 samples.
std::pair<int64_t, int64_t> profiled_sizes(int64_t batch);

// Times timed beside a reference point (its median last in `seconds`), put on the reference's
// scale: the machine's speed now against when the reference was timed drops out, and only the
// ratio measured side by side remains. Returns all but the reference's.
std::vector<double> on_reference_scale(std::vector<double> seconds, double reference_seconds);

}  // namespace memfit
