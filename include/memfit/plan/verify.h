// verify.h — a plan checked by running it: real steps of the workload with the plan's step
// configuration under the hard budget and the tracker (`memfit plan`, the tests, benches).
//
// On the CPU the budget is the BudgetAllocator's. On CUDA it is the device's: the steps run
// under a memory fraction capping the caching allocator's reserved bytes at the budget less the
// memory outside the allocator (PlanRequest::outside_bytes), and a step that ran out of memory
// or made the allocator free its cache and retry is planned again with the reserved/allocated
// relation the recorded steps gave.
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "memfit/measure/cuda_budget.h"
#include "memfit/measure/cuda_reserved.h"
#include "memfit/measure/memory_tracker.h"
#include "memfit/plan/planner.h"
#include "memfit/runtime/workload.h"

namespace memfit {

struct Verification {
  int64_t measured_peak = 0;  // tracker peak + the request's resident bytes (0: it ran out of memory)
  double measured_seconds = 0;
  double plain_seconds = 0;   // the plain step of the whole batch, measured without a budget
  int attempts = 1;
  int steps = 3;
  std::vector<std::string> notes;
  // The verified steps replayed on the CUDA caching allocator model, under the memory fraction's
  // cap when on CUDA: what they would reserve (on the CPU: a prediction for a GPU).
  CudaReservedPrediction cuda;
  // On CUDA: the allocator's own counters over the verified steps, and the fraction's cap.
  bool on_cuda = false;
  CudaAllocatorCounters cuda_measured;
  int64_t cuda_limit_bytes = 0;
};

// `steps` real steps (>= 2; the optimizer of plan.config) on the workload's first batch; all
// but the first, in steady state, are measured. If the budget does not hold (the peak passed
// it; on CUDA, also an allocator retry), plans again tighter (up to 3 attempts) and updates `plan`.
// `batch`: that first batch where the caller holds it (the one it profiled), so that the steps
// run with one batch alive as training does; nullptr: made here.
Verification verify_plan(Workload& workload, const Planner& planner, Plan& plan, MemoryTracker& tracker,
                         bool measure_plain, int steps = 3, const Batch* batch = nullptr);

// plan_json(plan) with the measurements added ("measured", "verify_attempts", notes, the CUDA
// prediction's fields, and on CUDA "measured"."cuda").
nlohmann::json verified_plan_json(const Plan& plan, const Verification& verification);

}  // namespace memfit
