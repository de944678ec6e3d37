// verify.h — a plan checked by running it: real steps of the workload with the plan's step
// configuration under the hard budget and the tracker (`memfit plan`, the tests, benches).
#pragma once

#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "memfit/measure/memory_tracker.h"
#include "memfit/plan/planner.h"
#include "memfit/runtime/workload.h"

namespace memfit {

struct Verification {
  int64_t measured_peak = 0;  // tracker peak + the request's resident bytes (0: it ran out of memory)
  double measured_seconds = 0;
  double plain_seconds = 0;   // the plain step of the whole batch, measured without a budget
  int attempts = 1;
  std::vector<std::string> notes;
};

// Three real steps (the optimizer of plan.config) on the workload's first batch; the last two,
// in steady state, are measured. If the measured peak exceeds the budget, plans again 5%
// tighter (up to 3 attempts) and updates `plan`. `batch`: that first batch where the caller
// holds it (the one it profiled), so that the steps run with one batch alive as training
// does; nullptr: made here.
Verification verify_plan(Workload& workload, const Planner& planner, Plan& plan, MemoryTracker& tracker,
                         bool measure_plain, const Batch* batch = nullptr);

// plan_json(plan) with the measurements added ("measured", "verify_attempts", notes).
nlohmann::json verified_plan_json(const Plan& plan, const Verification& verification);

}  // namespace memfit
