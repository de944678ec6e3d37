// On CUDA a plan is judged by what the caching allocator reserves under the budget's cap
// (plan/reserved_fit.h). These tests run that judgement on the CPU: hand-made traces whose
// replay is worked out below, the tightening loop on costs written by hand, and a GPT's plan
// recorded and replayed as if on a GPU, with cuBLAS's workspaces in it.
#include "test_util.h"

#include <cmath>

namespace memfit {
namespace {

constexpr int64_t kMiB = int64_t{1} << 20;

MemoryEvent event(const void* ptr, int64_t delta) { return {0, ptr, delta, 0, Phase::kOther, kNoBlock, MemoryDevice::kCPU}; }
const void* at(int k) { return reinterpret_cast<const void*>(static_cast<uintptr_t>(4096 * k)); }

TEST(ReservedFitTest, CublasWorkspaceAsLibTorchSizesIt) {
  unsetenv("CUBLAS_WORKSPACE_CONFIG");
  EXPECT_EQ(cublas_workspace_bytes(8), 4096 * 1024 * 2 + 16 * 1024 * 8) << ":4096:2:16:8 before Hopper";
  EXPECT_EQ(cublas_workspace_bytes(9), 32 * kMiB) << "Hopper";
  EXPECT_EQ(training_workspaces(8).size(), 2u) << "the caller's thread and autograd's";
  setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8", 1);
  EXPECT_EQ(cublas_workspace_bytes(9), 16 * 1024 * 8);
  unsetenv("CUBLAS_WORKSPACE_CONFIG");
}

// Two 15 MiB blocks (each a 16 MiB segment: from 10 MiB a request gets its own, rounded to
// 2 MiB), the first freed, then 20 MiB (which the cached 16 MiB cannot serve): 52 MiB reserved
// without a cap. Under a 40 MiB cap the allocator frees the cached segment and retries once.
TEST(ReservedFitTest, CheckReplaysWithoutAndUnderTheCap) {
  RecordedSteps run;
  run.trace.events = {event(at(1), 15 * kMiB), event(at(2), 15 * kMiB), event(at(1), -15 * kMiB),
                      event(at(3), 20 * kMiB)};
  ReservedFitOptions o;
  o.allocator.rules = CudaAllocatorRules::k2;
  PlanRequest request;
  request.margin = 0.03;
  Plan plan;
  plan.budget_bytes = 40 * kMiB;
  ReservedCheck c = check_reserved(run, MemoryDevice::kCPU, plan, request, o);
  EXPECT_EQ(c.peak_reserved, 52 * kMiB);
  EXPECT_EQ(c.cap_bytes, 40 * kMiB);
  EXPECT_EQ(c.num_alloc_retries, 1);
  EXPECT_EQ(c.num_ooms, 0);
  EXPECT_FALSE(c.held());

  request.outside_bytes = 4 * kMiB;  // the context: the cap is what the budget leaves
  plan.budget_bytes = 64 * kMiB;
  c = check_reserved(run, MemoryDevice::kCPU, plan, request, o);
  EXPECT_EQ(c.cap_bytes, 60 * kMiB);
  EXPECT_EQ(c.margin_bytes, static_cast<int64_t>(60 * kMiB * 0.03));
  EXPECT_EQ(c.num_alloc_retries, 0);
  EXPECT_TRUE(c.held()) << "52 MiB within 60 MiB less 3%";

  o.allocator.workspaces = {8 * kMiB};  // a workspace the trace lacks: 20 MiB segment of its own
  c = check_reserved(run, MemoryDevice::kCPU, plan, request, o);
  EXPECT_EQ(c.workspace_bytes, 8 * kMiB);
  EXPECT_EQ(c.peak_reserved, 72 * kMiB);
  EXPECT_FALSE(c.held());
  const nlohmann::json j = reserved_check_json(c);
  EXPECT_EQ(reserved_check_json(reserved_check_from_json(j)), j) << "one JSON form, read back";
}

// A hand-written chain whose every step reserves 1.4x what the planner predicts (one block of
// that size, MiB-aligned above 10 MiB: a segment of exactly its size). The loop raises the
// relation each time, each plan is tighter than the last, and the last holds.
TEST(ReservedFitTest, FitTightensUntilTheReplayHolds) {
  WorkloadProfile w;
  w.batch = 16;
  w.weight_bytes = 16 * kMiB;
  PrecisionProfile p;
  for (int64_t m : {4, 8}) {
    ChainProfile& cp = m == 4 ? p.small : p.large;
    cp.micro_batch = m;
    for (int k = 0; k < 4; ++k) {
      BlockCost c;
      c.output_bytes = m * kMiB / 2;
      c.output_kept = true;
      c.kept_bytes = 4 * m * kMiB;
      c.forward_peak = c.kept_bytes;
      c.forward_nograd_peak = c.output_bytes;
      c.backward_peak = c.kept_bytes + 4 * kMiB;
      c.backward_peak_accumulating = c.kept_bytes;
      c.param_bytes = 4 * kMiB;
      c.forward_seconds = 0.001 * static_cast<double>(m);
      c.backward_seconds = 2 * c.forward_seconds;
      cp.blocks.push_back(c);
    }
  }
  p.chain_seconds = {{1, 0.02}, {2, 0.03}, {4, 0.05}, {8, 0.09}, {16, 0.17}};
  w.precisions.push_back(p);
  PlanRequest r;
  r.step.batch = 16;
  r.optimizer.state_bytes = 32 * kMiB;
  Planner planner(w, r);
  // A budget the first plan just fits: its allocated peak is all the margin leaves.
  const int64_t plain = planner.evaluate(16, Precision::kFP32, CheckpointPlan::none()).predicted_peak;
  const Plan first = planner.plan(static_cast<int64_t>(0.9 * static_cast<double>(plain)));
  const auto budget = static_cast<int64_t>(std::ceil(static_cast<double>(first.predicted_peak) / (1.0 - r.margin))) + 1;

  std::vector<int64_t> peaks;
  std::vector<double> relations;
  const StepRecorder record = [&](const StepConfig& c, int) {
    const Plan e = planner.evaluate(c.micro_batch_size(), c.precision, c.checkpoint, budget);
    peaks.push_back(e.predicted_peak);
    relations.push_back(planner.request().reserved_per_allocated);
    const int64_t bytes = (static_cast<int64_t>(1.4 * static_cast<double>(e.predicted_peak)) / kMiB + 1) * kMiB;
    RecordedSteps run;
    run.trace.events = {event(at(1), bytes), event(at(1), -bytes)};
    return run;
  };
  ReservedFitOptions o;
  o.attempts = 8;
  const Replan replan = [&](int64_t b) { return planner.plan(b); };
  const Plan fitted = fit_reserved(planner, planner.plan(budget), MemoryDevice::kCPU, record, o, replan);
  ASSERT_TRUE(fitted.feasible);
  EXPECT_TRUE(fitted.reserved.held()) << reserved_check_json(fitted.reserved).dump();
  EXPECT_EQ(fitted.reserved.num_alloc_retries, 0);
  ASSERT_GE(peaks.size(), 2u) << "the first plan (1.4x over) cannot hold";
  EXPECT_EQ(fitted.reserved.attempts, static_cast<int>(peaks.size()));
  for (size_t i = 1; i < peaks.size(); ++i) {
    EXPECT_LT(peaks[i], peaks[i - 1]) << "each plan tighter than the last";
    EXPECT_GT(relations[i], relations[i - 1]) << "the relation only grows";
  }
  EXPECT_GE(planner.request().reserved_per_allocated, 1.39);
  EXPECT_LE(fitted.reserved.peak_reserved, fitted.reserved.cap_bytes - fitted.reserved.margin_bytes);
}

// The replay-under-cap check at the planned budget: a GPT planned on this CPU for a GPU (its
// steps recorded, cuBLAS's two workspaces placed) at 60% of what its plain step reserves; the
// plan then runs again, recorded afresh, and replays under the cap with no retry.
TEST(ReservedFitTest, GptPlanHoldsUnderTheCapWithNoRetry) {
  test::use_memfit_allocator();
  Workload w = make_workload(test::small_gpt(7));
  auto tracker = std::make_shared<MemoryTracker>();
  TrackerScope scope(tracker);
  adopt_tensors(*tracker, w.chain->parameters());
  const Batch data = w.data->train_batch(0, 16, w.seed);
  ReservedFitOptions fit;
  fit.allocator = cuda_prediction_options_from_env();
  fit.allocator.workspaces = training_workspaces(8);
  PlanJobOptions o;
  o.precisions = {Precision::kFP32};
  o.request.step.batch = 16;
  o.reserved_fit = fit;
  PlanJob job(w, [&data] { return data; }, o, *tracker);
  const Plan plain = job.planner().evaluate(16, Precision::kFP32, CheckpointPlan::none());
  const int64_t plain_reserved =
      check_reserved(job.record_steps(plain.config, 3), test::cpu_counted(), plain, job.planner().request(), fit).peak_reserved;
  // 60% of what the step itself reserves, beside the workspaces (20 MiB of a small model's ~50).
  const int64_t workspaces = 2 * cublas_workspace_bytes(8);
  const int64_t budget = workspaces + static_cast<int64_t>(0.6 * static_cast<double>(plain_reserved - workspaces));

  const Plan plan = job.plan(budget);
  ASSERT_TRUE(plan.feasible) << plan.notes.back();
  EXPECT_TRUE(plan.reserved.checked());
  EXPECT_TRUE(plan.reserved.held()) << reserved_check_json(plan.reserved).dump();
  EXPECT_EQ(plan.reserved.workspace_bytes, 2 * cublas_workspace_bytes(8));
  const ReservedCheck again = check_reserved(job.record_steps(plan.config, 3), test::cpu_counted(), plan, job.planner().request(), fit);
  EXPECT_EQ(again.num_alloc_retries, 0);
  EXPECT_EQ(again.num_ooms, 0);
  EXPECT_LE(again.peak_reserved, again.cap_bytes);
  EXPECT_EQ(plan_from_json(plan_json(plan), w.chain->size()).reserved.peak_reserved, plan.reserved.peak_reserved);
}

}  // namespace
}  // namespace memfit
