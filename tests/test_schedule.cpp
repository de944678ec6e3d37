// The checkpointing DP against brute force, and its speed and rounding on a long chain.
#include <gtest/gtest.h>

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
