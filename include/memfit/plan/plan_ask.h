// plan_ask.h — what a user asks of a plan, as every front takes it (memfit plan's and train's
// flags, the Trainer's options, memfit.plan's arguments), and the one place where it becomes the
// planner's request (plan_request.h): the budget's one door, the margin, the precisions to
// measure (and which are left out, and why), what may go to the host, and what the budget
// counts beside the step. And the one text that says a budget is below every plan.
//
//   memfit::PlanAsk ask;
//   ask.budget_bytes = 512 << 20;  ask.step.batch = 32;  ask.offload = "auto";
//   memfit::PlanSetup setup = memfit::set_up_plan(ask);   // setup.request, setup.precisions
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "memfit/plan/plan.h"
#include "memfit/plan/plan_request.h"
#include "memfit/plan/planner.h"

namespace memfit {

struct PlanAsk {
  int64_t budget_bytes = 0;  // what every step must fit (0: chosen later, from the measured costs)
  double margin = kPlanMargin;  // of the budget, kept free: 0 to 0.5
  // The precisions a plan may run: names, or "auto" (fp32, then every mixed precision autocast
  // runs on the device).
  std::vector<std::string> precisions{"auto"};
  std::string offload = "none";  // none | optimizer | activations | all | auto (offload_mode_name)
  int64_t host_budget_bytes = 0;  // what offloading may hold on the host (0: unlimited)
  // The step's fixed parts: device, batch (this process's samples), micro_batch (0: searched),
  // set_to_none, the optimizer (its state fp32, 8bit or auto).
  StepConfig step;
  std::optional<CheckpointPlan> checkpoint;  // pinned (unset: solved)
  int64_t resident_bytes = 0;  // alive all along and counted by the budget, not the step's
  int64_t outside_bytes = 0;   // CUDA: the memory outside the caching allocator (its context)
  // Whether the front's autograd lets a block's saved activations go to the host (memfit's
  // chain does; Python's autograd keeps them where they were made).
  bool activations_movable = true;
};

struct PlanSetup {
  PlanRequest request;  // the optimizer's costs are the measurement's to fill in
  std::vector<Precision> precisions;  // to measure, the baseline first
  std::vector<std::string> notes;     // precisions left out, and why
};

// The request for `ask`, checked: an OptionError names the first value that is not accepted.
// A precision this device cannot run, or fp16 where the optimizer may be offloaded (its loss
// scaler unscales on the device, offload puts the gradients on the host), is left out with a
// note, or refused where nothing else is left.
PlanSetup set_up_plan(const PlanAsk& ask);

// "budget 30.0 MiB (31457280 bytes) is below what any plan needs: the smallest budget that
// works is 41.2 MiB (43200000 bytes)", and for each technique the request did not allow that
// would go lower, "; with `offload` optimizer, 33.0 MiB (34603008 bytes)".
std::string below_floor_text(const Planner& planner, int64_t budget_bytes);

}  // namespace memfit
