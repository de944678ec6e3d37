// memory_tracker.h — exact live and peak bytes of tensor storage, from the allocator itself.
//
// LibTorch reports every allocation (+bytes) and free (-bytes) of the CPU allocator, and of the
// CUDA caching allocator, to the c10::MemoryReportingInfoBase installed in the thread's debug
// info. MemoryTracker is such a reporter. Install it with a TrackerScope on every thread whose
// allocations should count (it is thread-local, like torch.no_grad); at::launch and the
// autograd engine carry it to their worker threads.
//
//   auto tracker = std::make_shared<memfit::MemoryTracker>();
//   memfit::TrackerScope scope(tracker);           // this thread now reports to `tracker`
//   { memfit::PhaseGuard forward(memfit::Phase::kForward); auto y = model(x); ... }
//   tracker->peak(memfit::MemoryDevice::kCPU);       // bytes, exact
//
// Only allocations made while a tracker is installed are counted; storage made before (a
// model the caller built) is counted once adopted (breakdown.h's adopt_tensors).
#pragma once

#include <c10/core/Allocator.h>
#include <c10/util/ThreadLocalDebugInfo.h>
#include <torch/csrc/profiler/orchestration/observer.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <memory>
#include <mutex>
#include <unordered_map>
#include <vector>

#include "memfit/compat.h"

namespace memfit {

// What a training step is doing when an allocation happens. Each phase keeps its own peak.
enum class Phase : uint8_t { kOther = 0, kData, kForward, kBackward, kRecompute, kOptimizer, kEval };
constexpr int kNumPhases = 7;
const char* phase_name(Phase phase);

// Devices counted separately: index 0 is CPU, 1 is CUDA, 2 the CPU's host pool (memory_space.h:
// bytes offloaded from a CPU device, not under its budget).
enum class MemoryDevice : uint8_t { kCPU = 0, kCUDA = 1, kHost = 2 };
constexpr int kNumMemoryDevices = 3;

// Where the CPU allocator's device bytes are counted: MemoryDevice::kCPU, or, in the
// counted-as-CUDA test mode, MemoryDevice::kCUDA. That mode proves on a CPU that every count a
// plan, a report or a training run reads is the step's device's: memfit's CPU allocator then
// reports its bytes as cuda:0's, so a count read on the CPU, the device a GPU run would not
// use, finds nothing there. Set by set_cpu_counted_as_cuda (tests) or, read once at start,
// MEMFIT_COUNT_CPU_AS=cuda in the environment (the CLI's tests).
bool cpu_counted_as_cuda();
void set_cpu_counted_as_cuda(bool on);
// The c10 device the CPU allocator reports its device bytes as: cpu, or cuda:0 in that mode.
c10::Device cpu_reported_device();

// The counted device a tensor's device is: CUDA's, or the CPU's (every other device; CUDA's
// in the counted-as-CUDA mode).
inline MemoryDevice memory_device_of(const c10::Device& device) {
  return device.is_cuda() || cpu_counted_as_cuda() ? MemoryDevice::kCUDA : MemoryDevice::kCPU;
}
// Where bytes offloaded from `device` are counted: CPU memory (pinned) for CUDA, the host pool
// for the CPU.
inline MemoryDevice host_memory_device_of(const c10::Device& device) {
  return device.is_cuda() ? MemoryDevice::kCPU : MemoryDevice::kHost;
}

// Tag for allocations made while no block of a chain is running.
constexpr int16_t kNoBlock = -1;
// Tag for the frees made when autocast's weight-cast cache is cleared (see Autocast).
constexpr int16_t kAutocastCacheTag = -2;

// One allocator event, recorded while recording is on.
struct MemoryEvent {
  int64_t t_ns;       // nanoseconds since recording started
  const void* ptr;    // the storage's data pointer
  int64_t delta;      // +bytes for an allocation, -bytes for a free
  int64_t live;       // live bytes on that device after the event
  Phase phase;        // phase at the time of the event
  int16_t block;      // chain block running at the time (kNoBlock if none)
  MemoryDevice device;
};

// A phase change, recorded while recording is on; event_index is the number of events before it.
struct PhaseMark {
  size_t event_index;
  int64_t t_ns;
  Phase phase;
};

// An allocation alive at some moment.
struct LiveAllocation {
  const void* ptr;
  int64_t bytes;
  MemoryDevice device;
};

// The allocators report to whatever sits in the thread's profiler slot, and LibTorch reads that
// slot as a profiler's state (torch.autograd.Function's apply asks whether profiling is on): so the
// tracker is a profiler state, one that is off, which only counts memory.
class MemoryTracker : public torch::profiler::impl::ProfilerStateBase {
 public:
  MemoryTracker();
  torch::profiler::impl::ActiveProfilerType profilerType() override {
    return torch::profiler::impl::ActiveProfilerType::NONE;
  }

  // --- c10 hook (called by the allocators) ---
  void reportMemoryUsage(void* ptr, int64_t alloc_size, compat::ReportTotal total_allocated,
                         compat::ReportTotal total_reserved, c10::Device device) override;
  bool memoryProfilingEnabled() const override { return true; }

  // Counts an allocation made before this tracker was installed as live from now on (its free
  // will be counted then). No-op if the pointer is already live here.
  void adopt(const void* ptr, int64_t bytes, MemoryDevice device);

  // --- counters, in bytes, on one counted device (the step's: memory_device_of) ---
  int64_t current(MemoryDevice device) const;
  int64_t peak(MemoryDevice device) const;
  int64_t phase_peak(Phase phase, MemoryDevice device) const;
  // Peak and every phase peak start again from the current live bytes.
  void reset_peak();
  // Number of allocations seen so far (a cheap change detector).
  int64_t allocation_count() const;

  // --- context that each event is tagged with ---
  Phase phase() const;
  Phase set_phase(Phase phase);  // returns the previous phase
  int16_t block() const;
  int16_t set_block(int16_t block);  // returns the previous block

  // --- time spent in each phase (the bottleneck profile), since creation or the last reset ---
  int64_t phase_time_ns(Phase phase) const;
  void reset_phase_times();

  // --- recording of events, for breakdowns and timelines ---
  // Clears previous events, snapshots the live allocations, and records from now on.
  void start_recording();
  void stop_recording();
  bool recording() const;
  const std::vector<MemoryEvent>& events() const { return events_; }
  const std::vector<PhaseMark>& phase_marks() const { return marks_; }
  // Allocations alive when start_recording() was called, in the order they were made (or adopted):
  // a replay (cuda_reserved.h) makes them again in that order.
  const std::vector<LiveAllocation>& live_at_start() const { return live_at_start_; }
  // Allocations alive now, in the order they were made.
  std::vector<LiveAllocation> live_allocations() const;
  // The place of the live allocation at `ptr` in that order (-1: not live here), and the place
  // the next allocation will take: whether a storage was made after some moment.
  int64_t allocation_order(const void* ptr) const;
  int64_t next_allocation_order() const;

  // The tracker installed on the calling thread, or nullptr.
  static MemoryTracker* active();

 private:
  struct Live {
    int64_t bytes;
    MemoryDevice device;
    int64_t order;  // allocations and adoptions so far, when this one was made
  };
  int64_t now_ns() const;
  void note_live_locked(MemoryDevice device);
  std::vector<LiveAllocation> live_in_order_locked() const;

  mutable std::mutex mutex_;
  std::unordered_map<const void*, Live> live_;
  int64_t next_order_ = 0;
  std::array<int64_t, kNumMemoryDevices> current_{};
  std::array<int64_t, kNumMemoryDevices> peak_{};
  std::array<std::array<int64_t, kNumPhases>, kNumMemoryDevices> phase_peak_{};
  int64_t allocations_ = 0;
  Phase phase_ = Phase::kOther;
  int16_t block_ = kNoBlock;
  std::array<int64_t, kNumPhases> phase_ns_{};
  std::chrono::steady_clock::time_point phase_since_ = std::chrono::steady_clock::now();

  bool recording_ = false;
  std::chrono::steady_clock::time_point t0_;
  std::vector<MemoryEvent> events_;
  std::vector<PhaseMark> marks_;
  std::vector<LiveAllocation> live_at_start_;
};

// Installs `tracker` as the calling thread's memory reporter for the scope's lifetime.
class TrackerScope {
 public:
  explicit TrackerScope(std::shared_ptr<MemoryTracker> tracker);
  TrackerScope(const TrackerScope&) = delete;
  TrackerScope& operator=(const TrackerScope&) = delete;

 private:
  c10::DebugInfoGuard guard_;
};

// Sets the active tracker's phase for a scope and restores the previous one. No-op without one.
class PhaseGuard {
 public:
  explicit PhaseGuard(Phase phase);
  ~PhaseGuard();
  PhaseGuard(const PhaseGuard&) = delete;
  PhaseGuard& operator=(const PhaseGuard&) = delete;

 private:
  MemoryTracker* tracker_;
  Phase previous_ = Phase::kOther;
};

// Tags the active tracker's events with a chain block index for a scope.
class BlockTagGuard {
 public:
  explicit BlockTagGuard(int16_t block);
  ~BlockTagGuard();
  BlockTagGuard(const BlockTagGuard&) = delete;
  BlockTagGuard& operator=(const BlockTagGuard&) = delete;

 private:
  MemoryTracker* tracker_;
  int16_t previous_ = kNoBlock;
};

}  // namespace memfit
