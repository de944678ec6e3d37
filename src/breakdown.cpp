#include "memfit/breakdown.h"

#include <torch/optim/adagrad.h>
#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/rmsprop.h>
#include <torch/optim/sgd.h>

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

enum class Cat : uint8_t { kWeights, kGradients, kOptimizer, kActivations, kOther, kAutocastCache };

void add(Categories& c, Cat cat, int64_t bytes) {
  switch (cat) {
    case Cat::kWeights: c.weights += bytes; break;
    case Cat::kGradients: c.gradients += bytes; break;
    case Cat::kOptimizer: c.optimizer_state += bytes; break;
    case Cat::kActivations: c.activations += bytes; break;
    case Cat::kOther: c.other += bytes; break;
    case Cat::kAutocastCache: c.other += bytes; c.autocast_cache += bytes; break;
  }
}

}  // namespace

KnownStorage known_storage(const std::vector<at::Tensor>& parameters, torch::optim::Optimizer* optimizer) {
  KnownStorage k;
  for (const auto& p : parameters) {
    add_known(k.weights, p);
    add_known(k.gradients, p.grad());
  }
  if (optimizer == nullptr) return k;
  for (const auto& [key, state] : optimizer->state()) {
    (void)key;
    if (auto* s = dynamic_cast<torch::optim::AdamWParamState*>(state.get())) {
      add_known(k.optimizer_state, s->exp_avg());
      add_known(k.optimizer_state, s->exp_avg_sq());
      add_known(k.optimizer_state, s->max_exp_avg_sq());
    } else if (auto* s = dynamic_cast<torch::optim::AdamParamState*>(state.get())) {
      add_known(k.optimizer_state, s->exp_avg());
      add_known(k.optimizer_state, s->exp_avg_sq());
      add_known(k.optimizer_state, s->max_exp_avg_sq());
    } else if (auto* s = dynamic_cast<torch::optim::SGDParamState*>(state.get())) {
      add_known(k.optimizer_state, s->momentum_buffer());
    } else if (auto* s = dynamic_cast<torch::optim::RMSpropParamState*>(state.get())) {
      add_known(k.optimizer_state, s->square_avg());
      add_known(k.optimizer_state, s->momentum_buffer());
      add_known(k.optimizer_state, s->grad_avg());
    } else if (auto* s = dynamic_cast<torch::optim::AdagradParamState*>(state.get())) {
      add_known(k.optimizer_state, s->sum());
    }
  }
  return k;
}

Categories classify_live(const MemoryTracker& tracker, const KnownStorage& known, MemoryDevice device) {
  Categories c;
  for (const auto& a : tracker.live_allocations()) {
    if (a.device != device) continue;
    if (known.weights.count(a.ptr)) c.weights += a.bytes;
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

  // An allocation is identified by (pointer, index of its allocating event); -1 = before recording.
  struct Alloc {
    int64_t id;
    int64_t bytes;
    Phase phase;
    int16_t block;
  };

  // Pass 1: which allocation of each pointer survives to the end, and which were freed when
  // autocast's cache was cleared.
  std::unordered_map<const void*, int64_t> alive_id;
  for (const auto& a : tracker.live_at_start()) {
    if (a.device == device) alive_id[a.ptr] = -1;
  }
  std::unordered_set<int64_t> cache_ids;
  for (size_t i = 0; i < events.size(); ++i) {
    const MemoryEvent& e = events[i];
    if (e.device != device) continue;
    if (e.delta > 0) {
      alive_id[e.ptr] = static_cast<int64_t>(i);
    } else {
      auto it = alive_id.find(e.ptr);
      if (it == alive_id.end()) continue;
      if (e.block == kAutocastCacheTag) cache_ids.insert(it->second);
      alive_id.erase(it);
    }
  }
  auto category = [&](const void* ptr, const Alloc& a) {
    auto it = alive_id.find(ptr);
    const bool survives = it != alive_id.end() && it->second == a.id;
    if (survives) {
      if (known.weights.count(ptr)) return Cat::kWeights;
      if (known.gradients.count(ptr)) return Cat::kGradients;
      if (known.optimizer_state.count(ptr)) return Cat::kOptimizer;
    }
    if (cache_ids.count(a.id) || a.block == kAutocastCacheTag) return Cat::kAutocastCache;
    if (a.phase == Phase::kForward || a.phase == Phase::kRecompute || a.phase == Phase::kEval) {
      return Cat::kActivations;
    }
    return Cat::kOther;
  };

  // Pass 2: running totals per category after every event.
  StepAnalysis out;
  out.block_activation_bytes.assign(static_cast<size_t>(std::max(num_blocks, 0)), 0);
  std::unordered_map<const void*, Alloc> live;
  Categories now;
  for (const auto& a : tracker.live_at_start()) {
    if (a.device != device) continue;
    Alloc al{-1, a.bytes, Phase::kOther, kNoBlock};
    live[a.ptr] = al;
    add(now, category(a.ptr, al), a.bytes);
  }
  out.at_start = now;
  out.at_peak = now;
  out.peak_bytes = now.total();
  out.timeline.push_back({0, marks.empty() ? Phase::kOther : marks.front().phase, now});

  size_t next_mark = 0;
  Phase phase = Phase::kOther;
  bool first_forward_done = false;
  bool in_forward = false;
  auto close_span = [&](int64_t t) {
    if (!out.phases.empty() && out.phases.back().end_ns < 0) out.phases.back().end_ns = t;
  };
  auto apply_marks = [&](size_t event_index) {
    while (next_mark < marks.size() && marks[next_mark].event_index <= event_index) {
      const PhaseMark& m = marks[next_mark++];
      if (in_forward && m.phase != Phase::kForward && !first_forward_done) {
        // End of the first forward: what each block left alive for backward.
        first_forward_done = true;
        for (const auto& [ptr, a] : live) {
          if (a.phase == Phase::kForward && a.block >= 0 && a.block < num_blocks) {
            out.block_activation_bytes[static_cast<size_t>(a.block)] += a.bytes;
          }
        }
      }
      in_forward = m.phase == Phase::kForward;
      phase = m.phase;
      close_span(m.t_ns);
      out.phases.push_back({m.phase, m.t_ns, -1, now.total()});
    }
  };

  for (size_t i = 0; i < events.size(); ++i) {
    apply_marks(i);
    const MemoryEvent& e = events[i];
    if (e.device != device) continue;
    if (e.delta > 0) {
      Alloc a{static_cast<int64_t>(i), e.delta, e.phase, e.block};
      live[e.ptr] = a;
      add(now, category(e.ptr, a), e.delta);
    } else {
      auto it = live.find(e.ptr);
      if (it == live.end()) continue;
      add(now, category(e.ptr, it->second), -it->second.bytes);
      live.erase(it);
    }
    out.timeline.push_back({e.t_ns, phase, now});
    if (!out.phases.empty()) out.phases.back().peak_bytes = std::max(out.phases.back().peak_bytes, now.total());
    if (now.total() > out.peak_bytes) {
      out.peak_bytes = now.total();
      out.peak_t_ns = e.t_ns;
      out.peak_phase = phase;
      out.at_peak = now;
    }
  }
  apply_marks(events.size());
  close_span(out.timeline.back().t_ns);
  out.at_end = now;
  // Spans with no duration carry no information.
  out.phases.erase(std::remove_if(out.phases.begin(), out.phases.end(),
                                  [](const PhaseSpan& s) { return s.end_ns <= s.start_ns; }),
                   out.phases.end());
  return out;
}

}  // namespace memfit
