// The planner's search on costs written by hand: no model runs, so every expectation follows
// from the numbers below.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <functional>

#include "memfit/memfit.h"

namespace memfit {
namespace {

// A block whose bytes grow linearly with the micro-batch m: `act` bytes kept per sample.
BlockCost block_at(int64_t m, int64_t act, double seconds_per_sample, int64_t params) {
  BlockCost c;
  c.forward_seconds = seconds_per_sample * static_cast<double>(m);
  c.backward_seconds = 2 * c.forward_seconds;
  c.output_bytes = 1000 * m;
  c.output_kept = true;
  c.kept_bytes = act * m + c.output_bytes;
  c.forward_peak = act * m + c.output_bytes;
  c.forward_nograd_peak = 2 * c.output_bytes;
  c.backward_peak = act * m + params + c.output_bytes;  // (the output's gradient arrives first)
  c.backward_peak_accumulating = act * m + c.output_bytes;
  c.param_bytes = params;
  return c;
}

// Four blocks, the second heavy in activations; profiled at m = 2 and 4 of a batch of 8.
PrecisionProfile hand_profile(Precision precision, double time_scale) {
  PrecisionProfile p;
  p.precision = precision;
  const int64_t acts[] = {20000, 200000, 50000, 10000};
  for (int64_t m : {2, 4}) {
    ChainProfile& cp = m == 2 ? p.small : p.large;
    cp.micro_batch = m;
    for (int64_t a : acts) cp.blocks.push_back(block_at(m, a, 0.001 * time_scale, 40000));
  }
  // 3 x forward (fwd + 2 x bwd) x 4 blocks x m samples, with a fixed cost per micro-batch
  p.chain_seconds = {{1, 0.02 * time_scale}, {2, 0.03 * time_scale}, {4, 0.05 * time_scale}, {8, 0.09 * time_scale}};
  return p;
}

WorkloadProfile hand_workload() {
  WorkloadProfile w;
  w.batch = 8;
  w.weight_bytes = 4 * 40000;
  w.batch_bytes = 8 * 100;
  w.segment_overhead_bytes = 5056;
  w.precisions.push_back(hand_profile(Precision::kFP32, 1.0));
  return w;
}

PlanRequest hand_request() {
  PlanRequest r;
  r.step.batch = 8;
  r.optimizer.state_bytes = 2 * 4 * 40000;  // as AdamW would keep
  r.optimizer.step_bytes = 2 * 40000;
  return r;
}

// A ChainTimer from each size's true seconds (the reference ignored: these are no measurements).
ChainTimer each_size(const std::function<double(Precision, int64_t)>& seconds) {
  return [seconds](Precision precision, const std::vector<int64_t>& sizes, const TimingReference&) {
    std::vector<double> out;
    for (int64_t m : sizes) out.push_back(seconds(precision, m));
    return out;
  };
}

// Every schedule of n blocks: each way to cut the chain into plain blocks and segments.
std::vector<std::vector<std::pair<int, int>>> all_schedules(int n) {
  std::vector<std::vector<std::pair<int, int>>> out{{}};
  for (int first = n - 1; first >= 0; --first) {
    std::vector<std::vector<std::pair<int, int>>> more;
    for (const auto& rest : out) {
      const int next = rest.empty() ? n : rest.front().first;
      for (int last = first; last < next; ++last) {
        auto s = rest;
        s.insert(s.begin(), {first, last});
        more.push_back(s);
      }
    }
    out.insert(out.end(), more.begin(), more.end());
  }
  return out;
}

TEST(PlanSearchTest, AmpleBudgetRunsThePlainStep) {
  const Planner planner(hand_workload(), hand_request());
  const Plan p = planner.plan(int64_t{1} << 40);
  ASSERT_TRUE(p.feasible);
  EXPECT_EQ(p.config.micro_batch_size(), 8);
  EXPECT_TRUE(p.config.checkpoint.empty());
  EXPECT_EQ(p.predicted_peak, p.plain_predicted_peak);
}

TEST(PlanSearchTest, ChosenPlanIsTheFastestThatFitsAmongAllSchedulesAndSizes) {
  const Planner planner(hand_workload(), hand_request());
  const Plan plain = planner.plan(int64_t{1} << 40);
  for (double share : {0.9, 0.7, 0.5, 0.35}) {
    const auto budget = static_cast<int64_t>(share * static_cast<double>(plain.plain_predicted_peak));
    const Plan p = planner.plan(budget);
    if (!p.feasible) {
      EXPECT_GT(p.floor_bytes, budget);
      continue;
    }
    EXPECT_LE(p.predicted_peak, budget) << share;
    for (int64_t m : {8, 4, 2, 1}) {
      for (const auto& s : all_schedules(4)) {
        const Plan other = planner.evaluate(m, Precision::kFP32, CheckpointPlan{s}, budget);
        if (!other.feasible) continue;
        // The DP rounds memory to slots, so a rival may fit by a hair more: 1% of time slack.
        EXPECT_LE(p.predicted_seconds, other.predicted_seconds * 1.01)
            << share << ": m=" << m << " " << CheckpointPlan{s}.describe() << " beats " << p.config.describe();
      }
    }
  }
}

// Below the profiled sizes the time model guesses (the line continued: optimistic); a plan that
// would run such a size times it first and plans again with the measured point, which can
// change the choice.
TEST(PlanSearchTest, MicroBatchesBelowTheProfiledSizesAreTimedWhenAPlanWouldRunThem) {
  WorkloadProfile w = hand_workload();
  w.precisions.front().chain_seconds = {{2, 0.02}, {4, 0.04}, {8, 0.08}};  // 1 not timed; guessed 0.01
  const Plan plain = Planner(w, hand_request()).plan(int64_t{1} << 40);
  std::vector<int64_t> timed;
  const auto timer = each_size([&](Precision precision, int64_t m) {
    EXPECT_EQ(precision, Precision::kFP32);
    timed.push_back(m);
    return 0.5;  // a micro-batch of 1 is far slower than any line through 2, 4 and 8 says

  });
  // Ample budget: 1 x 8 is guessed as fast as 8 x 1 (the line through 2, 4 and 8 meets zero),
  // a rival: timed, far slower, and the plan stays 8.
  Planner ample(w, hand_request());
  EXPECT_EQ(plan_timing_as_needed(ample, int64_t{1} << 40, timer).config.micro_batch_size(), 8);
  EXPECT_EQ(timed, std::vector<int64_t>{1});
  timed.clear();
  // The tightest budget that plans (slot rounding: half a percent over the floor): only
  // micro-batches of 1 fit; they are timed, once.
  Planner planner(w, hand_request());
  const int64_t floor = planner.floor_bytes();
  int count = 0;
  const Plan tight = plan_timing_as_needed(planner, floor + floor / 200, timer, &count);
  ASSERT_TRUE(tight.feasible);
  EXPECT_EQ(tight.config.micro_batch_size(), 1);
  EXPECT_EQ(timed, std::vector<int64_t>{1});
  EXPECT_EQ(count, 1);
  EXPECT_TRUE(planner.untimed_sizes(tight).empty());
  EXPECT_GE(tight.predicted_seconds, 8 * 0.5);  // the measured point, not the guess
  // Where 1 sample per micro-batch was the guess's best, the measured point moves the plan
  // to 2 with more recomputed (a budget between the two floors).
  int moved = 0;
  for (int percent = 60; percent >= 10; --percent) {
    const auto budget = static_cast<int64_t>(percent / 100.0 * static_cast<double>(plain.plain_predicted_peak));
    Planner fresh(w, hand_request());
    const Plan guessed = fresh.plan(budget);
    const Plan two = fresh.evaluate(2, Precision::kFP32, CheckpointPlan::all(4), budget);
    if (!guessed.feasible || guessed.config.micro_batch_size() != 1 || !two.feasible) continue;
    EXPECT_EQ(plan_timing_as_needed(fresh, budget, timer).config.micro_batch_size(), 2) << percent << "%";
    ++moved;
  }
  EXPECT_GT(moved, 0) << "no budget where the guess chose 1 and 2 fits: the case above is not exercised";
}

// Above the profiled sizes the line continued is a guess too (caches can make a whole batch
// slower per sample than half of it): the whole batch is timed before a plan runs it.
TEST(PlanSearchTest, TheWholeBatchIsTimedBeforeAPlanRunsIt) {
  WorkloadProfile w = hand_workload();
  w.precisions.front().chain_seconds = {{2, 0.025}, {4, 0.045}};  // 8 guessed 0.085: below 2 x 0.045
  Planner planner(w, hand_request());
  ASSERT_EQ(planner.plan(int64_t{1} << 40).config.micro_batch_size(), 8);
  std::vector<int64_t> timed;
  const auto timer = each_size([&](Precision, int64_t m) {
    timed.push_back(m);
    return 0.2;  // measured: the whole batch is slower than two halves

  });
  int count = 0;
  const Plan plan = plan_timing_as_needed(planner, int64_t{1} << 40, timer, &count);
  EXPECT_EQ(timed, std::vector<int64_t>{8});
  EXPECT_EQ(count, 1);
  EXPECT_EQ(plan.config.micro_batch_size(), 4);
  EXPECT_TRUE(planner.untimed_sizes(plan).empty());
  EXPECT_NEAR(planner.evaluate(8, Precision::kFP32, CheckpointPlan::none(), int64_t{1} << 40).predicted_seconds -
                  plan.predicted_seconds,
              0.2 - 2 * 0.045, 1e-9);  // the measured point, not the guess
}

// A rival guessed a little slower than the chosen plan may be faster: sizes of plans predicted
// within kRivalSlack of it are timed too, and the plan follows the measurements.
TEST(PlanSearchTest, RivalsPredictedCloseToThePlanAreTimedToo) {
  WorkloadProfile w = hand_workload();
  // Guesses: 8 x 1 0.090, 4 x 2 0.088 (timed), 2 x 4 0.084 (timed), 1 x 8 0.084.
  w.precisions.front().chain_seconds = {{2, 0.021}, {4, 0.044}};
  Planner planner(w, hand_request());
  const Plan guessed = planner.plan(int64_t{1} << 40);
  ASSERT_EQ(guessed.config.micro_batch_size(), 2);
  std::vector<int64_t> timed;
  const auto timer = each_size([&](Precision, int64_t m) {
    timed.push_back(m);
    return m == 8 ? 0.06 : 0.2;  // the whole batch is the fastest; single samples the slowest

  });
  const Plan plan = plan_timing_as_needed(planner, int64_t{1} << 40, timer);
  std::sort(timed.begin(), timed.end());
  EXPECT_EQ(timed, (std::vector<int64_t>{1, 8}));
  EXPECT_EQ(plan.config.micro_batch_size(), 8);
  EXPECT_NEAR(plan.predicted_seconds, 0.06 + hand_request().optimizer.seconds, 1e-9);
}

// Above the timed sizes the guess is the line continued, the least certain: a rival there is
// timed when predicted within kExtrapolatedRivalSlack (25%), not only kRivalSlack (10%). Each
// precision's sizes are timed beside its smaller profiled size, the reference.
TEST(PlanSearchTest, RivalsAboveTheTimedSizesAreTimedWithinAWiderSlack) {
  WorkloadProfile w = hand_workload();
  // Guesses: 2 x 4 0.072 (timed), 1 x 8 0.072, 4 x 2 0.080 (timed), 8 x 1 0.084: 17% slower
  // than the plan, above the timed sizes.
  w.precisions.front().chain_seconds = {{2, 0.018}, {4, 0.040}};
  Planner planner(w, hand_request());
  ASSERT_NEAR(planner.evaluate(8, Precision::kFP32, CheckpointPlan::none(), int64_t{1} << 40).predicted_seconds,
              1.17 * planner.plan(int64_t{1} << 40).predicted_seconds, 0.01);
  std::vector<int64_t> timed;
  const auto timer = [&](Precision, const std::vector<int64_t>& sizes, const TimingReference& reference) {
    EXPECT_EQ(reference.precision, Precision::kFP32);
    EXPECT_EQ(reference.point.micro_batch, 2);  // hand_profile's smaller profiled size
    EXPECT_EQ(reference.point.seconds, 0.018);
    std::vector<double> out;
    for (int64_t m : sizes) {
      timed.push_back(m);
      out.push_back(m == 8 ? 0.06 : 0.2);  // the whole batch is the fastest
    }
    return out;
  };
  const Plan plan = plan_timing_as_needed(planner, int64_t{1} << 40, timer);
  std::sort(timed.begin(), timed.end());
  EXPECT_EQ(timed, (std::vector<int64_t>{1, 8}));
  EXPECT_EQ(plan.config.micro_batch_size(), 8);
}

// Only the precision whose blocks ran fastest is timed in the profile; another is guessed as
// the timed one's chain scaled by the blocks' ratio, and timed (its profiled sizes and the
// plan's, beside the timed precision's reference) only when its plans come close.
TEST(PlanSearchTest, APrecisionNotTimedIsGuessedFromItsBlocksAndTimedWhenItComesClose) {
  WorkloadProfile w = hand_workload();  // fp32 timed: 8 x 1 takes 0.09 s
  w.precisions.push_back(hand_profile(Precision::kBF16, 0.5));
  w.precisions.back().chain_seconds.clear();  // its blocks take half fp32's: guessed 0.045 s
  std::vector<std::pair<Precision, int64_t>> timed;
  const auto timer = [&](Precision precision, const std::vector<int64_t>& sizes, const TimingReference& reference) {
    EXPECT_EQ(reference.precision, Precision::kFP32);  // bf16 has no point of its own yet
    EXPECT_EQ(reference.point.micro_batch, 2);
    std::vector<double> out;
    for (int64_t m : sizes) {
      timed.emplace_back(precision, m);
      out.push_back(0.2 * static_cast<double>(m));  // measured: far slower than fp32
    }
    return out;
  };
  Planner planner(w, hand_request());
  const Plan guessed = planner.plan(int64_t{1} << 40);
  ASSERT_EQ(guessed.config.precision, Precision::kBF16);
  EXPECT_NEAR(guessed.predicted_seconds - hand_request().optimizer.seconds, 0.045, 1e-9);
  int count = 0;
  const Plan plan = plan_timing_as_needed(planner, int64_t{1} << 40, timer, &count);
  using P = std::pair<Precision, int64_t>;
  EXPECT_EQ(timed, (std::vector<P>{{Precision::kBF16, 2}, {Precision::kBF16, 4}, {Precision::kBF16, 8}}));
  EXPECT_EQ(count, 3);
  EXPECT_EQ(plan.config.precision, Precision::kFP32);
  // Blocks twice as slow as fp32's: guessed 0.18 s, no rival; never timed.
  WorkloadProfile slow = hand_workload();
  slow.precisions.push_back(hand_profile(Precision::kBF16, 2.0));
  slow.precisions.back().chain_seconds.clear();
  timed.clear();
  Planner fp32_wins(slow, hand_request());
  EXPECT_EQ(plan_timing_as_needed(fp32_wins, int64_t{1} << 40, timer).config.precision, Precision::kFP32);
  EXPECT_TRUE(timed.empty());
  // A profile with no precision timed cannot plan.
  slow.precisions.front().chain_seconds.clear();
  EXPECT_THROW(Planner(slow, hand_request()), c10::Error);
}

TEST(PlanSearchTest, FloorIsTheSmallestBudgetThatPlans) {
  const Planner planner(hand_workload(), hand_request());
  const int64_t floor = planner.floor_bytes();
  EXPECT_TRUE(planner.plan(floor + floor / 200).feasible);
  const Plan below = planner.plan(floor - floor / 50);
  EXPECT_FALSE(below.feasible);
  EXPECT_EQ(below.floor_bytes, floor);
  ASSERT_FALSE(below.notes.empty());
  EXPECT_NE(below.notes.back().find(std::to_string(floor)), std::string::npos);
}

TEST(PlanSearchTest, OptimizerStateIsCountedAsGiven) {
  PlanRequest light = hand_request();
  light.optimizer = {};  // plain SGD: no state, no temporaries
  const Planner adamw(hand_workload(), hand_request());
  const Planner sgd(hand_workload(), light);
  const Plan a = adamw.evaluate(8, Precision::kFP32, {}, int64_t{1} << 40);
  const Plan b = sgd.evaluate(8, Precision::kFP32, {}, int64_t{1} << 40);
  EXPECT_EQ(a.predicted_peak - b.predicted_peak, hand_request().optimizer.state_bytes);
  EXPECT_LT(sgd.floor_bytes(), adamw.floor_bytes());
}

TEST(PlanSearchTest, FasterMixedPrecisionIsChosenAndSaysWhy) {
  WorkloadProfile w = hand_workload();
  w.precisions.push_back(hand_profile(Precision::kBF16, 0.5));
  const Planner planner(w, hand_request());
  const Plan p = planner.plan(int64_t{1} << 40);
  ASSERT_TRUE(p.feasible);
  EXPECT_EQ(p.config.precision, Precision::kBF16);
  EXPECT_EQ(p.baseline_precision, Precision::kFP32);
  const bool said = std::any_of(p.notes.begin(), p.notes.end(),
                                [](const std::string& n) { return n.find("bf16 chosen") != std::string::npos; });
  EXPECT_TRUE(said);
}

TEST(PlanSearchTest, PinnedMicroBatchAndScheduleAreKept) {
  PlanRequest r = hand_request();
  r.step.micro_batch = 2;
  r.checkpoint = CheckpointPlan::of_blocks({1}, 4);
  const Planner planner(hand_workload(), r);
  const Plan p = planner.plan(int64_t{1} << 40);
  ASSERT_TRUE(p.feasible);
  EXPECT_EQ(p.config.micro_batch, 2);
  EXPECT_EQ(p.config.checkpoint.describe(), "1");
  EXPECT_TRUE(p.checkpoint_pinned);
}

TEST(PlanSearchTest, PlanJsonRoundTrips) {
  PlanRequest r = hand_request();
  r.checkpoint = CheckpointPlan::of_blocks({1, 2}, 4);
  const Planner planner(hand_workload(), r);
  const Plan p = planner.plan(int64_t{1} << 40);
  ASSERT_TRUE(p.feasible);
  const Plan back = plan_from_json(nlohmann::json::parse(plan_json(p).dump()), 4);
  EXPECT_EQ(plan_json(back), plan_json(p));
  EXPECT_EQ(back.config.checkpoint.segments, p.config.checkpoint.segments);
  EXPECT_EQ(back.config.micro_batch, p.config.micro_batch);
  // A config that does not fit the chain is refused on reading.
  EXPECT_THROW(plan_from_json(plan_json(p), 1), OptionError);
}

// The optimizer's state precision as a dimension (state auto): fp32 AdamW's cost as above, and
// an 8-bit state of about a quarter of its bytes whose step takes twice as long.
OptimizerCost eight_bit_cost(double seconds = 0.002) {
  OptimizerCost c;
  c.state = StatePrecision::k8Bit;
  c.state_bytes = 2 * (40000 + 4 * 20);  // one byte per value, an fp32 absmax per block, per moment
  c.step_bytes = 3 * 40000;
  c.seconds = seconds;
  return c;
}

PlanRequest auto_request(double eight_bit_seconds = 0.002) {
  PlanRequest r = hand_request();
  r.step.optimizer.state = StatePrecision::kAuto;
  r.optimizer.seconds = 0.001;
  r.optimizer_alternatives = {eight_bit_cost(eight_bit_seconds)};
  return r;
}

PlanRequest only(const OptimizerCost& cost) {
  PlanRequest r = hand_request();
  r.step.optimizer.state = cost.state;
  r.optimizer = cost;
  return r;
}

bool has_note(const Plan& p, const std::string& text) {
  return std::any_of(p.notes.begin(), p.notes.end(), [&](const std::string& n) { return n.find(text) != std::string::npos; });
}

TEST(PlanSearchTest, StateAutoKeepsFp32WhenItFitsAsFast) {
  const Planner planner(hand_workload(), auto_request());
  const Plan p = planner.plan(int64_t{1} << 40);
  ASSERT_TRUE(p.feasible);
  EXPECT_EQ(p.config.optimizer.state, StatePrecision::kFP32);
  EXPECT_TRUE(has_note(p, "optimizer state fp32 kept")) << plan_json(p).dump();
}

TEST(PlanSearchTest, StateAutoTakes8BitWhenItLetsAFasterPlanFit) {
  const Planner fp32(hand_workload(), only(auto_request().optimizer));
  const Planner q8(hand_workload(), only(eight_bit_cost()));
  // A budget the plain step fits with 8-bit state only.
  const int64_t p32 = fp32.evaluate(8, Precision::kFP32, {}, int64_t{1} << 40).predicted_peak;
  const int64_t p8 = q8.evaluate(8, Precision::kFP32, {}, int64_t{1} << 40).predicted_peak;
  ASSERT_LT(p8, p32);
  const auto budget = static_cast<int64_t>(static_cast<double>(p8 + p32) / 2 / 0.97);
  const Plan with32 = fp32.plan(budget), with8 = q8.plan(budget);
  ASSERT_TRUE(with32.feasible && with8.feasible);
  EXPECT_FALSE(with32.config.checkpoint.empty() && with32.config.micro_batch_size() == 8) << "fp32 must give something up";
  // With its slower optimizer step counted, 8-bit is still the faster plan here...
  ASSERT_LT(with8.predicted_seconds + 0.002, 0.99 * (with32.predicted_seconds + 0.001));
  const Plan p = Planner(hand_workload(), auto_request()).plan(budget);
  ASSERT_TRUE(p.feasible);
  EXPECT_EQ(p.config.optimizer.state, StatePrecision::k8Bit);
  EXPECT_EQ(p.config.micro_batch_size(), with8.config.micro_batch_size());
  EXPECT_EQ(p.config.checkpoint.segments, with8.config.checkpoint.segments);
  EXPECT_TRUE(has_note(p, "optimizer state 8bit chosen: its best plan is predicted")) << plan_json(p).dump();
  // ...but not when its step costs more than the recompute it saves: fp32 is kept.
  const Plan slow = Planner(hand_workload(), auto_request(1.0)).plan(budget);
  ASSERT_TRUE(slow.feasible);
  EXPECT_EQ(slow.config.optimizer.state, StatePrecision::kFP32);
  EXPECT_EQ(slow.config.checkpoint.segments, with32.config.checkpoint.segments);
  EXPECT_TRUE(has_note(slow, "optimizer state fp32 kept")) << plan_json(slow).dump();
  // The plan says which state it runs, through its JSON form too.
  const Plan back = plan_from_json(nlohmann::json::parse(plan_json(p).dump()), 4);
  EXPECT_EQ(back.config.optimizer.state, StatePrecision::k8Bit);
}

TEST(PlanSearchTest, StateAutoTakes8BitWhenNothingElseFitsAndLowersTheFloor) {
  const Planner fp32(hand_workload(), only(auto_request().optimizer));
  const Planner q8(hand_workload(), only(eight_bit_cost()));
  const Planner both(hand_workload(), auto_request(1.0));  // however slow its step
  EXPECT_LT(q8.floor_bytes(), fp32.floor_bytes());
  EXPECT_EQ(both.floor_bytes(), q8.floor_bytes());
  const int64_t budget = (q8.floor_bytes() + fp32.floor_bytes()) / 2;
  EXPECT_FALSE(fp32.plan(budget).feasible);
  const Plan p = both.plan(budget);
  ASSERT_TRUE(p.feasible);
  EXPECT_EQ(p.config.optimizer.state, StatePrecision::k8Bit);
  EXPECT_TRUE(has_note(p, "no plan with fp32 state fits")) << plan_json(p).dump();
  // A pinned state is never changed: 8bit asked, 8bit planned, even with room for fp32.
  const Plan pinned = q8.plan(int64_t{1} << 40);
  EXPECT_EQ(pinned.config.optimizer.state, StatePrecision::k8Bit);
}

TEST(PlanSearchTest, BatchMustMatchTheProfile) {
  PlanRequest r = hand_request();
  r.step.batch = 16;
  EXPECT_THROW(Planner(hand_workload(), r), OptionError);
}

// ZeRO 3 over 2 ranks: the weights and gradients held are the shards (half of each block),
// the state is measured on the shards, and each block's full weights come on top of its own
// forward, recompute and backward peaks only.
TEST(PlanSearchTest, Zero3CountsShardsAndOneGatheredBlockAtATime) {
  PlanRequest whole = hand_request();
  whole.checkpoint = CheckpointPlan::all(4);
  PlanRequest zero3 = whole;
  zero3.gathered_blocks.assign(4, GatheredBlockBytes{4 * 10000, 4 * 5000});
  zero3.gradient_bytes = 4 * 20000;
  zero3.optimizer.state_bytes = 2 * 4 * 20000;
  zero3.optimizer.step_bytes = 20000;
  const Planner one(hand_workload(), whole), sharded(hand_workload(), zero3);

  ChainCosts expected = one.costs_at(4);
  // Shards, their state, the batch, the step's two copies of the random state (5056 B each).
  expected.fixed_bytes = 4 * 20000 + 2 * 4 * 20000 + 8 * 100 + 2 * 5056;
  for (auto& b : expected.blocks) {
    b.forward_peak += 40000;
    b.forward_nograd_peak += 40000;
    b.backward_peak += 40000;
    b.backward_peak_accumulating = b.backward_peak;  // full gradients made afresh each micro-batch
    b.param_bytes = 20000;
  }
  const int64_t optimizer_peak = 4 * 20000 + 4 * 20000 + 2 * 4 * 20000 + 20000 + 8 * 100;
  const Plan p = sharded.evaluate(4, Precision::kFP32, CheckpointPlan::all(4), 10000000);
  EXPECT_EQ(p.predicted_peak,
            std::max(evaluate_schedule(expected, CheckpointPlan::all(4).segments).peak_bytes, optimizer_peak));
  EXPECT_LT(p.predicted_peak, one.evaluate(4, Precision::kFP32, CheckpointPlan::all(4), 10000000).predicted_peak);
  EXPECT_LT(sharded.floor_bytes(), one.floor_bytes());
}

// ZeRO 3 with prefetch: while a block runs, the gathers started by the last block gathered
// are in flight (forward: the next d blocks with parameters; backward: the previous d), and in
// backward, from depth 1, the last finished block's reduction (its full gradients and the N
// pieces its owner sums). Hand-worked for a chain whose block 1 has no parameters.
TEST(PlanSearchTest, Zero3PrefetchCountsTheBlocksInFlight) {
  PlanRequest r = hand_request();
  r.checkpoint = CheckpointPlan::all(4);
  r.gathered_blocks = {{40000, 20000, 40000}, {0, 0, 0}, {80000, 40000, 80000}, {120000, 60000, 120000}};
  r.gradient_bytes = 120000;
  const Planner planner(hand_workload(), r);
  const ChainCosts none = planner.costs_at(4);
  // Per block: {forward, backward} bytes in flight at depths 1 and 2.
  const std::vector<std::pair<int64_t, int64_t>> depth1 = {{80000, 160000}, {80000, 200000}, {120000, 280000}, {0, 80000}};
  const std::vector<std::pair<int64_t, int64_t>> depth2 = {{200000, 160000}, {200000, 200000}, {120000, 280000}, {0, 120000}};
  for (const auto& [depth, extra] : {std::make_pair(1, depth1), std::make_pair(2, depth2)}) {
    ChainCosts expected = none;
    for (size_t k = 0; k < expected.blocks.size(); ++k) {
      expected.blocks[k].forward_nograd_peak += extra[k].first;  // the forward pass
      expected.blocks[k].forward_peak += extra[k].second;        // the recompute, in backward
      expected.blocks[k].backward_peak += extra[k].second;
      expected.blocks[k].backward_peak_accumulating += extra[k].second;
    }
    const Plan p = planner.evaluate(4, Precision::kFP32, CheckpointPlan::all(4), int64_t{1} << 40, std::nullopt, depth);
    EXPECT_EQ(p.config.prefetch_depth, depth);
    EXPECT_EQ(p.predicted_peak, std::max(evaluate_schedule(expected, CheckpointPlan::all(4).segments).peak_bytes,
                                         planner.evaluate(4, Precision::kFP32, CheckpointPlan::all(4)).predicted_peak))
        << "depth " << depth;
  }
}

// With the whole batch in one micro-batch, the gradient of the shard whose reduction is in
// flight is made only after the running block's recompute and backward: not there yet, unlike
// in a later micro-batch (where the shard's gradient from the first one is).
TEST(PlanSearchTest, Zero3OneMicroBatchCountsNoShardGradientForTheReductionInFlight) {
  PlanRequest r = hand_request();
  r.checkpoint = CheckpointPlan::all(4);
  r.gathered_blocks = {{40000, 20000, 40000}, {0, 0, 0}, {80000, 40000, 80000}, {120000, 60000, 120000}};
  r.gradient_bytes = 120000;
  const Planner planner(hand_workload(), r);
  const ChainCosts none = planner.costs_at(8);
  ASSERT_FALSE(none.gradients_present);
  // Per block at depth 1: bytes in flight in forward and in backward, and the shard gradient
  // of the block whose reduction is in flight (the first with parameters after it).
  const std::vector<std::array<int64_t, 3>> depth1 = {
      {80000, 160000, 40000}, {80000, 200000, 40000}, {120000, 280000, 60000}, {0, 80000, 0}};
  ChainCosts expected = none, counting_the_shard = none;
  for (size_t k = 0; k < expected.blocks.size(); ++k) {
    const auto [forward, backward, shard] = depth1[k];
    for (ChainCosts* c : {&expected, &counting_the_shard}) {
      c->blocks[k].forward_nograd_peak += forward;
      c->blocks[k].forward_peak += backward;
      c->blocks[k].backward_peak += backward;
      c->blocks[k].backward_peak_accumulating += backward;
    }
    expected.blocks[k].forward_peak -= shard;
    expected.blocks[k].backward_peak -= shard;
  }
  const auto& segments = CheckpointPlan::all(4).segments;
  const int64_t peak = evaluate_schedule(expected, segments).peak_bytes;
  ASSERT_LT(peak, evaluate_schedule(counting_the_shard, segments).peak_bytes);  // the case matters here
  const Plan p = planner.evaluate(8, Precision::kFP32, CheckpointPlan::all(4), int64_t{1} << 40, std::nullopt, 1);
  EXPECT_EQ(p.predicted_peak, std::max(peak, planner.evaluate(8, Precision::kFP32, CheckpointPlan::all(4)).predicted_peak));
}

// The plan takes the first depth of the request's list that fits at its micro-batch: the
// deepest where memory allows, a shallower one (said in a note) where not.
TEST(PlanSearchTest, Zero3PlanTakesTheDeepestPrefetchThatFits) {
  PlanRequest r = hand_request();
  r.checkpoint = CheckpointPlan::all(4);
  r.step.micro_batch = 4;
  // Blocks whose weights outweigh their activations: each depth needs more.
  r.gathered_blocks.assign(4, GatheredBlockBytes{4000000, 2000000, 4000000});
  r.gradient_bytes = 8000000;
  r.prefetch_depths = {2, 1, 0};
  const Planner planner(hand_workload(), r);
  const auto need = [&](int depth) {
    const Plan p = planner.evaluate(4, Precision::kFP32, CheckpointPlan::all(4), int64_t{1} << 40, std::nullopt, depth);
    return static_cast<int64_t>(std::ceil(static_cast<double>(p.predicted_peak) / (1 - r.margin))) + 1;
  };
  ASSERT_LT(need(0), need(1));
  ASSERT_LT(need(1), need(2));
  EXPECT_EQ(planner.plan(need(2)).config.prefetch_depth, 2);
  const Plan one = planner.plan(need(1));
  EXPECT_EQ(one.config.prefetch_depth, 1);
  EXPECT_TRUE(std::any_of(one.notes.begin(), one.notes.end(), [](const std::string& n) { return n.rfind("prefetch depth 1", 0) == 0; }));
  EXPECT_EQ(planner.plan(need(0)).config.prefetch_depth, 0);
  EXPECT_EQ(planner.plan(need(0)).floor_bytes, planner.floor_bytes());
  EXPECT_FALSE(planner.plan(need(0) - 2).feasible);
}

}  // namespace
}  // namespace memfit

namespace memfit {
namespace {

// The profile cache's form (profile_cache.h): every measured number read back exactly, so the
// plan made from a cached profile is the plan made from the measured one.
TEST(PlanSearchTest, MeasuredCostsRoundTripThroughJsonExactly) {
  MeasuredCosts costs;
  costs.profile = hand_workload();
  costs.profile.precisions.push_back(hand_profile(Precision::kBF16, 0.6));
  costs.profile.precisions.back().small.blocks[1].cast_bytes = 12345;
  costs.profile.precisions.back().calibration = 1.0 / 3.0;  // no short decimal form
  costs.profile.notes = {"a note"};
  for (ChainProfile* c : {&costs.profile.precisions[0].small, &costs.profile.precisions[0].large}) {
    c->moments.resize(c->blocks.size());
    c->moments[1].backward = PeakMoments{0xfedcba9876543210ULL, {-5, c->micro_batch * 1000, 7}};  // (past int64)
  }
  OptimizerCost q8 = hand_request().optimizer;
  q8.state = StatePrecision::k8Bit;
  q8.seconds = 0.1 + 0.2;
  costs.optimizer = {hand_request().optimizer, q8};
  const MeasuredCosts back = measured_costs_from_json(nlohmann::json::parse(measured_costs_json(costs).dump()));
  EXPECT_EQ(measured_costs_json(back), measured_costs_json(costs));
  EXPECT_EQ(back.profile.precisions.back().calibration, 1.0 / 3.0);
  EXPECT_EQ(back.optimizer[1].seconds, 0.1 + 0.2);
  PlanRequest request = hand_request();
  request.optimizer_alternatives = {q8};
  for (int64_t budget : {600000, 900000, 2000000}) {
    request.budget_bytes = budget;
    EXPECT_EQ(plan_json(Planner(back.profile, request).plan()), plan_json(Planner(costs.profile, request).plan())) << budget;
  }
  nlohmann::json broken = measured_costs_json(costs);
  broken["profile"]["precisions"][0]["small"]["blocks"].erase(0);
  EXPECT_THROW(measured_costs_from_json(broken), std::invalid_argument) << "a block missing";
}

// A run's moments: the bytes at its start and where each run of allocations ends, kept only
// where the highest of them is the run's measured peak (one that only frees peaks at its start).
TEST(PeakMomentsTest, AMomentIsWhereARunOfAllocationsEnds) {
  const auto event = [](int64_t delta, int64_t live) { return MemoryEvent{0, nullptr, delta, live, Phase::kOther, 0, MemoryDevice::kCPU}; };
  // From 100 live: +50 +20 -50 +30 -20 -30 +10 (the last run ends the events).
  const std::vector<MemoryEvent> events{event(50, 150), event(20, 170), event(-50, 120), event(30, 150),
                                        event(-20, 130), event(-30, 100), event(10, 110)};
  const PeakMoments m = peak_moments(events, 0, events.size(), MemoryDevice::kCPU, 100, 100, 70);
  ASSERT_TRUE(m.usable());
  EXPECT_EQ(m.bytes, (std::vector<int64_t>{0, 70, 50, 10}));  // the start, then each run's end
  EXPECT_FALSE(peak_moments(events, 0, events.size(), MemoryDevice::kCPU, 100, 100, 80).usable()) << "a peak the events do not reach";
  const std::vector<MemoryEvent> frees{event(-50, 50), event(20, 70)};
  EXPECT_EQ(peak_moments(frees, 0, frees.size(), MemoryDevice::kCPU, 100, 100, 0).bytes, (std::vector<int64_t>{0, -30}));
  // The same sizes in another order of allocations and frees: another pattern.
  const std::vector<MemoryEvent> reordered{event(50, 150), event(20, 170), event(30, 200), event(-50, 150),
                                           event(-20, 130), event(-30, 100), event(10, 110)};
  const PeakMoments r = peak_moments(reordered, 0, reordered.size(), MemoryDevice::kCPU, 100, 100, 100);
  ASSERT_TRUE(r.usable());
  EXPECT_NE(r.pattern, m.pattern);
}

// Two moments crossing: one falling per sample (activations freed before it), one growing.
// At 2 samples the first is the peak, at 4 the second; the highest of their lines is below
// the line through the two peaks between them and above it outside.
TEST(PeakMomentsTest, ThePeakElsewhereIsTheHighestOfTheMomentsLines) {
  const PeakMoments at2{42, {1200, 900}}, at4{42, {1100, 1300}};
  EXPECT_EQ(highest_moment(at2, 2, at4, 4, 8), 2100);  // the secant: 1500
  EXPECT_EQ(highest_moment(at2, 2, at4, 4, 3), 1150);  // the secant: 1250
  EXPECT_EQ(highest_moment(at2, 2, at4, 4, 1), 1250);  // the secant: 1150
  EXPECT_FALSE(highest_moment(at2, 2, PeakMoments{43, {1100, 1300}}, 4, 8)) << "another order of allocations";
  EXPECT_FALSE(highest_moment(at2, 2, PeakMoments{42, {1100}}, 4, 8));
  EXPECT_FALSE(highest_moment(PeakMoments{}, 2, PeakMoments{}, 4, 8)) << "not recorded";

  // The block's costs take them where both profiled sizes have them, the secant elsewhere.
  PrecisionProfile p = hand_profile(Precision::kFP32, 1.0);
  const int64_t secant = block_costs_at(p, 8).blocks[1].backward_peak;
  p.small.moments.resize(4);
  p.large.moments.resize(4);
  p.small.moments[1].backward = PeakMoments{42, {p.small.blocks[1].backward_peak, 100000}};
  p.large.moments[1].backward = PeakMoments{42, {p.large.blocks[1].backward_peak, 800000}};
  EXPECT_EQ(block_costs_at(p, 8).blocks[1].backward_peak, 800000 + 4 * 350000);
  EXPECT_EQ(block_costs_at(p, 8).blocks[0].backward_peak, block_costs_at(hand_profile(Precision::kFP32, 1.0), 8).blocks[0].backward_peak);
  p.large.moments[1].backward.pattern = 43;
  EXPECT_EQ(block_costs_at(p, 8).blocks[1].backward_peak, secant);
}

}  // namespace
}  // namespace memfit
