// The planner's search on costs written by hand (plan_hand_costs.h): no model runs, so every
// expectation follows from the numbers. The plan against every schedule and size, the sizes the
// time model guessed timed before a plan runs them, the floor, precision, pinned parts, and the
// optimizer's state precision as a dimension.
#include <gtest/gtest.h>

#include <algorithm>
#include <functional>

#include "memfit/memfit.h"
#include "plan_hand_costs.h"

namespace memfit {
namespace {

using test::hand_profile;
using test::hand_request;
using test::hand_workload;

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

// A model that could not train on one sample (BatchNorm on one value per channel) is never
// planned at one: its floor is the floor of two samples per micro-batch.
TEST(PlanSearchTest, NoMicroBatchUnderTheFewestSamplesTheProfileTrainedOn) {
  WorkloadProfile two = hand_workload();
  two.precisions.front().fewest_samples = 2;
  const Planner any(hand_workload(), hand_request());
  const Planner at_least_two(two, hand_request());
  const auto just_over = [](int64_t floor) { return floor + floor / 200; };
  const Plan at_floor = any.plan(just_over(any.floor_bytes()));
  ASSERT_TRUE(at_floor.feasible);
  ASSERT_EQ(at_floor.config.micro_batch, 1);  // one sample is what the smallest budget takes
  EXPECT_GT(at_least_two.floor_bytes(), any.floor_bytes());
  const Plan p = at_least_two.plan(just_over(at_least_two.floor_bytes()));
  ASSERT_TRUE(p.feasible);
  EXPECT_EQ(p.config.micro_batch, 2);
  EXPECT_FALSE(at_least_two.plan(just_over(any.floor_bytes())).feasible);
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

}  // namespace
}  // namespace memfit
