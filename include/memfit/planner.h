// planner.h — the fastest configuration that fits a budget, predicted before it runs, then
// verified.
//
// 1. Profile: each block of the chain runs alone (its input detached) at two micro-batch
//    sizes (a quarter and a half of the batch): forward and backward seconds, output bytes, bytes kept for backward, transient
//    peaks with and without grad, whether the next block keeps its input. Values at other
//    sizes are fitted linearly in the micro-batch size.
// 2. Solve: for each micro-batch size, the least-recompute checkpoint schedule under the
//    budget minus a margin (schedule.h's DP).
// 3. Search: micro-batch x accumulation and schedule minimizing the predicted step time.
// 4. Verify: real steps under the tracker; if the measured peak exceeds the budget, tighten
//    and plan again (and say so).
#pragma once

#include <nlohmann/json.hpp>

#include <string>
#include <vector>

#include "memfit/autocast.h"
#include "memfit/memory_tracker.h"
#include "memfit/schedule.h"
#include "memfit/workload.h"

namespace memfit {

struct PlanRequest {
  int64_t budget_bytes = 0;
  int64_t batch = 16;
  Precision precision = Precision::kFP32;
  int64_t micro_batch = 0;   // 0: searched
  bool keep_grads = false;
  double margin = 0.03;      // of the budget, kept free for what the model cannot see
  int64_t optimizer_state_bytes = -1;  // -1: AdamW's 2x the weights, not yet allocated
};

// Per-block costs measured at one micro-batch size.
struct ChainProfile {
  int64_t micro_batch = 0;
  std::vector<BlockCost> blocks;
};

ChainProfile profile_chain(Workload& workload, const Batch& batch, int64_t micro_batch, Precision precision,
                           MemoryTracker& tracker);

struct Plan {
  bool feasible = false;
  int64_t budget_bytes = 0;
  int64_t floor_bytes = 0;          // the smallest budget any plan reaches (margin included)
  int64_t micro_batch = 0;
  int64_t accumulation = 0;
  Precision precision = Precision::kFP32;
  CheckpointPlan checkpoint;
  int64_t predicted_peak = 0;
  double predicted_seconds = 0;     // one optimizer step
  int64_t plain_predicted_peak = 0; // whole batch, nothing recomputed
  double plain_predicted_seconds = 0;
  std::vector<std::string> notes;
};

class Planner {
 public:
  // Profiles `workload` (two micro-batch sizes); `tracker` must be installed on this thread.
  Planner(Workload& workload, const Batch& batch, const PlanRequest& request, MemoryTracker& tracker);
  // The plan for a budget (request.budget_bytes unless given).
  Plan plan(int64_t budget_bytes = 0) const;
  // The modelled costs at micro-batch m (fitted), with the step's fixed bytes.
  ChainCosts costs_at(int64_t m) const;
  // The uniform "every K blocks" schedule (checkpoint_sequential style) at micro-batch m.
  Schedule uniform(int64_t m, int segment_length) const;

 private:
  Workload& workload_;
  PlanRequest request_;
  ChainProfile small_, large_;
  int64_t weight_bytes_ = 0, largest_param_ = 0, batch_bytes_ = 0;
  std::vector<int64_t> block_param_bytes_;
  double calibration_ = 1.0;  // measured / modelled bytes of the plain chain (see the constructor)
};

struct Verification {
  int64_t measured_peak = 0;
  double measured_seconds = 0;
  double plain_seconds = 0;   // the plain step of the whole batch, measured without a budget
  int attempts = 1;
  std::vector<std::string> notes;
};

// Runs real steps (AdamW) with the plan under the tracker and the budget; tightens and plans
// again if the measured peak exceeds the budget.
Verification verify_plan(Workload& workload, Planner& planner, Plan& plan, MemoryTracker& tracker,
                         int64_t batch, bool measure_plain);

nlohmann::json plan_json(const Plan& plan, const Verification* verification);

}  // namespace memfit
