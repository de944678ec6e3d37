// peak_moments.h — a measured peak kept as the moments that could make it, so that the peak at
// another micro-batch is the highest of their lines rather than the line through two peaks.
//
// A block's peak is the most bytes live at any moment of its run. Each moment's bytes are a
// line in the micro-batch (a weight's gradient fixed, an activation's gradient per sample), at
// its own slope, so the moment that is highest can change between sizes: the backward of a
// GPT's MLP block (d = 512, 128 tokens) peaks where both weight gradients exist at 1 and 2
// samples (activations freed by then: it falls per sample) and where the hidden layer's
// gradient is made beside one of them from 3 on, and the line through the peaks at 2 and 3
// undershoots the peak at 4 by 532,475 bytes. (The highest of lines is convex in the
// micro-batch: the line through two of its points is below it outside them, above between.)
//
// Two runs that allocate and free in the same order have the same moments in the same order:
// fitting each moment's line through the two runs and taking the highest gives the peak at a
// third size exactly where that size keeps the order too. Runs whose orders differ (another
// kernel at one sample) fall back to the line through the peaks.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "memfit/measure/memory_tracker.h"

namespace memfit {

struct PeakMoments {
  // The run's order of allocations and frees, hashed; 0: not recorded, or the moments did not
  // reproduce the measured peak (then unused).
  uint64_t pattern = 0;
  // Bytes at the run's start, then at each moment a run of allocations ends (a local maximum),
  // in the run's order.
  std::vector<int64_t> bytes;

  bool usable() const { return pattern != 0 && !bytes.empty(); }
};

// Builds a run's moments from its allocator events in order, each with the bytes that count at
// it (the live bytes above the start, plus what the caller holds on top).
class PeakMomentsRecorder {
 public:
  // `start`: the bytes that count before the first event (a run that only frees peaks there).
  explicit PeakMomentsRecorder(int64_t start = 0) : bytes_{start} {}
  void add(const MemoryEvent& event, int64_t bytes);
  // The moments, kept only if their highest is `peak` (the peak measured of the same run):
  // otherwise something outside the events made the peak, and the moments say nothing of it.
  PeakMoments take(int64_t peak);

 private:
  uint64_t pattern_ = 1469598103934665603ULL;  // FNV-1a's offset basis
  std::vector<int64_t> bytes_;
  bool allocating_ = false;  // the last event was an allocation
  int64_t last_bytes_ = 0;
  int64_t events_ = 0;
};

// The moments of a recorded run on one device: events [first, last), begun at `start_live` live
// bytes, in bytes above `offset`; kept only if their highest is `peak`.
PeakMoments peak_moments(const std::vector<MemoryEvent>& events, size_t first, size_t last, MemoryDevice device,
                         int64_t start_live, int64_t offset, int64_t peak);

// The highest of the moments' lines at m, measured at m1 (a) and m2 (b), never below zero; none
// where the two runs' moments do not match (another order of allocations and frees).
std::optional<int64_t> highest_moment(const PeakMoments& a, int64_t m1, const PeakMoments& b, int64_t m2, int64_t m);

}  // namespace memfit
