#include "memfit/measure/breakdown.h"


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

enum class Cat : uint8_t { kWeights, kBuffers, kGradients, kOptimizer, kActivations, kOther, kAutocastCache };

void add(Categories& c, Cat cat, int64_t bytes) {
  switch (cat) {
    case Cat::kWeights: c.weights += bytes; break;
    case Cat::kBuffers: c.buffers += bytes; break;
    case Cat::kGradients: c.gradients += bytes; break;
    case Cat::kOptimizer: c.optimizer_state += bytes; break;
    case Cat::kActivations: c.activations += bytes; break;
    case Cat::kOther: c.other += bytes; break;
    case Cat::kAutocastCache: c.other += bytes; c.autocast_cache += bytes; break;
  }
}

// An allocation is identified by (pointer, index of its allocating event); -1 = before recording.
struct Alloc {
  int64_t id;
  int64_t bytes;
  Phase phase;
  int16_t block;
};

// What the end of the step tells about each allocation.
struct Survivors {
  std::unordered_map<const void*, int64_t> alive_id;  // pointer -> id of the allocation alive at the end
  std::unordered_set<int64_t> cache_ids;              // allocations freed when autocast's cache was cleared
};

// Pass 1: which allocation of each pointer survives to the end, and which were freed when
// autocast's cache was cleared.
Survivors find_survivors(const MemoryTracker& tracker, MemoryDevice device) {
  Survivors s;
  for (const auto& a : tracker.live_at_start()) {
    if (a.device == device) s.alive_id[a.ptr] = -1;
  }
  const auto& events = tracker.events();
  for (size_t i = 0; i < events.size(); ++i) {
    const MemoryEvent& e = events[i];
    if (e.device != device) continue;
    if (e.delta > 0) {
      s.alive_id[e.ptr] = static_cast<int64_t>(i);
    } else {
      auto it = s.alive_id.find(e.ptr);
      if (it == s.alive_id.end()) continue;
      if (e.block == kAutocastCacheTag) s.cache_ids.insert(it->second);
      s.alive_id.erase(it);
    }
  }
  return s;
}

// A storage is a weight, buffer, gradient or optimizer state only if it is the very allocation still
// alive at the end of the step.
Cat category(const void* ptr, const Alloc& a, const Survivors& s, const KnownStorage& known) {
  auto it = s.alive_id.find(ptr);
  const bool survives = it != s.alive_id.end() && it->second == a.id;
  if (survives) {
    if (known.weights.count(ptr)) return Cat::kWeights;
    if (known.buffers.count(ptr)) return Cat::kBuffers;
    if (known.gradients.count(ptr)) return Cat::kGradients;
    if (known.optimizer_state.count(ptr)) return Cat::kOptimizer;
  }
  if (s.cache_ids.count(a.id) || a.block == kAutocastCacheTag) return Cat::kAutocastCache;
  if (a.phase == Phase::kForward || a.phase == Phase::kRecompute || a.phase == Phase::kEval) {
    return Cat::kActivations;
  }
  return Cat::kOther;
}

// Pass 2's state: the allocations alive and the running totals per category.
struct Replay {
  const KnownStorage& known;
  const Survivors& survivors;
  int num_blocks;
  StepAnalysis out;
  std::unordered_map<const void*, Alloc> live;
  Categories now;
  size_t next_mark = 0;
  Phase phase = Phase::kOther;
  bool first_forward_done = false;
  bool in_forward = false;
};

// What was alive before recording: the first timeline point.
void start_replay(Replay& r, const MemoryTracker& tracker, MemoryDevice device) {
  const auto& marks = tracker.phase_marks();
  r.out.block_activation_bytes.assign(static_cast<size_t>(std::max(r.num_blocks, 0)), 0);
  for (const auto& a : tracker.live_at_start()) {
    if (a.device != device) continue;
    Alloc al{-1, a.bytes, Phase::kOther, kNoBlock};
    r.live[a.ptr] = al;
    add(r.now, category(a.ptr, al, r.survivors, r.known), a.bytes);
  }
  r.out.at_start = r.now;
  r.out.at_peak = r.now;
  r.out.peak_bytes = r.now.total();
  r.out.timeline.push_back({0, marks.empty() ? Phase::kOther : marks.front().phase, r.now});
}

// End of the first forward: what each block left alive for backward.
void record_block_activations(Replay& r) {
  for (const auto& [ptr, a] : r.live) {
    if (a.phase == Phase::kForward && a.block >= 0 && a.block < r.num_blocks) {
      r.out.block_activation_bytes[static_cast<size_t>(a.block)] += a.bytes;
    }
  }
}

void close_span(StepAnalysis& out, int64_t t) {
  if (!out.phases.empty() && out.phases.back().end_ns < 0) out.phases.back().end_ns = t;
}

// Enters every phase marked at or before event_index: closes the open span, opens the next.
void apply_marks(Replay& r, const std::vector<PhaseMark>& marks, size_t event_index) {
  while (r.next_mark < marks.size() && marks[r.next_mark].event_index <= event_index) {
    const PhaseMark& m = marks[r.next_mark++];
    if (r.in_forward && m.phase != Phase::kForward && !r.first_forward_done) {
      r.first_forward_done = true;
      record_block_activations(r);
    }
    r.in_forward = m.phase == Phase::kForward;
    r.phase = m.phase;
    close_span(r.out, m.t_ns);
    r.out.phases.push_back({m.phase, m.t_ns, -1, r.now.total()});
  }
}

// Applies event i to the live set and the totals; false for a free of an allocation never seen
// (it changes nothing, so it adds no timeline point).
bool apply_event(Replay& r, const MemoryEvent& e, size_t i) {
  if (e.delta > 0) {
    Alloc a{static_cast<int64_t>(i), e.delta, e.phase, e.block};
    r.live[e.ptr] = a;
    add(r.now, category(e.ptr, a, r.survivors, r.known), e.delta);
    return true;
  }
  auto it = r.live.find(e.ptr);
  if (it == r.live.end()) return false;
  add(r.now, category(e.ptr, it->second, r.survivors, r.known), -it->second.bytes);
  r.live.erase(it);
  return true;
}

// A timeline point after an event; raises the open span's peak and the step's peak.
void record_point(Replay& r, int64_t t_ns) {
  StepAnalysis& out = r.out;
  out.timeline.push_back({t_ns, r.phase, r.now});
  if (!out.phases.empty()) out.phases.back().peak_bytes = std::max(out.phases.back().peak_bytes, r.now.total());
  if (r.now.total() > out.peak_bytes) {
    out.peak_bytes = r.now.total();
    out.peak_t_ns = t_ns;
    out.peak_phase = r.phase;
    out.at_peak = r.now;
  }
}

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
    const MemoryDevice device = memory_device_of(t.device());
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

StepAnalysis analyze_step(const MemoryTracker& tracker, const KnownStorage& known, int num_blocks,
                          MemoryDevice device) {
  const auto& events = tracker.events();
  const auto& marks = tracker.phase_marks();
  const Survivors survivors = find_survivors(tracker, device);

  // Pass 2: running totals per category after every event.
  Replay r{known, survivors, num_blocks, {}, {}, {}};
  start_replay(r, tracker, device);
  for (size_t i = 0; i < events.size(); ++i) {
    apply_marks(r, marks, i);
    const MemoryEvent& e = events[i];
    if (e.device != device) continue;
    if (!apply_event(r, e, i)) continue;
    record_point(r, e.t_ns);
  }
  apply_marks(r, marks, events.size());
  close_span(r.out, r.out.timeline.back().t_ns);
  r.out.at_end = r.now;
  // Spans with no duration carry no information.
  r.out.phases.erase(std::remove_if(r.out.phases.begin(), r.out.phases.end(),
                                    [](const PhaseSpan& s) { return s.end_ns <= s.start_ns; }),
                     r.out.phases.end());
  return std::move(r.out);
}

nlohmann::json categories_json(const Categories& c) {
  return {{"weights", c.weights},         {"buffers", c.buffers},             {"gradients", c.gradients},
          {"optimizer_state", c.optimizer_state}, {"activations", c.activations},
          {"other", c.other},             {"autocast_cache", c.autocast_cache}};
}

}  // namespace memfit
