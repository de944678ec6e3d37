#include "memfit/plan/timing_rounds.h"

#include <algorithm>

namespace memfit {

TimingRounds::TimingRounds(size_t sizes) : runs_(sizes), total_(sizes, 0.0) {}

void TimingRounds::first_use(size_t i, double seconds) {
  if (seconds >= kMinTimedSeconds) add(i, seconds);
}

bool TimingRounds::done(size_t i) const {
  const size_t n = runs_[i].size();
  return n >= kMaxTimedRuns || (n >= kMinTimedRuns && n % 2 == 1 && total_[i] >= kMinTimedSeconds);
}

std::vector<size_t> TimingRounds::next_round() const {
  std::vector<size_t> round;
  for (size_t i = 0; i < runs_.size(); ++i) {
    if (!done(i)) round.push_back(i);
  }
  return round;
}

void TimingRounds::add(size_t i, double seconds) {
  runs_[i].push_back(seconds);
  total_[i] += seconds;
}

std::vector<double> TimingRounds::medians() const {
  std::vector<double> out;
  for (std::vector<double> r : runs_) {
    std::sort(r.begin(), r.end());
    out.push_back(r.empty() ? 0.0 : r[r.size() / 2]);
  }
  return out;
}

std::pair<int64_t, int64_t> profiled_sizes(int64_t batch) {
  const int64_t a = std::max<int64_t>(batch >= 4 ? 2 : 1, batch / 4);
  const int64_t b = std::min<int64_t>(batch, std::max<int64_t>(a + 1, batch / 2));
  return {a, b};
}

std::vector<double> on_reference_scale(std::vector<double> seconds, double reference_seconds) {
  const double reference_now = seconds.back();
  const double scale = reference_now > 0 ? reference_seconds / reference_now : 1.0;
  seconds.pop_back();
  for (double& s : seconds) s *= scale;
  return seconds;
}

}  // namespace memfit
