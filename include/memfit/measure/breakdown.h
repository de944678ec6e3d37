// breakdown.h — where the memory of a step goes: weights, gradients, optimizer state,
// activations, other. Exact: every live allocation is put in exactly one category, so the
// parts add up to the total.
//
// Categories are decided by storage identity, from the tracker's recorded events:
// - weights, buffers, gradients, optimizer state: the storages of the parameters, of the
//   modules' buffers (BatchNorm's running statistics and the like), of the parameters' .grad and
//   of the optimizer's state tensors, as listed at given moments (RoleSnapshot: a step's end, or
//   around each optimizer step of Python code that releases its gradients before the end): an
//   allocation takes a role when it is the one alive under a listed storage at such a moment;
// - activations: other allocations made in the forward or recompute phase (what forward keeps
//   for backward, and forward's temporaries while they live);
// - other: the rest (input batch, gradients of activations in backward, loss, autocast's
//   weight-cast cache — also reported on its own: the copies made by Autocast::warm_cast_cache
//   or freed when the cache is cleared — and workspaces).
#pragma once

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <unordered_set>
#include <vector>

#include "memfit/measure/memory_tracker.h"

namespace memfit {

struct Categories {
  int64_t weights = 0;
  int64_t buffers = 0;  // the modules' buffers: state that is not trained (running statistics)
  int64_t gradients = 0;
  int64_t optimizer_state = 0;
  int64_t activations = 0;
  int64_t other = 0;
  int64_t autocast_cache = 0;  // part of `other`: autocast's low-precision copies of weights
  int64_t total() const { return weights + buffers + gradients + optimizer_state + activations + other; }
};

// Storages whose role is known, by data pointer.
struct KnownStorage {
  std::unordered_set<const void*> weights, buffers, gradients, optimizer_state;
};
// The parameters, their current .grad, the optimizer's state tensors (any family's:
// runtime/optimizer.h's optimizer_state_tensors) and the modules' buffers (Chain::buffers()).
// The one JSON form of Categories: {"weights", "buffers", "gradients", "optimizer_state",
// "activations", "other", "autocast_cache"}, bytes as integers.
nlohmann::json categories_json(const Categories& categories);

KnownStorage known_storage(const std::vector<at::Tensor>& parameters, const std::vector<at::Tensor>& optimizer_state,
                           const std::vector<at::Tensor>& buffers = {});

// Counts the storage of tensors made before `tracker` was installed (a caller's model) as live,
// on the device they were counted on: the host pool's (offloaded) as MemoryDevice::kHost.
void adopt_tensors(MemoryTracker& tracker, const std::vector<at::Tensor>& tensors);

// Classifies what is alive now (no recording needed): activations cannot be told apart here,
// so everything unknown is `other`.
Categories classify_live(const MemoryTracker& tracker, const KnownStorage& known, MemoryDevice device);

struct TimelinePoint {
  int64_t t_ns;
  Phase phase;
  Categories live;
};

struct PhaseSpan {
  Phase phase;
  int64_t start_ns, end_ns;
  int64_t peak_bytes;
};

struct StepAnalysis {
  int64_t peak_bytes = 0;
  int16_t peak_block = kNoBlock;  // the block tag of the allocation that reached the peak
  int64_t peak_t_ns = 0;
  Phase peak_phase = Phase::kOther;
  Categories at_peak;
  Categories at_start;
  Categories at_end;
  std::vector<TimelinePoint> timeline;    // after each event
  std::vector<PhaseSpan> phases;          // in order (recompute spans interleave with backward)
  std::vector<int64_t> block_activation_bytes;  // per group of blocks, at the end of the first forward
};

// The storages with a role at one moment of a recording: taken before event `event_index`
// (events().size(): after the last one).
struct RoleSnapshot {
  size_t event_index = 0;
  std::vector<const void*> weights, buffers, gradients, optimizer_state;
};
RoleSnapshot role_snapshot(size_t event_index, const KnownStorage& known);

// Replays the tracker's recording on `device`: categories at every event, by the roles the
// snapshots give. `block_group` maps a block tag to the group whose activations
// StepAnalysis::block_activation_bytes sums (`groups` of them; a tag outside it counts in none).
StepAnalysis analyze_recording(const MemoryTracker& tracker, std::vector<RoleSnapshot> snapshots,
                               const std::vector<int>& block_group, int groups, MemoryDevice device);

// Replays the events the tracker recorded for one step: analyze_recording with one snapshot,
// `known` at the end of the step (call known_storage() before releasing gradients), and a group
// per block.
StepAnalysis analyze_step(const MemoryTracker& tracker, const KnownStorage& known, int num_blocks, MemoryDevice device);

}  // namespace memfit
