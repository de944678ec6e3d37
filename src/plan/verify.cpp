#include "memfit/plan/verify.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <optional>

#include "memfit/errors.h"
#include "memfit/measure/budget_allocator.h"
#include "memfit/measure/size.h"
#include "memfit/plan/plan_steps.h"
#include "memfit/runtime/optimizer_offload.h"
#include "memfit/runtime/step.h"
#include "memfit/techniques/cache.h"
#include "memfit/techniques/grads.h"

namespace memfit {
namespace {

struct Attempt {
  bool oom = false;
  int64_t peak = 0;
  double seconds = 0;
  AllocationTrace trace;
  CudaAllocatorCounters at_start, counters;  // on CUDA: the allocator's, before and after the steps
  int64_t cuda_limit = 0;
};

// The plan's steps under its budget: the CPU allocator's, and on CUDA the allocator's fraction
// (from an emptied cache, so that what is measured is this plan's).
Attempt run_under_budget(Workload& w, const Batch& data, const Plan& plan, const PlanRequest& request,
                         MemoryTracker& tracker, int steps) {
  Attempt a;
  const int cuda_device = plan.config.device.has_index() ? plan.config.device.index() : 0;
  std::optional<CudaMemoryFractionGuard> cap;
  if (plan.config.device.is_cuda()) {
    empty_cache();
    cap.emplace(plan.budget_bytes - request.outside_bytes, cuda_device);
    a.cuda_limit = cap->limit_bytes();
    reset_cuda_allocator_counters(cuda_device);
    a.at_start = cuda_allocator_counters(cuda_device);
  }
  BudgetGuard budget(plan.budget_bytes);
  tracker.start_recording();
  try {
    const PlanSteps run = run_plan_steps(w, data, plan.config, tracker, steps);
    a.seconds = run.best_seconds;
    a.peak = run.peak;
  } catch (const c10::OutOfMemoryError&) {
    a.oom = true;
  }
  tracker.stop_recording();
  a.trace = recorded_trace(tracker);
  if (plan.config.device.is_cuda()) a.counters = cuda_allocator_counters(cuda_device);
  return a;
}

// On CUDA: the plan again with the planner's relation raised to what the steps just run showed
// (the model's replay and the allocator's own counters), and 5% more each further attempt: the
// planner keeps it, so each attempt is tighter than the one before.
Plan replan_with_relation(Planner& planner, const Plan& plan, const Attempt& a, int attempt) {
  CudaPredictionOptions unlimited = cuda_prediction_options_from_env();
  const CudaReservedPrediction p = predict_cuda_reserved(a.trace, MemoryDevice::kCUDA, unlimited);
  const auto ratio = [](int64_t reserved, int64_t allocated) {
    return allocated > 0 ? static_cast<double>(reserved) / static_cast<double>(allocated) : 1.0;
  };
  const double relation = std::max({planner.request().reserved_per_allocated * (1.0 + 0.05 * attempt),
                                    ratio(p.peak_reserved, p.peak_allocated),
                                    ratio(a.counters.peak_reserved, a.counters.peak_allocated)});
  planner.require_relation(relation);
  Plan again = planner.plan(plan.budget_bytes);
  again.notes.insert(again.notes.begin(), "planned again with reserved = " + std::to_string(relation) +
                                              " x allocated (the verified steps' relation)");
  return again;
}

// The tighter plan after an attempt that did not hold the budget, or an infeasible plan.
Plan tighter_plan(Planner& planner, const Plan& plan, const Attempt& a, int attempt, std::vector<std::string>& notes) {
  if (plan.config.device.is_cuda()) {
    notes.push_back(a.oom ? "the CUDA allocator ran out of memory under the budget's fraction: planned again"
                          : "the CUDA allocator freed its cache and retried under the budget's fraction: planned again");
    return replan_with_relation(planner, plan, a, attempt);
  }
  // Plan for a smaller budget (5% less each time) and try again.
  const int64_t tighter = static_cast<int64_t>(static_cast<double>(plan.budget_bytes) * (1.0 - 0.05 * attempt));
  notes.push_back("measured peak exceeded the budget: planned again for " + format_bytes(tighter));
  Plan again = planner.plan(tighter);
  again.budget_bytes = plan.budget_bytes;
  return again;
}

}  // namespace

Verification verify_plan(Workload& w, const Planner& planner, Plan& plan, MemoryTracker& tracker, bool measure_plain,
                         int steps, const Batch* batch) {
  check_option(steps >= 2, "verify_steps", steps, "expected 2 or more (the first step only warms up)");
  Verification v;
  v.steps = steps;
  const CudaPredictionOptions cuda_options = cuda_prediction_options_from_env();
  const MemoryDevice device = memory_device_of(plan.config.device);
  v.on_cuda = plan.config.device.is_cuda();
  Planner tightened = planner;  // what each failed attempt tightens, never the request as it came
  BudgetAllocator::install();
  const Batch data = batch != nullptr ? *batch : w.data->train_batch(0, plan.config.batch, w.seed).to(plan.config.device);
  if (measure_plain) {
    StepConfig plain = plan.config;
    plain.micro_batch = 0;
    plain.precision = plan.baseline_precision;
    plain.checkpoint = CheckpointPlan::none();
    v.plain_seconds = run_plan_steps(w, data, plain, tracker, 3).best_seconds;
  }
  for (;; ++v.attempts) {
    const Attempt a = run_under_budget(w, data, plan, tightened.request(), tracker, steps);
    v.measured_seconds = a.seconds;
    v.measured_peak = a.peak > 0 ? a.peak + tightened.request().resident_bytes : 0;  // the budget counts them too
    CudaPredictionOptions capped = cuda_options;
    capped.limit_bytes = a.cuda_limit;
    if (v.on_cuda) {
      capped.reserved_at_start = a.at_start.reserved;
      capped.allocated_at_start = a.at_start.allocated;
    }
    v.cuda = predict_cuda_reserved(a.trace, device, capped);
    v.cuda_measured = a.counters;
    v.cuda_limit_bytes = a.cuda_limit;
    const bool held = !a.oom && !(v.on_cuda && a.counters.num_alloc_retries > 0);
    if (held || v.attempts >= 3) {
      if (a.oom) v.notes.push_back("the plan still ran out of memory after 3 attempts");
      if (!a.oom && !held) v.notes.push_back("the CUDA allocator still retried after 3 attempts");
      break;
    }
    Plan again = tighter_plan(tightened, plan, a, v.attempts, v.notes);
    if (!again.feasible) break;
    plan = again;
  }
  return v;
}

nlohmann::json verified_plan_json(const Plan& p, const Verification& v) {
  nlohmann::json j = plan_json(p);
  if (p.feasible) {
    j["measured"] = {{"peak_bytes", v.measured_peak},
                     {"step_time_ratio", v.plain_seconds > 0 ? v.measured_seconds / v.plain_seconds : 0.0},
                     {"step_seconds", v.measured_seconds},
                     {"plain_step_seconds", v.plain_seconds},
                     {"steps", v.steps}};
    if (v.on_cuda) {
      const CudaAllocatorCounters& c = v.cuda_measured;
      j["measured"]["cuda"] = {{"max_memory_allocated", c.peak_allocated}, {"max_memory_reserved", c.peak_reserved},
                               {"num_alloc_retries", c.num_alloc_retries}, {"num_ooms", c.num_ooms},
                               {"reserved_limit_bytes", v.cuda_limit_bytes}};
    }
    j["verify_attempts"] = v.attempts;
    if (v.cuda.valid) j.update(cuda_prediction_json(v.cuda));
  }
  for (const auto& n : v.notes) j["notes"].push_back(n);
  return j;
}

}  // namespace memfit
