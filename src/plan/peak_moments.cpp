#include "memfit/plan/peak_moments.h"

#include <algorithm>

#include "memfit/plan/cost_fit.h"

namespace memfit {

void PeakMomentsRecorder::add(const MemoryEvent& event, int64_t bytes) {
  const bool allocation = event.delta > 0;
  // FNV-1a over the signs: the order, not the sizes, which change with the micro-batch.
  pattern_ = (pattern_ ^ (allocation ? 2U : 1U)) * 1099511628211ULL;
  if (allocating_ && !allocation) bytes_.push_back(last_bytes_);  // a run of allocations ended
  allocating_ = allocation;
  last_bytes_ = bytes;
  ++events_;
}

PeakMoments PeakMomentsRecorder::take(int64_t peak) {
  if (allocating_) bytes_.push_back(last_bytes_);
  PeakMoments out;
  if (events_ == 0 || *std::max_element(bytes_.begin(), bytes_.end()) != peak) return out;
  out.pattern = pattern_ == 0 ? 1 : pattern_;  // (0 means unusable)
  out.bytes = std::move(bytes_);
  return out;
}

PeakMoments peak_moments(const std::vector<MemoryEvent>& events, size_t first, size_t last, MemoryDevice device,
                         int64_t start_live, int64_t offset, int64_t peak) {
  PeakMomentsRecorder r(start_live - offset);
  for (size_t i = first; i < std::min(last, events.size()); ++i) {
    if (events[i].device == device) r.add(events[i], events[i].live - offset);
  }
  return r.take(peak);
}

std::optional<int64_t> highest_moment(const PeakMoments& a, int64_t m1, const PeakMoments& b, int64_t m2, int64_t m) {
  if (!a.usable() || a.pattern != b.pattern || a.bytes.size() != b.bytes.size()) return std::nullopt;
  int64_t highest = 0;
  for (size_t i = 0; i < a.bytes.size(); ++i) highest = std::max(highest, fit_bytes(m1, a.bytes[i], m2, b.bytes[i], m));
  return highest;
}

}  // namespace memfit
