// The planner on the reference models: at 90/70/50/35% of the plain step's measured peak the
// verified peak stays under the budget and the prediction is within 5% of the measurement.
#include "test_util.h"

namespace memfit {
namespace {

void check_budgets(ModelOptions model, int64_t batch) {
  test::use_memfit_allocator();
  auto tracker = std::make_shared<MemoryTracker>();
  TrackerScope scope(tracker);
  Workload w = make_workload(model);
  const Batch data = w.data->train_batch(0, batch, 0);
  // The plain step's measured peak (steady state).
  int64_t plain_peak = 0;
  {
    torch::optim::AdamW optimizer(w.chain->parameters(), torch::optim::AdamWOptions(1e-3));
    for (int step = 0; step < 2; ++step) {
      tracker->reset_peak();
      train_step(w, optimizer, data, StepOptions{});
      plain_peak = tracker->peak();
    }
  }
  PlanRequest request;
  request.batch = batch;
  Planner planner(w, data, request, *tracker);
  int verified = 0;
  for (int percent : {90, 70, 50, 35}) {
    const int64_t budget = plain_peak * percent / 100;
    Plan plan = planner.plan(budget);
    if (!plan.feasible) {
      EXPECT_GT(plan.floor_bytes, budget) << percent << "%";
      continue;
    }
    Verification v = verify_plan(w, planner, plan, *tracker, batch, /*measure_plain=*/false);
    EXPECT_LE(v.measured_peak, budget) << percent << "%";
    const double error = std::abs(static_cast<double>(plan.predicted_peak - v.measured_peak)) /
                         static_cast<double>(v.measured_peak);
    EXPECT_LE(error, 0.05) << percent << "%: predicted " << plan.predicted_peak << " measured " << v.measured_peak;
    ::testing::Test::RecordProperty("error_" + std::to_string(percent), std::to_string(error));
    ++verified;
  }
  EXPECT_GE(verified, 2);
}

TEST(PlannerTest, GptBudgetsHoldAndPredictionsAreClose) {
  ModelOptions m = test::small_gpt();
  m.gpt.layers = 8;  // 18 blocks
  m.gpt.d_model = 128;
  check_budgets(m, 8);
}

TEST(PlannerTest, CnnBudgetsHoldAndPredictionsAreClose) {
  ModelOptions m;
  m.model = "cnn";
  m.cnn.blocks = 6;
  m.cnn.channels = 16;
  check_budgets(m, 16);
}

TEST(PlannerTest, BelowTheFloorIsInfeasibleAndSaysTheFloor) {
  test::use_memfit_allocator();
  auto tracker = std::make_shared<MemoryTracker>();
  TrackerScope scope(tracker);
  Workload w = make_workload(test::small_gpt());
  const Batch data = w.data->train_batch(0, 8, 0);
  PlanRequest request;
  request.batch = 8;
  Planner planner(w, data, request, *tracker);
  Plan p = planner.plan(1 << 20);
  EXPECT_FALSE(p.feasible);
  EXPECT_GT(p.floor_bytes, 1 << 20);
  Plan at_floor = planner.plan(p.floor_bytes + (p.floor_bytes / 100));
  EXPECT_TRUE(at_floor.feasible);
}

}  // namespace
}  // namespace memfit
