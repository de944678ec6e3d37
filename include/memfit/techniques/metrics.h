// metrics.h — logging by value, and a detector that names a leak.
//
// Keeping a loss tensor (in a vector, a running sum of tensors) keeps its whole autograd graph
// alive: each step's activations then pile up. RunningMean takes the tensor and keeps only a
// double. LeakDetector watches live bytes at the same point of consecutive steps and names
// the growth in bytes per step.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace memfit {

class RunningMean {
 public:
  void add(const at::Tensor& value);  // reads one number (.item()), keeps no tensor
  void add(double value);
  double mean() const { return count_ ? sum_ / static_cast<double>(count_) : 0.0; }
  int64_t count() const { return count_; }
  void reset() { sum_ = 0; count_ = 0; }

 private:
  double sum_ = 0;
  int64_t count_ = 0;
};

struct LeakReport {
  int64_t first_step;         // steps [first_step, last_step] grew
  int64_t last_step;
  int64_t bytes_per_step;     // median growth per step
  std::string message() const;
};

class LeakDetector {
 public:
  // warmup: steps ignored at the start (optimizer state appears in step 1);
  // window: consecutive growing steps needed to call it a leak.
  explicit LeakDetector(int64_t warmup = 2, int64_t window = 3);
  // Live bytes at the same point of step `step` (e.g. its start). Returns a report the first
  // time a leak is seen; later calls return nothing (one warning, not one per step).
  std::optional<LeakReport> observe(int64_t step, int64_t live_bytes);
  bool leaking() const { return reported_.has_value(); }
  const std::optional<LeakReport>& report() const { return reported_; }

 private:
  int64_t warmup_, window_;
  std::vector<std::pair<int64_t, int64_t>> samples_;  // (step, live bytes) after warm-up
  std::optional<LeakReport> reported_;
};

}  // namespace memfit
