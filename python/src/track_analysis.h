// track_analysis.h — what each live byte of a tracked stretch of Python code was at its peak.
//
// breakdown.h's analyze_step knows a storage's role (weight, gradient, optimizer state) only if
// it is still alive at the end of the step. Python code inside `memfit.track()` may release
// gradients before the end (zero_grad(set_to_none=True)) or run several steps, so roles are
// taken from snapshots instead: at chosen moments (before and after each optimizer step, at
// the end) the storages of the parameters, buffers, gradients and optimizer state are listed,
// and the allocation alive at that moment under that pointer takes that role.
#pragma once

#include <cstdint>
#include <vector>

#include "memfit/measure/breakdown.h"
#include "memfit/measure/memory_tracker.h"

namespace memfit::python {

struct RoleSnapshot {
  size_t event_index = 0;  // taken before this event (events().size(): after the last one)
  std::vector<const void*> weights, buffers, gradients, optimizer_state;
};

struct TrackedAnalysis {
  StepAnalysis step;             // categories at the peak, timeline, phases, per-group activations
  int16_t peak_tag = kNoBlock;   // the block tag of the allocation that reached the peak
};

// Replays the tracker's recording. `tag_group` maps a block tag (a module's index) to the group
// whose activations StepAnalysis::block_activation_bytes sums (`groups` of them).
TrackedAnalysis analyze_tracked(const MemoryTracker& tracker, std::vector<RoleSnapshot> snapshots,
                                const std::vector<int>& tag_group, int groups, MemoryDevice device);

}  // namespace memfit::python
