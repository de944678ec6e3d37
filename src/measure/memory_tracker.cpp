#include "memfit/measure/memory_tracker.h"

#include "memfit/measure/memory_space.h"

#include <algorithm>
#include <atomic>
#include <cstdlib>
#include <string>
#include <utility>

namespace memfit {

const char* phase_name(Phase phase) {
  switch (phase) {
    case Phase::kOther: return "other";
    case Phase::kData: return "data";
    case Phase::kForward: return "forward";
    case Phase::kBackward: return "backward";
    case Phase::kRecompute: return "recompute";
    case Phase::kOptimizer: return "optimizer";
    case Phase::kEval: return "eval";
  }
  return "unknown";
}

namespace {
bool counted_as_cuda_from_env() {
  const char* value = std::getenv("MEMFIT_COUNT_CPU_AS");
  return value != nullptr && std::string(value) == "cuda";
}
std::atomic<bool> g_cpu_counted_as_cuda{counted_as_cuda_from_env()};
}  // namespace

bool cpu_counted_as_cuda() { return g_cpu_counted_as_cuda.load(std::memory_order_relaxed); }
void set_cpu_counted_as_cuda(bool on) { g_cpu_counted_as_cuda.store(on); }
c10::Device cpu_reported_device() {
  return cpu_counted_as_cuda() ? c10::Device(c10::kCUDA, 0) : c10::Device(c10::kCPU);
}

MemoryTracker::MemoryTracker()
    : ProfilerStateBase(torch::profiler::impl::ProfilerConfig(torch::profiler::impl::ProfilerState::Disabled)),
      t0_(std::chrono::steady_clock::now()) {}

int64_t MemoryTracker::now_ns() const {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - t0_)
      .count();
}

void MemoryTracker::note_live_locked(MemoryDevice device) {
  const int d = static_cast<int>(device);
  peak_[d] = std::max(peak_[d], current_[d]);
  auto& phase_peak = phase_peak_[d][static_cast<int>(phase_)];
  phase_peak = std::max(phase_peak, current_[d]);
}

void MemoryTracker::reportMemoryUsage(void* ptr, int64_t alloc_size, compat::ReportTotal,
                                      compat::ReportTotal, c10::Device device) {
  if (alloc_size == 0) return;
  MemoryDevice dev;
  if (device.is_cpu()) {
    // An allocation in the host pool is made on the thread inside a HostSpaceGuard; its free
    // finds the pool in live_.
    dev = current_cpu_space() == MemorySpace::kHost ? MemoryDevice::kHost : MemoryDevice::kCPU;
  } else if (device.is_cuda()) {
    dev = MemoryDevice::kCUDA;
  } else {
    return;  // other devices are not counted
  }
  std::lock_guard<std::mutex> lock(mutex_);
  int64_t delta = alloc_size;
  if (alloc_size > 0) {
    live_[ptr] = Live{alloc_size, dev, next_order_++};
    ++allocations_;
  } else {
    // A free of something allocated before this tracker existed is not ours to count.
    auto it = live_.find(ptr);
    if (it == live_.end()) return;
    delta = -it->second.bytes;
    dev = it->second.device;
    live_.erase(it);
  }
  const int d = static_cast<int>(dev);
  current_[d] += delta;
  note_live_locked(dev);
  if (recording_) {
    events_.push_back(MemoryEvent{now_ns(), ptr, delta, current_[d], phase_, block_, dev});
  }
}

void MemoryTracker::adopt(const void* ptr, int64_t bytes, MemoryDevice device) {
  if (ptr == nullptr || bytes <= 0) return;
  std::lock_guard<std::mutex> lock(mutex_);
  if (!live_.emplace(ptr, Live{bytes, device, next_order_}).second) return;  // known already
  ++next_order_;
  const int d = static_cast<int>(device);
  current_[d] += bytes;
  note_live_locked(device);
}

int64_t MemoryTracker::allocation_order(const void* ptr) const {
  std::lock_guard<std::mutex> lock(mutex_);
  const auto it = live_.find(ptr);
  return it == live_.end() ? -1 : it->second.order;
}

int64_t MemoryTracker::next_allocation_order() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return next_order_;
}

int64_t MemoryTracker::current(MemoryDevice device) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return current_[static_cast<int>(device)];
}

int64_t MemoryTracker::peak(MemoryDevice device) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return peak_[static_cast<int>(device)];
}

int64_t MemoryTracker::phase_peak(Phase phase, MemoryDevice device) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return phase_peak_[static_cast<int>(device)][static_cast<int>(phase)];
}

void MemoryTracker::reset_peak() {
  std::lock_guard<std::mutex> lock(mutex_);
  for (int d = 0; d < kNumMemoryDevices; ++d) {
    peak_[d] = current_[d];
    phase_peak_[d].fill(0);
    phase_peak_[d][static_cast<int>(phase_)] = current_[d];
  }
}

int64_t MemoryTracker::allocation_count() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return allocations_;
}

Phase MemoryTracker::phase() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return phase_;
}

Phase MemoryTracker::set_phase(Phase phase) {
  std::lock_guard<std::mutex> lock(mutex_);
  const Phase previous = phase_;
  if (phase == phase_) return previous;
  const auto now = std::chrono::steady_clock::now();
  phase_ns_[static_cast<int>(phase_)] +=
      std::chrono::duration_cast<std::chrono::nanoseconds>(now - phase_since_).count();
  phase_since_ = now;
  phase_ = phase;
  // Live bytes at the moment a phase starts belong to that phase's peak too.
  for (int d = 0; d < kNumMemoryDevices; ++d) note_live_locked(static_cast<MemoryDevice>(d));
  if (recording_) marks_.push_back(PhaseMark{events_.size(), now_ns(), phase});
  return previous;
}

int64_t MemoryTracker::phase_time_ns(Phase phase) const {
  std::lock_guard<std::mutex> lock(mutex_);
  int64_t ns = phase_ns_[static_cast<int>(phase)];
  if (phase == phase_) {
    ns += std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now() - phase_since_)
              .count();
  }
  return ns;
}

void MemoryTracker::reset_phase_times() {
  std::lock_guard<std::mutex> lock(mutex_);
  phase_ns_.fill(0);
  phase_since_ = std::chrono::steady_clock::now();
}

int16_t MemoryTracker::block() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return block_;
}

int16_t MemoryTracker::set_block(int16_t block) {
  std::lock_guard<std::mutex> lock(mutex_);
  return std::exchange(block_, block);
}

void MemoryTracker::start_recording() {
  std::lock_guard<std::mutex> lock(mutex_);
  events_.clear();
  marks_.clear();
  live_at_start_ = live_in_order_locked();
  t0_ = std::chrono::steady_clock::now();
  recording_ = true;
  marks_.push_back(PhaseMark{0, 0, phase_});
}

void MemoryTracker::stop_recording() {
  std::lock_guard<std::mutex> lock(mutex_);
  recording_ = false;
}

bool MemoryTracker::recording() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return recording_;
}

std::vector<LiveAllocation> MemoryTracker::live_allocations() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return live_in_order_locked();
}

std::vector<LiveAllocation> MemoryTracker::live_in_order_locked() const {
  std::vector<std::pair<int64_t, LiveAllocation>> ordered;
  ordered.reserve(live_.size());
  for (const auto& [ptr, live] : live_) ordered.push_back({live.order, {ptr, live.bytes, live.device}});
  std::sort(ordered.begin(), ordered.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
  std::vector<LiveAllocation> out;
  out.reserve(ordered.size());
  for (const auto& [order, a] : ordered) out.push_back(a);
  return out;
}

MemoryTracker* MemoryTracker::active() {
  return dynamic_cast<MemoryTracker*>(
      c10::ThreadLocalDebugInfo::get(c10::DebugInfoKind::PROFILER_STATE));
}

TrackerScope::TrackerScope(std::shared_ptr<MemoryTracker> tracker)
    : guard_(c10::DebugInfoKind::PROFILER_STATE, std::move(tracker)) {}

PhaseGuard::PhaseGuard(Phase phase) : tracker_(MemoryTracker::active()) {
  if (tracker_ != nullptr) previous_ = tracker_->set_phase(phase);
}

PhaseGuard::~PhaseGuard() {
  if (tracker_ != nullptr) tracker_->set_phase(previous_);
}

BlockTagGuard::BlockTagGuard(int16_t block) : tracker_(MemoryTracker::active()) {
  if (tracker_ != nullptr) previous_ = tracker_->set_block(block);
}

BlockTagGuard::~BlockTagGuard() {
  if (tracker_ != nullptr) tracker_->set_block(previous_);
}

}  // namespace memfit
