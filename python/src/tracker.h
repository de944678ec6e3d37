// tracker.h — the memory tracker as the Python package holds it: the MemoryTracker and the role
// snapshots taken while it records (measure/breakdown.h's analyze_recording replays them).
#pragma once

#include <ATen/ATen.h>

#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "memfit/measure/memory_tracker.h"
#include "memfit/measure/breakdown.h"

namespace memfit::python {

inline std::vector<const void*> storage_ptrs(const std::vector<at::Tensor>& tensors) {
  std::vector<const void*> out;
  for (const auto& t : tensors) {
    if (t.defined() && t.has_storage() && t.storage().data() != nullptr) out.push_back(t.storage().data());
  }
  return out;
}

// A tracker with the role snapshots taken while it recorded, counting one device (the model's:
// every count Python reads is that device's, memory_device_of).
struct Tracker {
  explicit Tracker(const std::string& device_name) : device(device_name), counted(memory_device_of(device)) {}
  std::shared_ptr<MemoryTracker> tracker = std::make_shared<MemoryTracker>();
  c10::Device device;
  MemoryDevice counted;
  std::vector<RoleSnapshot> snapshots;

  void snapshot(const std::vector<at::Tensor>& weights, const std::vector<at::Tensor>& buffers,
                const std::vector<at::Tensor>& gradients, const std::vector<at::Tensor>& optimizer_state) {
    RoleSnapshot s;
    s.event_index = tracker->events().size();
    s.weights = storage_ptrs(weights);
    s.buffers = storage_ptrs(buffers);
    s.gradients = storage_ptrs(gradients);
    s.optimizer_state = storage_ptrs(optimizer_state);
    snapshots.push_back(std::move(s));
  }
  // Bytes alive now by the block tag they were allocated under (tags 0 .. blocks-1).
  std::vector<int64_t> live_bytes_by_tag(int blocks) const {
    std::unordered_map<const void*, std::pair<int16_t, int64_t>> live;
    for (const auto& e : tracker->events()) {
      if (e.device != counted) continue;
      if (e.delta > 0) {
        live[e.ptr] = {e.block, e.delta};
      } else {
        live.erase(e.ptr);
      }
    }
    std::vector<int64_t> out(static_cast<size_t>(blocks), 0);
    for (const auto& [ptr, tag_bytes] : live) {
      if (tag_bytes.first >= 0 && tag_bytes.first < blocks) out[static_cast<size_t>(tag_bytes.first)] += tag_bytes.second;
    }
    return out;
  }
};

}  // namespace memfit::python
