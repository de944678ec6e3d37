// plan.h — a plan: the step configuration the planner chose (planner.h), what it is predicted
// to cost on the device and the host, and why it was chosen (notes); its one JSON form, which
// the plan output, saved state, the broadcast to ranks, the log and the HTML report carry.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "memfit/plan/reserved_check.h"
#include "memfit/runtime/step_config.h"

namespace memfit {

// Of the budget, kept free for what the model cannot see (allocator rounding, workspaces the
// profile missed): every plan's margin unless a request says otherwise.
constexpr double kPlanMargin = 0.03;

struct Plan {
  bool feasible = false;
  int64_t budget_bytes = 0;
  double margin = kPlanMargin;      // of the budget, kept free (the request's)
  int64_t floor_bytes = 0;          // the smallest budget any plan reaches (margin included)
  StepConfig config;                // what runs (valid when feasible)
  bool checkpoint_pinned = false;   // the schedule was given, not solved
  int64_t predicted_peak = 0;       // on the device: what the budget counts
  int64_t predicted_host_peak = 0;  // in the host space (offloaded bytes; 0 when nothing is)
  double predicted_seconds = 0;     // one whole step: every micro-batch's forward + backward, then the optimizer
  Precision baseline_precision = Precision::kFP32;  // the plain step's (the first profiled)
  int64_t plain_predicted_peak = 0; // whole batch, nothing recomputed, baseline precision
  double plain_predicted_seconds = 0;
  // On CUDA: its steps replayed on the caching allocator under the budget's cap (reserved_fit.h);
  // not checked (steps 0) elsewhere.
  ReservedCheck reserved;
  std::vector<std::string> notes;   // why this plan, said plainly
};

// The one JSON form of a plan: {"budget_bytes", "margin", "feasible", "floor_bytes", "config" (step_config_json),
// "checkpoint_pinned", "predicted": {"peak_bytes", "host_peak_bytes", "seconds", "step_time_ratio"},
// "plain": {...}, "reserved" (reserved_check_json, where checked), "notes"}.
nlohmann::json plan_json(const Plan& plan);
// Reads it back (saved state, the broadcast to ranks); the config is checked against `blocks`.
Plan plan_from_json(const nlohmann::json& json, int blocks);

}  // namespace memfit
