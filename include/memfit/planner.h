// planner.h — the fastest configuration that fits a budget, predicted before it runs, then
// verified.
//
// 1. Profile, for each candidate precision: each block of the chain runs alone (its input
//    detached) at two micro-batch sizes (a quarter and a half of the batch): forward and
//    backward seconds, output bytes, bytes kept for backward, transient peaks with and without
//    grad, whether the next block keeps its input. Then the whole plain chain runs at both
//    sizes: its bytes calibrate the blocks' bytes, its seconds are the time model (the blocks'
//    seconds only say how that time divides among them). Values at other sizes are fitted
//    linearly in the micro-batch size.
// 2. Solve: for each precision and micro-batch size, the least-recompute checkpoint schedule
//    under the budget minus a margin (schedule.h's DP).
// 3. Search: precision, micro-batch x accumulation and schedule minimizing the predicted step
//    time; ties go to the first precision listed (fp32) and the larger micro-batch.
// 4. Verify: real steps under the tracker; if the measured peak exceeds the budget, tighten
//    and plan again (and say so).
#pragma once

#include <nlohmann/json.hpp>

#include <optional>
#include <string>
#include <vector>

#include "memfit/autocast.h"
#include "memfit/chain.h"
#include "memfit/memory_tracker.h"
#include "memfit/schedule.h"
#include "memfit/workload.h"

namespace memfit {

struct PlanRequest {
  int64_t budget_bytes = 0;
  int64_t batch = 16;                                  // samples per optimizer step (this rank's)
  std::vector<Precision> precisions{Precision::kFP32}; // candidates; the first is the baseline
  int64_t micro_batch = 0;                             // 0: searched
  std::optional<CheckpointPlan> checkpoint;            // pinned schedule; unset: solved
  bool keep_grads = false;
  double margin = 0.03;      // of the budget, kept free for what the model cannot see
  // This process's training state where it differs from one process training alone (ZeRO
  // sharding over ranks); -1 means the single-process value.
  int64_t optimizer_state_bytes = -1;  // AdamW's exp_avg + exp_avg_sq: 2x the weights
  int64_t gradient_bytes = -1;         // held through the optimizer step: the weights' bytes
  int64_t largest_update_bytes = -1;   // the largest parameter the optimizer updates (AdamW
                                       // makes two temporaries of its size): the largest one
  int64_t extra_bytes = 0;             // alive beside the optimizer step (state gathered to save)
};

// "auto": fp32, then the mixed precisions autocast runs on `device` (bf16 on CPU; bf16 and
// fp16 on CUDA). Otherwise the one named, if supported. Throws std::invalid_argument naming
// the value and the choices.
std::vector<Precision> precision_candidates(const std::string& text, c10::DeviceType device);

// Per-block costs measured at one micro-batch size.
struct ChainProfile {
  int64_t micro_batch = 0;
  std::vector<BlockCost> blocks;
};

ChainProfile profile_chain(Workload& workload, const Batch& batch, int64_t micro_batch, Precision precision,
                           MemoryTracker& tracker);

// What one precision costs: the blocks at two sizes, and the whole plain chain measured.
struct PrecisionProfile {
  Precision precision = Precision::kFP32;
  ChainProfile small, large;
  double calibration = 1.0;            // measured / modelled bytes of the plain chain
  double chain_seconds_small = 0;      // forward + backward of the plain chain, best of two
  double chain_seconds_large = 0;
  double chain_seconds_full = 0;       // the whole batch (estimated from a run recomputing every
                                       // block, which needs little memory); 0: not measured
};

struct Plan {
  bool feasible = false;
  int64_t budget_bytes = 0;
  int64_t floor_bytes = 0;          // the smallest budget any plan reaches (margin included)
  int64_t micro_batch = 0;
  int64_t accumulation = 0;
  Precision precision = Precision::kFP32;
  CheckpointPlan checkpoint;
  int64_t predicted_peak = 0;
  double predicted_seconds = 0;     // forward + backward of one optimizer step
  Precision baseline_precision = Precision::kFP32;  // the plain step's (the first candidate)
  int64_t plain_predicted_peak = 0; // whole batch, nothing recomputed, baseline precision
  double plain_predicted_seconds = 0;
  std::vector<std::string> notes;   // why this plan, said plainly
};

class Planner {
 public:
  // Profiles `workload` (two micro-batch sizes); `tracker` must be installed on this thread.
  Planner(Workload& workload, const Batch& batch, const PlanRequest& request, MemoryTracker& tracker);
  // The plan for a budget (request.budget_bytes unless given).
  Plan plan(int64_t budget_bytes = 0) const;
  // The prediction for one configuration, fitting or not (feasible says whether it fits).
  Plan evaluate(int64_t micro_batch, Precision precision, const CheckpointPlan& checkpoint,
                int64_t budget_bytes = 0) const;
  // The smallest budget any plan reaches (margin included): Plan::floor_bytes without planning.
  int64_t floor_bytes() const;
  // The modelled costs at micro-batch m (fitted), with the step's fixed bytes; precision: the
  // baseline unless given.
  ChainCosts costs_at(int64_t m) const;
  ChainCosts costs_at(int64_t m, Precision precision) const;
  // checkpoint_sequential's schedule at micro-batch m: `segments` runs of equal length, all
  // but the last recomputed (baseline precision).
  Schedule uniform(int64_t m, int segments) const;
  // The precisions profiled (those that failed to run are dropped, with a note).
  const std::vector<PrecisionProfile>& profiles() const { return profiles_; }

 private:
  const PrecisionProfile& profile(Precision precision) const;
  ChainCosts costs_at(int64_t m, const PrecisionProfile& p) const;
  int64_t optimizer_state_bytes() const;
  int64_t optimizer_peak() const;
  // Seconds of one optimizer step's forward + backward when `schedule` runs at micro-batch m.
  double step_seconds(int64_t m, const PrecisionProfile& p, const std::vector<std::pair<int, int>>& segments) const;

  Workload& workload_;
  PlanRequest request_;
  std::vector<PrecisionProfile> profiles_;
  std::vector<std::string> profile_notes_;
  int64_t weight_bytes_ = 0, largest_param_ = 0, batch_bytes_ = 0;
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
