// The planner's cost model on costs written by hand (plan_hand_costs.h): ZeRO 3's shards,
// gathered blocks and the prefetch in flight; peak moments; the measured costs' JSON form;
// batches of other lengths (batch_shape.h).
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>

#include "memfit/memfit.h"
#include "plan_hand_costs.h"

namespace memfit {
namespace {

using test::hand_profile;
using test::hand_request;
using test::hand_workload;

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

// The hand profile at sequence length L: each block keeps, per sample, 100 L + L^2 bytes (its
// activations and attention-like scores) on top of the hand costs' per-sample bytes.
PrecisionProfile hand_profile_at(int64_t length) {
  PrecisionProfile p = hand_profile(Precision::kFP32, 1.0);
  const int64_t per_sample = 100 * length + length * length;
  for (ChainProfile* c : {&p.small, &p.large}) {
    for (BlockCost& b : c->blocks) {
      b.kept_bytes += per_sample * c->micro_batch;
      b.forward_peak += per_sample * c->micro_batch;
      b.backward_peak += per_sample * c->micro_batch;
      b.backward_peak_accumulating += per_sample * c->micro_batch;
    }
  }
  return p;
}

std::vector<LengthProfile> shorter_lengths(int64_t length) {
  std::vector<LengthProfile> out;
  for (int64_t l : lengths_to_profile(length)) out.push_back({l, hand_profile_at(l)});
  return out;
}

// Costs quadratic in the length are found exactly at lengths between and beyond the measured ones.
TEST(BatchShapeTest, CostsAtALengthFollowTheQuadraticThroughThreeLengths) {
  std::vector<LengthProfile> measured = shorter_lengths(64);
  measured.push_back({64, hand_profile_at(64)});
  for (int64_t length : {24, 48, 100, 200}) {
    const PrecisionProfile fitted = profile_at_length(measured, length), expected = hand_profile_at(length);
    for (size_t i = 0; i < expected.large.blocks.size(); ++i) {
      EXPECT_EQ(fitted.large.blocks[i].kept_bytes, expected.large.blocks[i].kept_bytes) << length;
      EXPECT_EQ(fitted.small.blocks[i].backward_peak, expected.small.blocks[i].backward_peak) << length;
      EXPECT_EQ(fitted.large.blocks[i].output_bytes, expected.large.blocks[i].output_bytes) << length;
    }
  }
}

// Each batch shape gets the plan the Planner makes on the costs at its length: the planned
// shape the plan itself; a longer batch fewer samples per micro-batch (or more recompute) under
// the same budget; beyond the longest, none.
TEST(BatchShapeTest, EachShapeIsPlannedFromItsCostsUnderTheBudget) {
  WorkloadProfile at64 = hand_workload();
  at64.precisions = {hand_profile_at(64)};
  const Planner planner(at64, hand_request());
  const int64_t budget = planner.plan(int64_t{1} << 40).plain_predicted_peak * 6 / 10;
  const Plan plan = planner.plan(budget);
  ASSERT_TRUE(plan.feasible);
  ShapePlanner shapes(planner, plan, 64, shorter_lengths(64));

  const Plan& same = shapes.choose(8, 64);
  EXPECT_EQ(same.config.micro_batch_size(), plan.config.micro_batch_size());
  EXPECT_EQ(same.config.checkpoint.segments, plan.config.checkpoint.segments);
  EXPECT_EQ(same.predicted_peak, plan.predicted_peak);

  WorkloadProfile at128 = at64;
  at128.precisions = {hand_profile_at(128)};
  at128.batch_bytes = at64.batch_bytes * 2;
  const Plan expected = Planner(at128, hand_request()).plan(budget);
  const Plan& longer = shapes.choose(8, 128);
  ASSERT_TRUE(longer.feasible);
  EXPECT_EQ(longer.predicted_peak, expected.predicted_peak);
  EXPECT_EQ(longer.config.micro_batch_size(), expected.config.micro_batch_size());
  EXPECT_LE(longer.predicted_peak, budget);
  EXPECT_TRUE(longer.config.micro_batch_size() < plan.config.micro_batch_size() ||
              longer.config.checkpoint.segments.size() > plan.config.checkpoint.segments.size());
  // Any configuration of that shape is predicted from the same costs.
  const CheckpointPlan every_other{{{1, 1}, {3, 3}}};
  EXPECT_EQ(shapes.evaluate(8, 128, 2, every_other).predicted_peak,
            Planner(at128, hand_request()).evaluate(2, Precision::kFP32, every_other, budget).predicted_peak);

  const int64_t longest = shapes.longest(8);
  ASSERT_GT(longest, 128);
  EXPECT_TRUE(shapes.choose(8, longest).feasible);
  EXPECT_FALSE(shapes.choose(8, longest + 1).feasible);
  EXPECT_TRUE(shapes.choose(3, 64).feasible);  // a short last batch
}

}  // namespace
}  // namespace memfit
