#include "memfit/measure/breakdown.h"

#include "memfit/measure/budget_allocator.h"


#include <algorithm>
#include <unordered_map>

namespace memfit {
namespace {

const void* storage_ptr(const at::Tensor& t) {
  return t.defined() && t.has_storage() ? t.storage().data() : nullptr;
}

void add_known(std::unordered_set<const void*>& set, const at::Tensor& t) {
  if (const void* p = storage_ptr(t)) set.insert(p);
}

enum class Role : uint8_t { kNone, kWeights, kBuffers, kGradients, kOptimizer };

// An allocation: the index of its allocating event (-1 - k for the k-th alive when recording
// started), its bytes, and what was running when it was made.
struct Alloc {
  int64_t id;
  int64_t bytes;
  Phase phase;
  int16_t block;
};

// Pass 1: the role of each allocation, from the snapshots, and which allocations were autocast's
// cached weight copies (freed when the cache was cleared).
struct Roles {
  std::unordered_map<int64_t, Role> role;
  std::unordered_set<int64_t> cache;
};

void apply_snapshot(const RoleSnapshot& s, const std::unordered_map<const void*, int64_t>& alive, Roles& roles) {
  const auto mark = [&](const std::vector<const void*>& ptrs, Role role) {
    for (const void* p : ptrs) {
      const auto it = alive.find(p);
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
    const auto it = alive.find(e.ptr);
    if (it == alive.end()) continue;
    if (e.block == kAutocastCacheTag) roles.cache.insert(it->second);
    alive.erase(it);
  }
  return roles;
}

// Adds `bytes` of allocation `a` to its category: its role, else autocast's cache, else an
// activation where made in a forward, recompute or evaluation, else other.
void add(Categories& c, const Alloc& a, const Roles& roles, int64_t bytes) {
  const auto r = roles.role.find(a.id);
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
  const std::vector<int>& block_group;
  StepAnalysis out;
  std::unordered_map<const void*, Alloc> live;
  Categories now;
  size_t next_mark = 0;
  Phase phase = Phase::kOther;
  bool in_forward = false, first_forward_done = false;

  // What was alive before recording: the first timeline point.
  void start(const MemoryTracker& tracker, MemoryDevice device) {
    const auto& begin = tracker.live_at_start();
    for (size_t k = 0; k < begin.size(); ++k) {
      if (begin[k].device != device) continue;
      const Alloc a{-1 - static_cast<int64_t>(k), begin[k].bytes, Phase::kOther, kNoBlock};
      live[begin[k].ptr] = a;
      add(now, a, roles, a.bytes);
    }
    const auto& marks = tracker.phase_marks();
    out.at_start = out.at_peak = now;
    out.peak_bytes = now.total();
    out.timeline.push_back({0, marks.empty() ? Phase::kOther : marks.front().phase, now});
  }
  // End of the first forward: what each group of blocks left alive for backward.
  void record_group_activations() {
    for (const auto& [ptr, a] : live) {
      if (a.phase != Phase::kForward || a.block < 0 || static_cast<size_t>(a.block) >= block_group.size()) continue;
      const int g = block_group[static_cast<size_t>(a.block)];
      if (g >= 0 && static_cast<size_t>(g) < out.block_activation_bytes.size()) {
        out.block_activation_bytes[static_cast<size_t>(g)] += a.bytes;
      }
    }
  }
  void close_span(int64_t t) {
    if (!out.phases.empty() && out.phases.back().end_ns < 0) out.phases.back().end_ns = t;
  }
  // Enters every phase marked at or before event_index: closes the open span, opens the next.
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
      out.phases.push_back({m.phase, m.t_ns, -1, now.total()});
    }
  }
  // Applies event i to the live set and the totals; false for a free of an allocation never
  // seen (it changes nothing, so it adds no timeline point).
  bool apply_event(const MemoryEvent& e, size_t i) {
    if (e.delta > 0) {
      const Alloc a{static_cast<int64_t>(i), e.delta, e.phase, e.block};
      live[e.ptr] = a;
      add(now, a, roles, e.delta);
      return true;
    }
    const auto it = live.find(e.ptr);
    if (it == live.end()) return false;
    add(now, it->second, roles, -it->second.bytes);
    live.erase(it);
    return true;
  }
  // A timeline point after an event; raises the open span's peak and the step's peak.
  void record_point(const MemoryEvent& e) {
    out.timeline.push_back({e.t_ns, phase, now});
    if (!out.phases.empty()) out.phases.back().peak_bytes = std::max(out.phases.back().peak_bytes, now.total());
    if (now.total() > out.peak_bytes) {
      out.peak_bytes = now.total();
      out.peak_t_ns = e.t_ns;
      out.peak_phase = phase;
      out.at_peak = now;
      out.peak_block = e.block;
    }
  }
};

std::vector<const void*> as_list(const std::unordered_set<const void*>& set) { return {set.begin(), set.end()}; }

}  // namespace

KnownStorage known_storage(const std::vector<at::Tensor>& parameters, const std::vector<at::Tensor>& optimizer_state,
                           const std::vector<at::Tensor>& buffers) {
  KnownStorage k;
  for (const auto& p : parameters) {
    add_known(k.weights, p);
    add_known(k.gradients, p.grad());
  }
  for (const auto& t : optimizer_state) add_known(k.optimizer_state, t);
  for (const auto& b : buffers) add_known(k.buffers, b);
  return k;
}

void adopt_tensors(MemoryTracker& tracker, const std::vector<at::Tensor>& tensors) {
  for (const auto& t : tensors) {
    if (!t.defined() || !t.has_storage()) continue;
    // Offloaded bytes (masters, state) count as the host's, as their allocation was counted.
    const bool host = t.is_cpu() && BudgetAllocator::in_host_pool(t.storage().data_ptr());
    const MemoryDevice device = host ? MemoryDevice::kHost : memory_device_of(t.device());
    tracker.adopt(t.storage().data(), static_cast<int64_t>(t.storage().nbytes()), device);
  }
}

Categories classify_live(const MemoryTracker& tracker, const KnownStorage& known, MemoryDevice device) {
  Categories c;
  for (const auto& a : tracker.live_allocations()) {
    if (a.device != device) continue;
    if (known.weights.count(a.ptr)) c.weights += a.bytes;
    else if (known.buffers.count(a.ptr)) c.buffers += a.bytes;
    else if (known.gradients.count(a.ptr)) c.gradients += a.bytes;
    else if (known.optimizer_state.count(a.ptr)) c.optimizer_state += a.bytes;
    else c.other += a.bytes;
  }
  return c;
}

RoleSnapshot role_snapshot(size_t event_index, const KnownStorage& known) {
  return {event_index, as_list(known.weights), as_list(known.buffers), as_list(known.gradients),
          as_list(known.optimizer_state)};
}

StepAnalysis analyze_recording(const MemoryTracker& tracker, std::vector<RoleSnapshot> snapshots,
                               const std::vector<int>& block_group, int groups, MemoryDevice device) {
  std::stable_sort(snapshots.begin(), snapshots.end(),
                   [](const RoleSnapshot& a, const RoleSnapshot& b) { return a.event_index < b.event_index; });
  const Roles roles = find_roles(tracker, snapshots, device);
  Replay r{roles, block_group, {}, {}, {}};
  r.out.block_activation_bytes.assign(static_cast<size_t>(std::max(groups, 0)), 0);
  r.start(tracker, device);
  const auto& events = tracker.events();
  const auto& marks = tracker.phase_marks();
  for (size_t i = 0; i < events.size(); ++i) {
    r.apply_marks(marks, i);
    if (events[i].device != device || !r.apply_event(events[i], i)) continue;
    r.record_point(events[i]);
  }
  r.apply_marks(marks, events.size());
  if (!r.first_forward_done) r.record_group_activations();
  r.close_span(r.out.timeline.back().t_ns);
  r.out.at_end = r.now;
  // Spans with no duration carry no information.
  auto& phases = r.out.phases;
  phases.erase(std::remove_if(phases.begin(), phases.end(), [](const PhaseSpan& s) { return s.end_ns <= s.start_ns; }),
               phases.end());
  return std::move(r.out);
}

StepAnalysis analyze_step(const MemoryTracker& tracker, const KnownStorage& known, int num_blocks, MemoryDevice device) {
  std::vector<int> block_group(static_cast<size_t>(std::max(num_blocks, 0)));
  for (size_t b = 0; b < block_group.size(); ++b) block_group[b] = static_cast<int>(b);
  return analyze_recording(tracker, {role_snapshot(tracker.events().size(), known)}, block_group, num_blocks, device);
}

nlohmann::json categories_json(const Categories& c) {
  return {{"weights", c.weights},         {"buffers", c.buffers},             {"gradients", c.gradients},
          {"optimizer_state", c.optimizer_state}, {"activations", c.activations},
          {"other", c.other},             {"autocast_cache", c.autocast_cache}};
}

}  // namespace memfit
