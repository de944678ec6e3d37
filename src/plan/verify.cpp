#include "memfit/plan/verify.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>

#include "memfit/measure/budget_allocator.h"
#include "memfit/measure/size.h"
#include "memfit/runtime/step.h"
#include "memfit/techniques/grads.h"

namespace memfit {
namespace {

using Clock = std::chrono::steady_clock;

// Three steps of `config` with a fresh optimizer; the second and third are in steady state
// (optimizer state exists): their best time, and their peak into *peak.
double run_steps(Workload& w, const Batch& data, const StepConfig& config, MemoryTracker& tracker, int64_t* peak) {
  auto optimizer = make_optimizer(config.optimizer, w.chain->parameters());
  double best = 1e30;
  for (int step = 1; step <= 3; ++step) {
    tracker.reset_peak();
    const auto t0 = Clock::now();
    train_step(w, *optimizer, data, StepOptions{config});
    const double s = std::chrono::duration<double>(Clock::now() - t0).count();
    if (step < 2) continue;
    best = std::min(best, s);
    if (peak) *peak = std::max(*peak, tracker.peak());
  }
  return best;
}

}  // namespace

Verification verify_plan(Workload& w, const Planner& planner, Plan& plan, MemoryTracker& tracker, bool measure_plain,
                         const Batch* batch) {
  Verification v;
  BudgetAllocator::install();
  const Batch data = batch != nullptr ? *batch : w.data->train_batch(0, plan.config.batch, w.seed).to(plan.config.device);
  if (measure_plain) {
    StepConfig plain = plan.config;
    plain.micro_batch = 0;
    plain.precision = plan.baseline_precision;
    plain.checkpoint = CheckpointPlan::none();
    v.plain_seconds = run_steps(w, data, plain, tracker, nullptr);
  }
  for (;; ++v.attempts) {
    int64_t peak = 0;
    bool oom = false;
    {
      BudgetGuard budget(plan.budget_bytes);
      try {
        v.measured_seconds = run_steps(w, data, plan.config, tracker, &peak);
      } catch (const c10::OutOfMemoryError&) {
        oom = true;
        zero_grad(w.chain->parameters(), true);
      }
    }
    v.measured_peak = peak > 0 ? peak + planner.request().resident_bytes : 0;  // the budget counts them too
    if (!oom || v.attempts >= 3) {
      if (oom) v.notes.push_back("the plan still ran out of memory after 3 attempts");
      break;
    }
    // Tighten: plan for a smaller budget (5% less each time) and try again.
    const int64_t tighter = static_cast<int64_t>(static_cast<double>(plan.budget_bytes) * (1.0 - 0.05 * v.attempts));
    Plan again = planner.plan(tighter);
    v.notes.push_back("measured peak exceeded the budget: planned again for " + format_bytes(tighter));
    if (!again.feasible) break;
    again.budget_bytes = plan.budget_bytes;
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
                     {"plain_step_seconds", v.plain_seconds}};
    j["verify_attempts"] = v.attempts;
  }
  for (const auto& n : v.notes) j["notes"].push_back(n);
  return j;
}

}  // namespace memfit
