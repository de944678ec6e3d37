// The checkpointing DP against brute force, and its speed and rounding on a long chain.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>
#include <random>

#include "memfit/plan/schedule.h"

namespace memfit {
namespace {

ChainCosts random_chain(std::mt19937& rng, int n) {
  std::uniform_int_distribution<int> bytes(1, 40), small(0, 10), param(0, 8);
  std::uniform_real_distribution<double> secs(0.1, 3.0);
  ChainCosts c;
  c.fixed_bytes = small(rng);
  c.gradients_present = rng() % 2;
  c.segment_overhead_bytes = rng() % 3;
  for (int i = 0; i < n; ++i) {
    BlockCost b;
    b.forward_seconds = secs(rng);
    b.backward_seconds = 2 * b.forward_seconds;
    b.output_bytes = small(rng) + 1;
    b.output_kept = rng() % 2;
    b.kept_bytes = bytes(rng) + (b.output_kept ? b.output_bytes : 0);
    b.forward_peak = b.kept_bytes + small(rng);
    b.forward_nograd_peak = b.output_bytes + small(rng);
    b.backward_peak = small(rng) + b.output_bytes;
    b.backward_peak_accumulating = small(rng);
    b.backward_held_input_bytes = small(rng) % (b.output_bytes + 1);
    b.backward_held_by_segment_bytes = small(rng) % (b.output_bytes + 1);
    b.backward_held_all_bytes = b.backward_held_input_bytes + b.backward_held_by_segment_bytes;
    b.param_bytes = param(rng);
    c.blocks.push_back(b);
  }
  return c;
}

// Every way to cut the chain into plain blocks and checkpointed segments.
void all_schedules(int n, int start, std::vector<std::pair<int, int>>& current,
                   const std::function<void(const std::vector<std::pair<int, int>>&)>& visit) {
  if (start == n) {
    visit(current);
    return;
  }
  all_schedules(n, start + 1, current, visit);  // block `start` plain
  for (int last = start; last < n; ++last) {   // or a segment starting there
    current.emplace_back(start, last);
    all_schedules(n, last + 1, current, visit);
    current.pop_back();
  }
}

TEST(ScheduleTest, DpEqualsBruteForceOnRandomChains) {
  std::mt19937 rng(1234);
  int checked = 0, infeasible = 0;
  for (int trial = 0; trial < 300; ++trial) {
    const int n = 1 + trial % 8;
    ChainCosts c = random_chain(rng, n);
    const int64_t plain = evaluate_schedule(c, {}).peak_bytes;
    const int64_t limit = std::uniform_int_distribution<int64_t>(plain / 3, plain)(rng);
    double best = 1e30;
    std::vector<std::pair<int, int>> current;
    all_schedules(n, 0, current, [&](const auto& segments) {
      Schedule s = evaluate_schedule(c, segments);
      if (s.peak_bytes <= limit) best = std::min(best, s.recompute_seconds);
    });
    // One slot per byte: the DP's rounding is exact here.
    Schedule dp = solve_schedule(c, limit, static_cast<int>(limit));
    if (best == 1e30) {
      EXPECT_FALSE(dp.feasible) << "trial " << trial;
      ++infeasible;
      continue;
    }
    ASSERT_TRUE(dp.feasible) << "trial " << trial << ": brute force found " << best;
    EXPECT_NEAR(dp.recompute_seconds, best, 1e-9) << "trial " << trial;
    EXPECT_LE(dp.peak_bytes, limit);
    ++checked;
  }
  EXPECT_GT(checked, 100);
  EXPECT_GT(infeasible, 0);  // the limits reach below the floor sometimes
}

// With offloading allowed: every schedule of plain, checkpointed and offloaded units against the
// DP, by extra seconds (recompute + copies), free or pinned segments.
TEST(ScheduleTest, DpWithOffloadEqualsBruteForce) {
  std::mt19937 rng(4321);
  int checked = 0, offloading = 0;
  for (int trial = 0; trial < 200; ++trial) {
    const int n = 1 + trial % 7;
    ChainCosts c = random_chain(rng, n);
    c.activation_offload = true;
    c.copy_bytes_per_second = std::uniform_real_distribution<double>(2.0, 60.0)(rng);  // bytes/s, to rival recompute
    const int64_t plain = evaluate_schedule(c, {}).peak_bytes;
    const int64_t limit = std::uniform_int_distribution<int64_t>(plain / 3, plain)(rng);
    double best = 1e30;
    std::vector<std::pair<int, int>> current;
    all_schedules(n, 0, current, [&](const auto& segments) {
      std::vector<int> free;  // blocks in no segment: each kept or offloaded
      for (int k = 0; k < n; ++k) {
        if (std::none_of(segments.begin(), segments.end(), [k](auto s) { return s.first <= k && k <= s.second; })) free.push_back(k);
      }
      for (uint32_t mask = 0; mask < (1u << free.size()); ++mask) {
        std::vector<int> offloaded;
        for (size_t i = 0; i < free.size(); ++i) {
          if (mask & (1u << i)) offloaded.push_back(free[i]);
        }
        const Schedule s = evaluate_schedule(c, segments, offloaded);
        if (s.peak_bytes <= limit) best = std::min(best, s.recompute_seconds + s.copy_seconds);
      }
    });
    const Schedule dp = solve_schedule(c, limit, static_cast<int>(limit));
    if (best == 1e30) {
      EXPECT_FALSE(dp.feasible) << "trial " << trial;
      continue;
    }
    ASSERT_TRUE(dp.feasible) << "trial " << trial << ": brute force found " << best;
    EXPECT_NEAR(dp.recompute_seconds + dp.copy_seconds, best, 1e-9) << "trial " << trial;
    EXPECT_LE(dp.peak_bytes, limit);
    EXPECT_EQ(dp.host_bytes > 0, !dp.offloaded.empty());
    offloading += !dp.offloaded.empty();
    ++checked;
  }
  EXPECT_GT(checked, 80);
  EXPECT_GT(offloading, 20);  // offloading wins often enough to be tested
}

// Blocks that cannot be recomputed (a Python model's code before its first block and after its
// last) stay out of every segment, and the DP still finds the best schedule of the rest.
TEST(ScheduleTest, BlocksThatCannotBeRecomputedStayOutOfSegments) {
  std::mt19937 rng(4321);
  int checked = 0;
  for (int trial = 0; trial < 200; ++trial) {
    const int n = 2 + trial % 7;
    ChainCosts c = random_chain(rng, n);
    c.blocks.front().recomputable = false;
    c.blocks.back().recomputable = trial % 2 == 0;
    if (trial % 3 == 0) c.blocks[n / 2].recomputable = false;
    const int64_t plain = evaluate_schedule(c, {}).peak_bytes;
    const int64_t limit = std::uniform_int_distribution<int64_t>(plain / 3, plain)(rng);
    const auto allowed = [&c](const std::vector<std::pair<int, int>>& segments) {
      for (const auto& [first, last] : segments) {
        for (int k = first; k <= last; ++k) {
          if (!c.blocks[k].recomputable) return false;
        }
      }
      return true;
    };
    double best = 1e30;
    std::vector<std::pair<int, int>> current;
    all_schedules(n, 0, current, [&](const auto& segments) {
      if (!allowed(segments)) return;
      Schedule s = evaluate_schedule(c, segments);
      if (s.peak_bytes <= limit) best = std::min(best, s.recompute_seconds);
    });
    Schedule dp = solve_schedule(c, limit, static_cast<int>(limit));
    if (best == 1e30) {
      EXPECT_FALSE(dp.feasible) << "trial " << trial;
      continue;
    }
    ASSERT_TRUE(dp.feasible) << "trial " << trial;
    EXPECT_TRUE(allowed(dp.segments)) << "trial " << trial;
    EXPECT_NEAR(dp.recompute_seconds, best, 1e-9) << "trial " << trial;
    ++checked;
  }
  EXPECT_GT(checked, 50);
}

// A non-reentrant checkpoint holds only each block's incoming gradient in a segment's backward:
// never more than memfit's own checkpoint, the same plain schedule, and by exactly the output
// and incoming gradient where those set the peak.
TEST(ScheduleTest, NonReentrantSegmentsHoldOnlyTheIncomingGradient) {
  std::mt19937 rng(77);
  for (int trial = 0; trial < 100; ++trial) {
    ChainCosts c = random_chain(rng, 2 + trial % 6);
    ChainCosts n = c;
    n.non_reentrant = true;
    const int last = static_cast<int>(c.blocks.size()) - 1;
    EXPECT_EQ(evaluate_schedule(n, {}).peak_bytes, evaluate_schedule(c, {}).peak_bytes);
    EXPECT_LE(evaluate_schedule(n, {{0, last}}).peak_bytes, evaluate_schedule(c, {{0, last}}).peak_bytes);
  }
  ChainCosts c;
  BlockCost b;
  b.output_bytes = 10;
  b.kept_bytes = 100;
  b.backward_peak = 1000;
  c.blocks = {b, b};
  c.blocks[0].backward_peak = 2000;  // the peak: block 0's backward inside segment [0, 1]
  const int64_t reentrant = evaluate_schedule(c, {{0, 1}}).peak_bytes;
  c.non_reentrant = true;
  EXPECT_EQ(reentrant - evaluate_schedule(c, {{0, 1}}).peak_bytes, 10 + 10);  // its output, and the segment's delta
}

// A segment's random state is taken before its forward and freed when its backward is done:
// alive under its own peaks, and under the recompute twice (the recompute keeps the state it
// found, to put it back). A plain block takes none.
TEST(ScheduleTest, ASegmentsRandomStateLivesThroughItsOwnPeaks) {
  ChainCosts c;
  BlockCost b;
  b.output_bytes = 10;
  b.kept_bytes = 100;
  b.forward_peak = 100;
  b.forward_nograd_peak = 10;
  b.backward_peak = 1000;
  c.blocks = {b};
  const int64_t none = evaluate_schedule(c, {{0, 0}}).peak_bytes;
  c.segment_overhead_bytes = 7;
  EXPECT_EQ(evaluate_schedule(c, {{0, 0}}).peak_bytes - none, 7) << "the backward's peak";
  c.blocks[0].forward_peak = 5000;  // the recompute's peak now
  const int64_t recompute = evaluate_schedule(c, {{0, 0}}).peak_bytes;
  c.segment_overhead_bytes = 0;
  EXPECT_EQ(recompute - evaluate_schedule(c, {{0, 0}}).peak_bytes, 2 * 7) << "the recompute's peak";
  const int64_t plain = evaluate_schedule(c, {}).peak_bytes;
  c.segment_overhead_bytes = 7;
  EXPECT_EQ(evaluate_schedule(c, {}).peak_bytes, plain) << "a plain block";
}

TEST(ScheduleTest, PlainWhenEverythingFits) {
  std::mt19937 rng(7);
  ChainCosts c = random_chain(rng, 6);
  const int64_t plain = evaluate_schedule(c, {}).peak_bytes;
  Schedule s = solve_schedule(c, plain);
  ASSERT_TRUE(s.feasible);
  EXPECT_TRUE(s.segments.empty());
  EXPECT_EQ(s.recompute_seconds, 0);
}

TEST(ScheduleTest, FortyEightBlocksWithFineSlotsFitWithinOneSlotPerUnit) {
  std::mt19937 rng(99);
  ChainCosts c = random_chain(rng, 48);
  for (auto& b : c.blocks) {  // realistic sizes: MiB-scale blocks
    b.kept_bytes *= 1 << 20;
    b.output_bytes *= 1 << 18;
    b.forward_peak *= 1 << 20;
    b.forward_nograd_peak *= 1 << 18;
    b.backward_peak *= 1 << 20;
    b.backward_peak_accumulating *= 1 << 20;
    b.backward_held_input_bytes *= 1 << 18;
    b.backward_held_by_segment_bytes *= 1 << 18;
    b.backward_held_all_bytes *= 1 << 18;
    b.param_bytes *= 1 << 16;
  }
  c.fixed_bytes = 100 << 20;
  const int64_t plain = evaluate_schedule(c, {}).peak_bytes;
  const int64_t limit = plain / 2;
  Schedule s = solve_schedule(c, limit);  // default slots: 200 per block
  ASSERT_TRUE(s.feasible);
  // Rounding: at most one slot per unit is lost, 48 units x limit/9600 = 0.5% of the limit.
  const double slot = static_cast<double>(limit) / (200 * 48);
  EXPECT_LE(48 * slot, 0.01 * static_cast<double>(limit));
  EXPECT_LE(s.peak_bytes, limit);
}

}  // namespace
}  // namespace memfit
