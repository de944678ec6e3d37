#include "track_analysis.h"

#include <algorithm>
#include <unordered_map>

namespace memfit::python {
namespace {

enum class Role : uint8_t { kNone, kWeights, kBuffers, kGradients, kOptimizer };

struct Alloc {
  int64_t id;  // event index of its allocation; -1 - k for the k-th alive when recording started
  int64_t bytes;
  Phase phase;
  int16_t block;
};

// Pass 1: the role of each allocation, from the snapshots, and which allocations were autocast's
// cached weight copies (freed when the cache was cleared).
struct Roles {
  std::unordered_map<int64_t, Role> role;
  std::unordered_map<int64_t, bool> cache;
};

void apply_snapshot(const RoleSnapshot& s, const std::unordered_map<const void*, int64_t>& alive, Roles& roles) {
  const auto mark = [&](const std::vector<const void*>& ptrs, Role role) {
    for (const void* p : ptrs) {
      auto it = alive.find(p);
      if (it != alive.end()) roles.role[it->second] = role;
    }
  };
  mark(s.weights, Role::kWeights);
  mark(s.buffers, Role::kBuffers);
  mark(s.gradients, Role::kGradients);
  mark(s.optimizer_state, Role::kOptimizer);
}

Roles find_roles(const MemoryTracker& tracker, const std::vector<RoleSnapshot>& snapshots, MemoryDevice device) {
  Roles roles;
  std::unordered_map<const void*, int64_t> alive;
  const auto& start = tracker.live_at_start();
  for (size_t k = 0; k < start.size(); ++k) {
    if (start[k].device == device) alive[start[k].ptr] = -1 - static_cast<int64_t>(k);
  }
  const auto& events = tracker.events();
  size_t next = 0;
  for (size_t i = 0; i <= events.size(); ++i) {
    while (next < snapshots.size() && snapshots[next].event_index <= i) apply_snapshot(snapshots[next++], alive, roles);
    if (i == events.size()) break;
    const MemoryEvent& e = events[i];
    if (e.device != device) continue;
    if (e.delta > 0) {
      alive[e.ptr] = static_cast<int64_t>(i);
      continue;
    }
    auto it = alive.find(e.ptr);
    if (it == alive.end()) continue;
    if (e.block == kAutocastCacheTag) roles.cache[it->second] = true;
    alive.erase(it);
  }
  return roles;
}

void add(Categories& c, const Alloc& a, const Roles& roles, int64_t bytes) {
  auto r = roles.role.find(a.id);
  switch (r == roles.role.end() ? Role::kNone : r->second) {
    case Role::kWeights: c.weights += bytes; return;
    case Role::kBuffers: c.buffers += bytes; return;
    case Role::kGradients: c.gradients += bytes; return;
    case Role::kOptimizer: c.optimizer_state += bytes; return;
    case Role::kNone: break;
  }
  if (roles.cache.count(a.id) || a.block == kAutocastCacheTag) {
    c.other += bytes;
    c.autocast_cache += bytes;
  } else if (a.phase == Phase::kForward || a.phase == Phase::kRecompute || a.phase == Phase::kEval) {
    c.activations += bytes;
  } else {
    c.other += bytes;
  }
}

// Pass 2: the running categories after every event.
struct Replay {
  const Roles& roles;
  const std::vector<int>& tag_group;
  TrackedAnalysis out;
  std::unordered_map<const void*, Alloc> live;
  Categories now;
  size_t next_mark = 0;
  Phase phase = Phase::kOther;
  bool in_forward = false, first_forward_done = false;

  void record_group_activations() {
    for (const auto& [ptr, a] : live) {
      if (a.phase != Phase::kForward || a.block < 0 || static_cast<size_t>(a.block) >= tag_group.size()) continue;
      const int g = tag_group[static_cast<size_t>(a.block)];
      if (g >= 0 && static_cast<size_t>(g) < out.step.block_activation_bytes.size()) {
        out.step.block_activation_bytes[static_cast<size_t>(g)] += a.bytes;
      }
    }
  }
  void close_span(int64_t t) {
    auto& phases = out.step.phases;
    if (!phases.empty() && phases.back().end_ns < 0) phases.back().end_ns = t;
  }
  void apply_marks(const std::vector<PhaseMark>& marks, size_t event_index) {
    while (next_mark < marks.size() && marks[next_mark].event_index <= event_index) {
      const PhaseMark& m = marks[next_mark++];
      if (in_forward && m.phase != Phase::kForward && !first_forward_done) {
        first_forward_done = true;
        record_group_activations();
      }
      in_forward = m.phase == Phase::kForward;
      phase = m.phase;
      close_span(m.t_ns);
      out.step.phases.push_back({m.phase, m.t_ns, -1, now.total()});
    }
  }
  bool apply_event(const MemoryEvent& e, size_t i) {
    if (e.delta > 0) {
      Alloc a{static_cast<int64_t>(i), e.delta, e.phase, e.block};
      live[e.ptr] = a;
      add(now, a, roles, e.delta);
      return true;
    }
    auto it = live.find(e.ptr);
    if (it == live.end()) return false;
    add(now, it->second, roles, -it->second.bytes);
    live.erase(it);
    return true;
  }
  void record_point(const MemoryEvent& e) {
    StepAnalysis& s = out.step;
    s.timeline.push_back({e.t_ns, phase, now});
    if (!s.phases.empty()) s.phases.back().peak_bytes = std::max(s.phases.back().peak_bytes, now.total());
    if (now.total() > s.peak_bytes) {
      s.peak_bytes = now.total();
      s.peak_t_ns = e.t_ns;
      s.peak_phase = phase;
      s.at_peak = now;
      out.peak_tag = e.block;
    }
  }
};

}  // namespace

TrackedAnalysis analyze_tracked(const MemoryTracker& tracker, std::vector<RoleSnapshot> snapshots,
                                const std::vector<int>& tag_group, int groups, MemoryDevice device) {
  std::stable_sort(snapshots.begin(), snapshots.end(),
                   [](const RoleSnapshot& a, const RoleSnapshot& b) { return a.event_index < b.event_index; });
  const Roles roles = find_roles(tracker, snapshots, device);
  Replay r{roles, tag_group, {}, {}, {}};
  r.out.step.block_activation_bytes.assign(static_cast<size_t>(std::max(groups, 0)), 0);
  const auto& start = tracker.live_at_start();
  for (size_t k = 0; k < start.size(); ++k) {
    if (start[k].device != device) continue;
    Alloc a{-1 - static_cast<int64_t>(k), start[k].bytes, Phase::kOther, kNoBlock};
    r.live[start[k].ptr] = a;
    add(r.now, a, roles, a.bytes);
  }
  const auto& marks = tracker.phase_marks();
  r.out.step.at_start = r.out.step.at_peak = r.now;
  r.out.step.peak_bytes = r.now.total();
  r.out.step.timeline.push_back({0, marks.empty() ? Phase::kOther : marks.front().phase, r.now});
  const auto& events = tracker.events();
  for (size_t i = 0; i < events.size(); ++i) {
    r.apply_marks(marks, i);
    if (events[i].device != device || !r.apply_event(events[i], i)) continue;
    r.record_point(events[i]);
  }
  r.apply_marks(marks, events.size());
  if (!r.first_forward_done) r.record_group_activations();
  r.close_span(r.out.step.timeline.back().t_ns);
  r.out.step.at_end = r.now;
  auto& phases = r.out.step.phases;
  phases.erase(std::remove_if(phases.begin(), phases.end(), [](const PhaseSpan& s) { return s.end_ns <= s.start_ns; }),
               phases.end());
  return std::move(r.out);
}

}  // namespace memfit::python
