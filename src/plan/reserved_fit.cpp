#include "memfit/plan/reserved_fit.h"

#include <algorithm>
#include <cstdio>

#include "memfit/measure/size.h"
#include "runtime/json_fields.h"

namespace memfit {

nlohmann::json reserved_check_json(const ReservedCheck& c) {
  return {{"steps", c.steps},
          {"cap_bytes", c.cap_bytes},
          {"margin_bytes", c.margin_bytes},
          {"peak_reserved_bytes", c.peak_reserved},
          {"peak_allocated_bytes", c.peak_allocated},
          {"workspace_bytes", c.workspace_bytes},
          {"num_alloc_retries", c.num_alloc_retries},
          {"num_ooms", c.num_ooms},
          {"reserved_per_allocated", c.reserved_per_allocated},
          {"attempts", c.attempts},
          {"held", c.held()}};
}

ReservedCheck reserved_check_from_json(const nlohmann::json& j) {
  namespace jf = json_fields;
  ReservedCheck c;
  c.steps = static_cast<int>(jf::integer(j, "steps", 0, 1000));
  c.cap_bytes = jf::integer(j, "cap_bytes");
  c.margin_bytes = jf::integer(j, "margin_bytes");
  c.peak_reserved = jf::integer(j, "peak_reserved_bytes");
  c.peak_allocated = jf::integer(j, "peak_allocated_bytes");
  c.workspace_bytes = jf::integer(j, "workspace_bytes");
  c.num_alloc_retries = jf::integer(j, "num_alloc_retries");
  c.num_ooms = jf::integer(j, "num_ooms");
  c.reserved_per_allocated = jf::number(j, "reserved_per_allocated", 1.0);
  c.attempts = static_cast<int>(jf::integer(j, "attempts", 0, 1000));
  return c;
}

ReservedCheck check_reserved(const RecordedSteps& run, MemoryDevice device, const Plan& plan,
                             const PlanRequest& request, const ReservedFitOptions& o) {
  ReservedCheck c;
  c.steps = o.steps;
  c.cap_bytes = plan.budget_bytes - request.outside_bytes;
  c.margin_bytes = static_cast<int64_t>(static_cast<double>(c.cap_bytes) * request.margin);
  c.reserved_per_allocated = request.reserved_per_allocated;
  CudaPredictionOptions free_run = o.allocator;
  free_run.limit_bytes = 0;
  free_run.reserved_at_start = run.reserved_at_start;
  free_run.allocated_at_start = run.allocated_at_start;
  const CudaReservedPrediction peak = predict_cuda_reserved(run.trace, device, free_run);
  CudaPredictionOptions capped = free_run;
  capped.limit_bytes = std::max<int64_t>(1, c.cap_bytes);
  const CudaReservedPrediction under_cap = predict_cuda_reserved(run.trace, device, capped);
  c.peak_reserved = peak.peak_reserved;
  c.peak_allocated = peak.peak_allocated;
  c.workspace_bytes = peak.workspace_bytes;
  c.num_alloc_retries = under_cap.num_alloc_retries;
  c.num_ooms = under_cap.num_ooms + (run.out_of_memory ? 1 : 0);
  return c;
}

namespace {

std::string check_text(const ReservedCheck& c) {
  char buf[240];
  std::snprintf(buf, sizeof buf, "its steps replayed on the CUDA caching allocator reserve %s of the %s the budget allows "
                "(margin %s; %lld retries, %lld out-of-memory errors under the cap)",
                format_bytes(c.peak_reserved).c_str(), format_bytes(c.cap_bytes).c_str(), format_bytes(c.margin_bytes).c_str(),
                static_cast<long long>(c.num_alloc_retries), static_cast<long long>(c.num_ooms));
  return buf;
}

}  // namespace

Plan fit_reserved(Planner& planner, Plan plan, MemoryDevice device, const StepRecorder& record,
                  const ReservedFitOptions& o, const Replan& replan) {
  std::vector<std::string> notes;
  for (int attempt = 1; plan.feasible; ++attempt) {
    plan.reserved = check_reserved(record(plan.config, o.steps), device, plan, planner.request(), o);
    plan.reserved.attempts = attempt;
    if (plan.reserved.held() || attempt >= o.attempts || plan.predicted_peak <= 0) break;
    // The relation that keeps this plan out (its predicted peak x the relation then exceeds
    // what the cap less the margin allows, as its replay did): its replayed reserved peak over
    // its predicted allocated peak, and at least 1% above the last.
    const double seen = static_cast<double>(plan.reserved.peak_reserved) / static_cast<double>(plan.predicted_peak);
    const double relation = std::max(planner.request().reserved_per_allocated * 1.01, seen);
    notes.push_back("planned again for CUDA's reserved bytes: " + check_text(plan.reserved) +
                    "; reserved = " + std::to_string(relation) + " x allocated from now on");
    planner.require_relation(relation);
    plan = replan(plan.budget_bytes);
  }
  if (plan.feasible && plan.reserved.checked() && !plan.reserved.held()) {
    notes.push_back("warning: after " + std::to_string(plan.reserved.attempts) + " plans " + check_text(plan.reserved));
  }
  plan.notes.insert(plan.notes.end(), notes.begin(), notes.end());
  return plan;
}

}  // namespace memfit
