// explain.h — the plan's notes, said plainly: why its precision, its optimizer state and the
// optimizer's placement, against the best rival plans the search compared; what it offloads or
// prefetches less deeply; and, when nothing fits, the smallest budget that works. Private to
// src/plan/ (planner.h).
#pragma once

#include <cstdint>
#include <vector>

#include "memfit/plan/plan.h"
#include "memfit/plan/plan_request.h"
#include "memfit/plan/profile.h"
#include "plan/step_costs.h"

namespace memfit {

// `chosen` against the best plan of each precision (`best_of`, in the profile's order).
void explain_choice(Plan& chosen, const std::vector<Plan>& best_of, const WorkloadProfile& profile);
// `chosen` against the best plan with each optimizer state at its placement (`best_with`, in
// the order of costs.optimizer_candidates); `budget` the plan's.
void explain_state_choice(Plan& chosen, const std::vector<Plan>& best_with, int64_t budget, const StepCosts& costs);
// `chosen` against the best plan at each placement of the optimizer (`best_placed`, in the
// order of PlanRequest::optimizer_offload).
void explain_placement(Plan& chosen, const std::vector<Plan>& best_placed, const PlanRequest& request);
// What the chosen plan offloads of the activations, and a prefetch depth shallower than preferred.
void explain_offload_and_prefetch(Plan& chosen, const PlanRequest& request);
// No plan fits `budget`: the floor, and a host budget too small for offloading the optimizer.
void explain_nothing_fits(Plan& plan, int64_t budget, const PlanRequest& request, const StepCosts& costs);

}  // namespace memfit
