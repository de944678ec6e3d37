#include "memfit/techniques/metrics.h"

#include <algorithm>

#include "memfit/measure/size.h"

namespace memfit {

void RunningMean::add(const at::Tensor& value) { add(value.detach().item<double>()); }

void RunningMean::add(double value) {
  sum_ += value;
  ++count_;
}

std::string LeakReport::message() const {
  return "memory leak: live bytes grew by " + format_bytes(bytes_per_step) + " (" +
         std::to_string(bytes_per_step) + " bytes) per step over steps " +
         std::to_string(first_step) + "-" + std::to_string(last_step) +
         "; something keeps tensors from every step (a loss kept for logging? log loss.item())";
}

LeakDetector::LeakDetector(int64_t warmup, int64_t window) : warmup_(warmup), window_(window) {}

std::optional<LeakReport> LeakDetector::observe(int64_t step, int64_t live_bytes) {
  if (reported_ || step <= warmup_) return std::nullopt;
  // Only the last window + 1 samples matter: a long run keeps no more.
  if (static_cast<int64_t>(samples_.size()) == window_ + 1) samples_.erase(samples_.begin());
  samples_.emplace_back(step, live_bytes);
  if (static_cast<int64_t>(samples_.size()) < window_ + 1) return std::nullopt;
  // The last `window` differences must all be growth.
  std::vector<int64_t> growth;
  const size_t n = samples_.size();
  for (size_t i = n - static_cast<size_t>(window_); i < n; ++i) {
    growth.push_back(samples_[i].second - samples_[i - 1].second);
  }
  if (std::any_of(growth.begin(), growth.end(), [](int64_t g) { return g <= 0; })) return std::nullopt;
  std::sort(growth.begin(), growth.end());
  reported_ = LeakReport{samples_[n - 1 - static_cast<size_t>(window_)].first, samples_[n - 1].first,
                         growth[growth.size() / 2]};
  return reported_;
}

}  // namespace memfit
