#include "memfit/plan/schedule.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <stdexcept>

namespace memfit {
namespace {

// One unit: plain block `first` (first == last, checkpointed false) or a checkpointed segment.
struct Unit {
  int first, last;
  bool checkpointed;
};

// The chain-independent memory model, shared by evaluate_schedule and the DP so they agree.
struct Model {
  const ChainCosts& c;
  std::vector<int64_t> grads_after;  // grads_after[k]: gradient bytes of blocks > k
  std::vector<int64_t> casts_from;   // casts_from[k]: autocast copies of blocks >= k (cached ahead)

  explicit Model(const ChainCosts& costs) : c(costs) {
    const int n = static_cast<int>(c.blocks.size());
    grads_after.assign(static_cast<size_t>(n) + 1, 0);
    casts_from.assign(static_cast<size_t>(n) + 1, 0);
    for (int k = n - 1; k >= 0; --k) {
      grads_after[k] = grads_after[k + 1] + (k + 1 < n ? c.blocks[k + 1].param_bytes : 0);
      casts_from[k] = casts_from[k + 1] + c.blocks[k].cast_bytes;
    }
  }
  const BlockCost& b(int k) const { return c.blocks[static_cast<size_t>(k)]; }
  // Never negative: fitted and calibrated numbers can undershoot the output's exact size.
  int64_t internal(int k) const {
    return std::max<int64_t>(0, b(k).kept_bytes - (b(k).output_kept ? b(k).output_bytes : 0));
  }
  int64_t all_grads() const { return grads_after[0] + (c.blocks.empty() ? 0 : c.blocks[0].param_bytes); }

  // Bytes of block k's output kept while the following unit is `next_checkpointed`.
  int64_t pending(int k, bool next_checkpointed) const {
    if (k < 0) return 0;
    return (next_checkpointed || b(k).output_kept) ? b(k).output_bytes : 0;
  }
  // What unit u adds to the held bytes, its last output excepted (resolved by the next unit).
  // A checkpointed segment's weight casts stay cached until forward ends (counted through
  // backward too: a small overestimate that keeps the model on the safe side).
  int64_t held(const Unit& u) const {
    if (!u.checkpointed) return internal(u.first);
    return c.segment_overhead_bytes + casts_from[u.first] - casts_from[u.last + 1];
  }

  // The highest live bytes while unit u runs forward and backward, given `before` bytes held by
  // the units before it (their pending output included).
  int64_t peak(const Unit& u, int64_t before) const {
    const int64_t base = c.fixed_bytes + before;
    const int64_t grads = c.gradients_present ? all_grads() : grads_after[u.last];
    const int64_t delta = b(u.last).output_bytes;  // the gradient arriving from the next unit
    int64_t p = 0;
    // In forward, the casts of the blocks ahead are already cached (the step makes them all
    // first); a block's own cast is part of its measured forward peak.
    if (!u.checkpointed) {
      p = std::max(p, base + casts_from[u.first + 1] + b(u.first).forward_peak);
      p = std::max(p, base + grads + delta + internal(u.first) + b(u.first).backward_peak);
      return p;
    }
    for (int k = u.first; k <= u.last; ++k) p = std::max(p, base + casts_from[k + 1] + b(k).forward_nograd_peak);
    // Backward: the segment runs again keeping everything, then its blocks' backward.
    int64_t kept = 0;
    for (int k = u.first; k <= u.last; ++k) {
      p = std::max(p, base + grads + delta + kept + b(k).forward_peak);
      kept += b(k).kept_bytes;
    }
    // Until the segment's backward returns it holds its recomputed output and the gradient that
    // arrived for it (delta): both alive under every block's backward, besides the gradient
    // of that block's own output (which is delta itself for the last block). Non-reentrant: only
    // that gradient.
    int64_t below = kept;
    for (int k = u.last; k >= u.first; --k) {
      below -= b(k).kept_bytes;
      const int64_t g = c.gradients_present ? all_grads() : grads_after[k];
      const int64_t held_by_segment =
          c.non_reentrant ? b(k).output_bytes : delta + (k < u.last ? delta : 0) + b(k).output_bytes;
      p = std::max(p, base + g + held_by_segment + below + internal(k) + b(k).backward_peak);
    }
    return p;
  }
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
  // End of forward: everything held, the last output's fate, and the loss's own bytes.
  int64_t end_of_forward(int64_t held_total, int last_block) const {
    return c.fixed_bytes + held_total + pending(last_block, false) + c.loss_bytes;
  }
};

std::vector<Unit> units_of(int n, const std::vector<std::pair<int, int>>& segments) {
  std::vector<Unit> units;
  int next = 0;
  for (const auto& [first, last] : segments) {
    if (first < next || last < first || last >= n) throw std::invalid_argument("segments must be sorted, disjoint, inside the chain");
    for (int k = next; k < first; ++k) units.push_back({k, k, false});
    units.push_back({first, last, true});
    next = last + 1;
  }
  for (int k = next; k < n; ++k) units.push_back({k, k, false});
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

Schedule evaluate_schedule(const ChainCosts& costs, const std::vector<std::pair<int, int>>& segments) {
  const Model m(costs);
  const int n = static_cast<int>(costs.blocks.size());
  Schedule s;
  s.segments = segments;
  int64_t held = 0;
  int prev_last = -1;
  for (const Unit& u : units_of(n, segments)) {
    held += m.pending(prev_last, u.checkpointed);
    s.peak_bytes = std::max(s.peak_bytes, m.peak(u, held));
    held += m.held(u);
    s.recompute_seconds += m.recompute_seconds(u);
    prev_last = u.last;
  }
  s.peak_bytes = std::max(s.peak_bytes, m.end_of_forward(held, prev_last));
  s.seconds = m.base_seconds() + s.recompute_seconds;
  s.feasible = true;
  return s;
}

Schedule solve_schedule(const ChainCosts& costs, int64_t limit, int slots) {
  const Model m(costs);
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
  const int width = slots + 1;
  // best[p][h]: least recompute seconds to have placed blocks < p holding h slots (the last
  // block's output excepted); parent: the unit that got there and the previous h.
  std::vector<std::vector<double>> best(static_cast<size_t>(n) + 1, std::vector<double>(static_cast<size_t>(width), kInf));
  struct Parent {
    int first = -1, last = -1, h = -1;
    bool checkpointed = false;
  };
  std::vector<std::vector<Parent>> parent(static_cast<size_t>(n) + 1, std::vector<Parent>(static_cast<size_t>(width)));
  best[0][0] = 0;
  for (int p = 0; p < n; ++p) {
    for (int h = 0; h < width; ++h) {
      const double cost = best[p][h];
      if (cost == kInf) continue;
      for (int q = p; q < n; ++q) {
        for (bool ck : {false, true}) {
          if (!ck && q != p) continue;
          if (ck && !m.b(q).recomputable) continue;
          const Unit u{p, q, ck};
          const int h_before = h + to_slots(m.pending(p - 1, ck));
          if (h_before > slots) continue;
          if (m.peak(u, to_bytes(h_before)) > limit) continue;
          const int h_after = h_before + to_slots(m.held(u));
          if (h_after > slots) continue;
          const double c = cost + m.recompute_seconds(u);
          if (c < best[q + 1][h_after]) {
            best[q + 1][h_after] = c;
            parent[q + 1][h_after] = {p, q, h, ck};
          }
        }
        if (!m.b(q).recomputable) break;  // no segment from p reaches past it
      }
    }
  }
  // The cheapest end state whose end of forward fits too; ties go to fewer held bytes.
  int end_h = -1;
  for (int h = 0; h < width; ++h) {
    if (best[n][h] == kInf) continue;
    if (m.end_of_forward(to_bytes(h), n - 1) > limit) continue;
    if (end_h < 0 || best[n][h] < best[n][end_h]) end_h = h;
  }
  Schedule s;
  if (end_h < 0) return s;  // infeasible
  std::vector<std::pair<int, int>> segments;
  for (int p = n, h = end_h; p > 0;) {
    const Parent& par = parent[p][h];
    if (par.checkpointed) segments.emplace_back(par.first, par.last);
    p = par.first;
    h = par.h;
  }
  std::reverse(segments.begin(), segments.end());
  s = evaluate_schedule(costs, segments);
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
