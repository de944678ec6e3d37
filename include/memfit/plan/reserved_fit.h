// reserved_fit.h — on CUDA a plan is judged by the bytes the caching allocator reserves under
// the budget's cap, not by the bytes its tensors take.
//
// The planner predicts allocated bytes and asks them to fit (budget - outside memory) x
// (1 - margin) / reserved_per_allocated. Whether the allocator then holds the step under its
// cap depends on how its segments fill: the optimizer's state made in the first step among the
// activations it frees, cuBLAS's workspaces, rounding. So before a CUDA plan runs, its steps are
// recorded (the first making the optimizer's state, then steady steps) and replayed on the
// caching allocator model (cuda_reserved.h) with cuBLAS's workspace per thread in it: the plan
// holds when the reserved peak stays within the cap less the margin (the margin is a share of
// the cap, in reserved bytes) and the replay under the cap frees no cache to retry. Otherwise
// the planner's relation is raised to what the replay showed and it plans again: the relation
// only grows, so every new plan is tighter than the last, never the untightened request again.
//
//   memfit::ReservedFitOptions o;  o.allocator = memfit::cuda_prediction_options_from_env();
//   memfit::Plan plan = memfit::fit_reserved(planner, planner.plan(), device, record_steps, o, replan);
//   plan.reserved.held();
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "memfit/measure/cuda_reserved.h"
#include "memfit/plan/planner.h"

namespace memfit {

struct ReservedFitOptions {
  CudaPredictionOptions allocator;  // the rules and PYTORCH_CUDA_ALLOC_CONF of the LibTorch in use
  int steps = 3;                    // steps recorded: the first makes the optimizer's state
  int attempts = 4;                 // plans recorded at most
};

// The plan for a budget from the planner as it is now (job.h: plan_timing_as_needed, timing
// the sizes it guessed).
using Replan = std::function<Plan(int64_t budget_bytes)>;

// The allocations of `steps` real steps of a configuration with a fresh optimizer, and on CUDA
// what the allocator held when they started (cuda_reserved.h: reserved_at_start; -1 elsewhere).
struct RecordedSteps {
  AllocationTrace trace;
  int64_t reserved_at_start = -1, allocated_at_start = -1;
  bool out_of_memory = false;  // the steps ran out of the device's memory (the trace stops there)
};
using StepRecorder = std::function<RecordedSteps(const StepConfig& config, int steps)>;

// The check of one recorded run of `plan` against its budget: the trace replayed on `device`'s
// counts without a cap (the peak) and under the cap (retries, out-of-memory errors), with
// `allocator.workspaces` placed first.
ReservedCheck check_reserved(const RecordedSteps& run, MemoryDevice device, const Plan& plan,
                             const PlanRequest& request, const ReservedFitOptions& options);

// `plan` checked, and while its check does not hold, the planner's relation raised to the
// replay's (at least 1% more each time) and a new plan made (`replan`) and checked, up to
// options.attempts plans. Returns the last plan, its check in Plan::reserved (held or not), a
// note where it planned again. An infeasible plan is returned as it is.
Plan fit_reserved(Planner& planner, Plan plan, MemoryDevice device, const StepRecorder& record,
                  const ReservedFitOptions& options, const Replan& replan);

}  // namespace memfit
