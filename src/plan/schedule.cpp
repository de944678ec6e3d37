#include "memfit/plan/schedule.h"
#include "memfit/errors.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

namespace memfit {
namespace {

// One unit: plain block `first` (first == last, checkpointed false), a checkpointed segment, or
// an offloaded block (first == last, offloaded).
struct Unit {
  int first, last;
  bool checkpointed;
  bool offloaded = false;
};

// The chain-independent memory model, shared by evaluate_schedule and the DP so they agree.
struct Model {
  const ChainCosts& c;
  std::vector<int64_t> grads_after;  // grads_after[k]: gradient bytes of blocks > k
  std::vector<int64_t> casts_from;   // casts_from[k]: autocast copies of blocks >= k (cached ahead)
  std::vector<int64_t> left_before;  // left_before[k]: forward leftovers of blocks < k (never below 0)
  // In a segment, what blocks < k keep all the same (segment_kept_bytes), and their outputs kept there.
  std::vector<int64_t> segment_kept_before, segment_outputs_before;
  std::vector<int64_t> handed_new_before;  // handed_new_before[k]: handed_new_bytes of blocks < k

  explicit Model(const ChainCosts& costs) : c(costs) {
    const int n = static_cast<int>(c.blocks.size());
    grads_after.assign(static_cast<size_t>(n) + 1, 0);
    casts_from.assign(static_cast<size_t>(n) + 1, 0);
    left_before.assign(static_cast<size_t>(n) + 1, 0);
    segment_kept_before.assign(static_cast<size_t>(n) + 1, 0);
    segment_outputs_before.assign(static_cast<size_t>(n) + 1, 0);
    handed_new_before.assign(static_cast<size_t>(n) + 1, 0);
    for (int k = 0; k < n; ++k) {
      const BlockCost& blk = c.blocks[k];
      left_before[k + 1] = std::max<int64_t>(0, left_before[k] + blk.forward_left_bytes);
      segment_kept_before[k + 1] = segment_kept_before[k] + blk.segment_kept_bytes;
      segment_outputs_before[k + 1] = segment_outputs_before[k] + (blk.segment_output_kept ? blk.output_bytes : 0);
      handed_new_before[k + 1] = handed_new_before[k] + blk.handed_new_bytes;
    }
    for (int k = n - 1; k >= 0; --k) {
      const bool carried = k + 1 < n && !c.gradients_streamed;
      grads_after[k] = grads_after[k + 1] + (carried ? c.blocks[k + 1].param_bytes : 0);
      casts_from[k] = casts_from[k + 1] + c.blocks[k].cast_bytes;
    }
  }
  const BlockCost& b(int k) const { return c.blocks[static_cast<size_t>(k)]; }
  // The copy of its input that a block writing into it runs on where that input is kept by
  // someone else: a checkpointed segment's saved input (in the forward and in the recompute) and
  // the chain's own input (block 0). Its output may then be that copy.
  int64_t copy(const Unit& u, int k) const {
    return k == u.first && (u.checkpointed || k == 0) ? b(k).input_copy_bytes : 0;
  }
  // Block k's output while its own backward runs: there where its graph keeps it.
  int64_t own_output(int k) const { return b(k).keeps_own_output ? b(k).output_bytes : 0; }
  // That copy where the block's graph keeps it for backward, not as its output.
  int64_t copy_kept(const Unit& u, int k) const { return b(k).input_copy_kept ? copy(u, k) : 0; }
  // Block k's backward above what is live when it starts: with every gradient already there it
  // only adds into them; streamed, each gradient leaves once made.
  int64_t backward(int k) const {
    if (c.gradients_present) return b(k).shared_gradient_bytes + b(k).backward_peak_accumulating;
    if (c.gradients_streamed && b(k).backward_peak_streamed >= 0) return b(k).backward_peak_streamed;
    return b(k).backward_peak;
  }
  // Whether block k's input outlives the block's own use of it in unit u (the profile frees it
  // where the block's backward is done with it): the caller's batch (block 0 not copying it), an
  // output the block before keeps in its own graph, a checkpointed segment's saved input.
  bool input_held(const Unit& u, int k) const {
    if (k == 0 || (u.checkpointed && k == u.first)) return b(k).input_copy_bytes == 0;
    return b(k - 1).keeps_own_output;
  }
  // What block k's backward peak grows by when it ends a segment (the segment holds the gradient
  // that arrived and its recomputed output until its backward returns) or its input outlives it.
  int64_t held_past_use(int k, bool segment_end, bool input) const {
    if (segment_end) return input ? b(k).backward_held_all_bytes : b(k).backward_held_by_segment_bytes;
    return input ? b(k).backward_held_input_bytes : 0;
  }
  // Never negative: fitted and calibrated numbers can undershoot the output's exact size.
  int64_t internal(int k) const {
    return std::max<int64_t>(0, b(k).kept_bytes - (b(k).output_kept ? b(k).output_bytes : 0));
  }
  int64_t all_grads() const { return grads_after[0] + (c.blocks.empty() ? 0 : c.blocks[0].param_bytes); }
  // Gradients alive in forward: a later micro-batch runs its forward with every gradient there.
  int64_t forward_grads() const { return c.gradients_present ? all_grads() : 0; }
  // Live in block k's forward besides its own peak: gradients already there, the weight casts
  // cached ahead, what earlier blocks' forward left until forward ends.
  int64_t in_forward(int k) const { return forward_grads() + casts_from[k + 1] + left_before[k]; }

  // Bytes of block k's output kept while the following unit is `next_checkpointed`.
  int64_t pending(int k, bool next_checkpointed) const {
    if (k < 0) return 0;
    return (next_checkpointed || b(k).output_kept) ? b(k).output_bytes : 0;
  }
  // What unit u adds to the held bytes, its last output excepted (resolved by the next unit).
  // A checkpointed segment's weight casts stay cached until forward ends (counted through
  // backward too: a small overestimate that keeps the model on the safe side).
  int64_t held(const Unit& u) const {
    if (u.offloaded) return stays(u);  // the rest is on the host until its backward
    if (!u.checkpointed) return internal(u.first) + copy_kept(u, u.first);
    return c.segment_overhead_bytes + casts_from[u.first] - casts_from[u.last + 1] + segment_kept(u, u.last + 1) +
           handed(u);
  }
  int64_t recompute_peak(int k) const { return b(k).recompute_peak >= 0 ? b(k).recompute_peak : b(k).forward_peak; }
  // The second copy of block k's output a recompute of segment u makes (BlockCost::
  // recomputed_output_copy_bytes): alive from the recompute to the block's backward. Not the
  // segment's last block: the code after it has run its backward, freeing the forward's copy.
  int64_t recomputed_copy(const Unit& u, int k) const { return k < u.last ? b(k).recomputed_output_copy_bytes : 0; }
  // What the recordings of segment u's blocks hold of the tensors handed to them (each storage
  // once in a segment, handed on from block to block), to its backward's end.
  // Counted from the segment's end: in forward such a tensor is alive all the same (the model's
  // code hands it on), counted in the leftovers of the part that made it; the units after the
  // segment count it in their forward too (held), a small overestimate on the safe side.
  int64_t handed(const Unit& u) const {
    return b(u.first).handed_bytes + handed_new_before[u.last + 1] - handed_new_before[u.first + 1];
  }
  // What the blocks of segment u before block `end` keep to the end of forward all the same: the
  // tensors the model's own code between them saves, and their outputs where that code keeps them
  // (the segment's last output is the next unit's input, counted there).
  int64_t segment_kept(const Unit& u, int end) const {
    return segment_kept_before[end] - segment_kept_before[u.first] + segment_outputs_before[std::min(end, u.last)] -
           segment_outputs_before[u.first];
  }

  // The highest live bytes while unit u runs forward and backward, given `before` bytes held by
  // the units before it (their pending output included). An offloaded block just before u comes
  // back while u's backward runs (prefetched one block ahead): its host bytes are on the device
  // again from the start of u's backward (`prefetched`).
  // A segment's own random state is taken before its forward and kept until its backward is
  // done (held(u) counts it for the units after).
  int64_t peak(const Unit& u, int64_t before, int64_t prefetched = 0) const {
    const int64_t base = c.fixed_bytes + before;
    return u.checkpointed ? segment_peak(u, base + c.segment_overhead_bytes, prefetched) : plain_peak(u.first, base, prefetched);
  }
  int64_t plain_peak(int k, int64_t base, int64_t prefetched) const {
    const int64_t grads = c.gradients_present ? all_grads() : grads_after[k];
    const Unit u{k, k, false};
    // In forward, the casts of the blocks ahead are already cached (the step makes them all
    // first); a block's own cast is part of its measured forward peak. Its backward's peak
    // counts the gradient arriving for its output, freed once used.
    return std::max(base + in_forward(k) + copy(u, k) + b(k).forward_peak,
                    base + prefetched + grads + own_output(k) + internal(k) + copy_kept(u, k) + backward(k) +
                        held_past_use(k, false, input_held(u, k)));
  }
  // What comes back ahead of unit u's backward: the host bytes of block u.first - 1, offloaded.
  int64_t prefetched_before(const Unit& u, bool previous_offloaded) const {
    return previous_offloaded ? host(Unit{u.first - 1, u.first - 1, false, true}) : 0;
  }
  int64_t segment_peak(const Unit& u, int64_t base_forward, int64_t prefetched) const {
    // In backward (recompute included); what the recordings hold stays to the segment's end.
    const int64_t base = base_forward + prefetched + handed(u);
    const int64_t grads = c.gradients_present ? all_grads() : grads_after[u.last];
    const int64_t delta = b(u.last).output_bytes;  // the gradient arriving from the next unit
    // Forward without grad: block k's peak is above its start, its input alive (the segment's
    // own input is counted in `before`, the next blocks' are the outputs before them).
    int64_t p = 0;
    for (int k = u.first; k <= u.last; ++k) {
      const int64_t input = k > u.first ? b(k - 1).output_bytes : 0;
      p = std::max(p, base_forward + in_forward(k) + segment_kept(u, k) + input + copy(u, k) + b(k).forward_nograd_peak);
    }
    // Backward: the segment runs again keeping everything (and the random state it found, put
    // back after it; the forward's leftovers are gone), then its blocks' backward.
    // Live at the recompute besides the model's count: the gradient that arrived (delta); with a
    // non-reentrant checkpoint, what was measured at the first read of a saved tensor, which
    // counts that gradient and the others made before it (where none was measured, delta).
    const int64_t at_recompute =
        c.non_reentrant && b(u.last).recompute_start_extra_bytes > 0 ? b(u.last).recompute_start_extra_bytes : delta;
    // Each block runs alone (the model's code between blocks is not run again: what it saved in
    // forward is still there for the blocks not yet recomputed).
    int64_t kept = 0;
    for (int k = u.first; k <= u.last; ++k) {
      const int64_t from_forward = segment_kept(u, u.last) - segment_kept(u, k);
      p = std::max(p, base + c.segment_overhead_bytes + grads + at_recompute + kept + from_forward + copy(u, k) +
                          recompute_peak(k));
      kept += b(k).kept_bytes + copy_kept(u, k) + recomputed_copy(u, k);
    }
    // Until the segment's backward returns it holds its recomputed output and the gradient that
    // arrived for it (delta): both alive under every block's backward (whose peak counts the
    // gradient of that block's output; the last block's is delta, held). Non-reentrant: the
    // segment holds neither; each block's backward runs as a plain block's.
    int64_t below = kept;
    for (int k = u.last; k >= u.first; --k) {
      below -= b(k).kept_bytes + copy_kept(u, k) + recomputed_copy(u, k);
      const int64_t g = c.gradients_present ? all_grads() : grads_after[k];
      if (c.non_reentrant) {
        p = std::max(p, base + g + own_output(k) + below + internal(k) + copy_kept(u, k) + backward(k) +
                            held_past_use(k, false, input_held(u, k)));
        continue;
      }
      const int64_t outputs = b(u.last).output_bytes + (k < u.last ? own_output(k) : 0);  // recomputed
      const int64_t held = (k < u.last ? delta : 0) + held_past_use(k, k == u.last, input_held(u, k));
      p = std::max(p, base + g + outputs + below + internal(k) + copy_kept(u, k) + held + backward(k));
    }
    return p;
  }
  // An offloaded block's activations: on the host from its forward to its backward; and the time
  // of copying them there and back. (Its peaks are a plain block's: it runs as one, and its
  // activations are all back on the device before its backward.)
  int64_t host(const Unit& u) const { return u.offloaded ? internal(u.first) + copy_kept(u, u.first) - stays(u) : 0; }
  // What an offloaded block's graph keeps on the device: autocast's copies of its weights, made
  // before it ran (the step casts every weight first), counted in its kept bytes as profiled.
  int64_t stays(const Unit& u) const { return u.offloaded ? std::min(b(u.first).cast_bytes, internal(u.first)) : 0; }
  double copy_seconds(const Unit& u) const {
    if (!u.offloaded || c.copy_bytes_per_second <= 0) return 0;
    return 2.0 * static_cast<double>(host(u)) / c.copy_bytes_per_second;
  }
  double extra_seconds(const Unit& u) const { return recompute_seconds(u) + copy_seconds(u); }
  double recompute_seconds(const Unit& u) const {
    double s = 0;
    if (u.checkpointed) {
      for (int k = u.first; k <= u.last; ++k) s += b(k).forward_seconds;
    }
    return s;
  }
  double base_seconds() const {
    double s = 0;
    for (const auto& blk : c.blocks) s += blk.forward_seconds + blk.backward_seconds;
    return s;
  }
  // Schedule::host_first_pass_bytes, given each block's host bytes. An offloaded block's host
  // copy goes when its own backward starts (prefetched, it is kept until then).
  int64_t host_first_pass(const std::vector<int64_t>& host_by_block) const {
    int64_t activations = 0;
    for (int64_t h : host_by_block) activations += h;
    if (!c.gradients_streamed) return activations;  // all of them at the end of forward
    int64_t peak = activations, gradients = 0;
    for (int k = static_cast<int>(host_by_block.size()) - 1; k >= 0; --k) {
      activations -= host_by_block[static_cast<size_t>(k)];
      gradients += b(k).param_bytes;
      peak = std::max(peak, activations + gradients);
    }
    return peak;
  }
  // End of forward: everything held, the last output's fate, and the loss's own bytes.
  int64_t end_of_forward(int64_t held_total, int last_block) const {
    return c.fixed_bytes + forward_grads() + held_total + pending(last_block, false) + c.loss_bytes;
  }
};

std::vector<Unit> units_of(int n, const std::vector<std::pair<int, int>>& segments, const std::vector<int>& offloaded) {
  std::vector<Unit> units;
  const auto plain = [&](int k) {
    units.push_back({k, k, false, std::binary_search(offloaded.begin(), offloaded.end(), k)});
  };
  int next = 0;
  for (const auto& [first, last] : segments) {
    if (first < next || last < first || last >= n) {
      throw OptionError("segments", "[" + std::to_string(first) + ", " + std::to_string(last) + "]",
                        "expected sorted, disjoint segments inside the chain of " + std::to_string(n) + " blocks");
    }
    for (int k = next; k < first; ++k) plain(k);
    units.push_back({first, last, true});
    next = last + 1;
  }
  for (int k = next; k < n; ++k) plain(k);
  return units;
}

}  // namespace

std::vector<int> Schedule::recomputed_blocks() const {
  std::vector<int> out;
  for (const auto& [a, b] : segments) {
    for (int k = a; k <= b; ++k) out.push_back(k);
  }
  return out;
}

Schedule evaluate_schedule(const ChainCosts& costs, const std::vector<std::pair<int, int>>& segments,
                           const std::vector<int>& offloaded) {
  const Model m(costs);
  const int n = static_cast<int>(costs.blocks.size());
  Schedule s;
  s.segments = segments;
  s.offloaded = offloaded;
  int64_t held = 0;
  int prev_last = -1;
  bool prev_offloaded = false;
  std::vector<int64_t> host_by_block(static_cast<size_t>(n), 0);
  for (const Unit& u : units_of(n, segments, offloaded)) {
    held += m.pending(prev_last, u.checkpointed);
    s.peak_bytes = std::max(s.peak_bytes, m.peak(u, held, m.prefetched_before(u, prev_offloaded)));
    held += m.held(u);
    prev_offloaded = u.offloaded;
    s.host_bytes += m.host(u);
    host_by_block[static_cast<size_t>(u.first)] += m.host(u);
    s.recompute_seconds += m.recompute_seconds(u);
    s.copy_seconds += m.copy_seconds(u);
    prev_last = u.last;
  }
  s.peak_bytes = std::max(s.peak_bytes, m.end_of_forward(held, prev_last));
  s.host_first_pass_bytes = m.host_first_pass(host_by_block);
  s.seconds = m.base_seconds() + s.recompute_seconds + s.copy_seconds;
  s.feasible = true;
  return s;
}

namespace {

// Which units the DP may place: any plain block, any segment of recomputable blocks, any block
// offloaded where the costs allow; with pinned segments, exactly those segments, and single
// blocks (kept or offloaded) elsewhere.
struct UnitRules {
  UnitRules(const Model& model, const std::vector<std::pair<int, int>>* pinned) : m(model), pinned(pinned != nullptr) {
    const int n = static_cast<int>(m.c.blocks.size());
    pinned_end.assign(static_cast<size_t>(n), -1);
    in_pinned.assign(static_cast<size_t>(n), false);
    if (pinned == nullptr) return;
    for (const auto& [first, last] : *pinned) {
      if (first < 0 || last < first || last >= n) {
        throw OptionError("segments", "[" + std::to_string(first) + ", " + std::to_string(last) + "]",
                          "expected pinned segments inside the chain of " + std::to_string(n) + " blocks");
      }
      pinned_end[static_cast<size_t>(first)] = last;
      for (int k = first; k <= last; ++k) in_pinned[static_cast<size_t>(k)] = true;
    }
  }
  bool allowed(const Unit& u) const {
    if (u.offloaded && !m.c.activation_offload) return false;
    if (!pinned) return u.checkpointed ? m.b(u.last).recomputable : u.first == u.last;
    if (u.checkpointed) return pinned_end[static_cast<size_t>(u.first)] == u.last;
    return u.first == u.last && !in_pinned[static_cast<size_t>(u.first)];
  }

  const Model& m;
  bool pinned;
  std::vector<int> pinned_end;  // by first block: the pinned segment's last (-1: none starts there)
  std::vector<bool> in_pinned;
};

// A DP state past its block position: h slots held by the blocks placed, and whether the last
// of them is offloaded (it comes back during the next unit's backward: Model::peak).
struct Held {
  int h = 0;
  bool offloaded = false;
  size_t index() const { return 2 * static_cast<size_t>(h) + (offloaded ? 1 : 0); }
};

// The DP's way back: the unit that reached each state and the state before it.
struct Parent {
  int first = -1, last = -1;
  Held before;
  bool checkpointed = false, offloaded = false;
};

// The schedule the parents lead to from (n, end), evaluated exactly.
Schedule backtrack(const ChainCosts& costs, const std::vector<std::vector<Parent>>& parent, int n, Held end) {
  std::vector<std::pair<int, int>> segments;
  std::vector<int> offloaded;
  for (int p = n; p > 0;) {
    const Parent& par = parent[static_cast<size_t>(p)][end.index()];
    if (par.checkpointed) segments.emplace_back(par.first, par.last);
    if (par.offloaded) offloaded.push_back(par.first);
    p = par.first;
    end = par.before;
  }
  std::reverse(segments.begin(), segments.end());
  std::reverse(offloaded.begin(), offloaded.end());
  return evaluate_schedule(costs, segments, offloaded);
}

}  // namespace

Schedule solve_schedule(const ChainCosts& costs, int64_t limit, int slots, const std::vector<std::pair<int, int>>* pinned) {
  const Model m(costs);
  const UnitRules rules(m, pinned);
  const int n = static_cast<int>(costs.blocks.size());
  if (slots <= 0) slots = std::max(200 * n, 1000);
  const double slot = std::max(1.0, static_cast<double>(limit) / slots);
  // Sizes round up to whole slots; anything beyond the limit maps to slots + 1 (never fits).
  auto to_slots = [&](int64_t bytes) {
    if (bytes <= 0) return 0;
    const double v = std::ceil(static_cast<double>(bytes) / slot - 1e-9);
    return v > slots ? slots + 1 : static_cast<int>(v);
  };
  auto to_bytes = [&](int h) { return static_cast<int64_t>(std::ceil(h * slot)); };

  constexpr double kInf = std::numeric_limits<double>::infinity();
  const size_t states = 2 * static_cast<size_t>(slots + 1);  // Held::index
  // best[p][state]: least extra seconds (recompute, copies) to have placed blocks < p holding
  // state.h slots (the last block's output excepted); parent: the unit that got there and the
  // state before.
  std::vector<std::vector<double>> best(static_cast<size_t>(n) + 1, std::vector<double>(states, kInf));
  std::vector<std::vector<Parent>> parent(static_cast<size_t>(n) + 1, std::vector<Parent>(states));
  best[0][Held{}.index()] = 0;
  for (int p = 0; p < n; ++p) {
    for (int h = 0; h <= slots; ++h) {
      for (const Held before : {Held{h, false}, Held{h, true}}) {
        const double cost = best[p][before.index()];
        if (cost == kInf) continue;
        for (int q = p; q < n; ++q) {
          for (const Unit& u : {Unit{p, q, false}, Unit{p, q, true}, Unit{p, q, false, true}}) {
            if (!rules.allowed(u)) continue;
            const int h_before = h + to_slots(m.pending(p - 1, u.checkpointed));
            if (h_before > slots) continue;
            if (m.peak(u, to_bytes(h_before), m.prefetched_before(u, before.offloaded)) > limit) continue;
            const Held after{h_before + to_slots(m.held(u)), u.offloaded};
            if (after.h > slots) continue;
            const double c = cost + m.extra_seconds(u);
            if (c < best[q + 1][after.index()]) {
              best[q + 1][after.index()] = c;
              parent[q + 1][after.index()] = {p, q, before, u.checkpointed, u.offloaded};
            }
          }
          if (!m.b(q).recomputable) break;  // no segment from p reaches past it
        }
      }
    }
  }
  // The cheapest end state whose end of forward fits too; ties go to fewer held bytes.
  Held end{-1, false};
  for (int h = 0; h <= slots; ++h) {
    for (const Held state : {Held{h, false}, Held{h, true}}) {
      const double cost = best[n][state.index()];
      if (cost == kInf || m.end_of_forward(to_bytes(h), n - 1) > limit) continue;
      if (end.h < 0 || cost < best[n][end.index()]) end = state;
    }
  }
  if (end.h < 0) return Schedule{};  // infeasible
  Schedule s = backtrack(costs, parent, n, end);
  s.feasible = s.peak_bytes <= limit;
  return s;
}

int64_t smallest_peak(const ChainCosts& costs) {
  // Feasibility is monotone in the limit: bisect between 0 and the plain schedule's peak.
  int64_t hi = evaluate_schedule(costs, {}).peak_bytes, lo = 0;
  int64_t best = hi;
  while (hi - lo > std::max<int64_t>(1, hi / 2000)) {
    const int64_t mid = lo + (hi - lo) / 2;
    Schedule s = solve_schedule(costs, mid);
    if (s.feasible) {
      best = std::min(best, s.peak_bytes);
      hi = mid;
    } else {
      lo = mid;
    }
  }
  return best;
}

}  // namespace memfit
