// trainer.h — `memfit train` as a library call: train a workload under a hard memory budget.
//
// 1. Plan (planner.h): profile the chain's blocks and the whole chain, then choose precision,
//    micro-batch and the recomputed blocks predicted fastest whose peak fits the budget minus
//    a margin, counting this rank's state bytes; the first real step verifies it.
// 2. Train: every step processes exactly `batch` samples as micro-batches with gradient
//    accumulation. An out-of-memory error in a micro-batch splits that micro-batch in two and
//    redoes only it (no sample lost or counted twice); repeated real OOMs re-plan smaller;
//    only a 1-sample micro-batch with every block recomputed gives up.
// 3. Survive: state (model, optimizer, RNG, data position, plan) saved atomically every K
//    steps; a resumed run continues the exact same stream.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <iosfwd>
#include <string>
#include <vector>

#include "memfit/autocast.h"
#include "memfit/chain.h"
#include "memfit/distributed.h"
#include "memfit/workload.h"

namespace memfit {

struct TrainOptions {
  ModelOptions model;
  int64_t batch = 16;
  int64_t steps = 30;               // counted from the start of training, resumes included
  int64_t budget_bytes = 0;         // 0: a default the plain step does not fit (see train())
  std::string precision = "auto";   // auto | fp32 | bf16 | fp16
  int64_t micro_batch = 0;          // 0: chosen by the plan
  std::string checkpoint = "auto";  // auto | none | all | every:K | i,j,...
  bool keep_grads = false;
  double learning_rate = 1e-3;
  std::string save_dir;
  int64_t save_every = 10;
  std::string resume_dir;
  int64_t eval_every = 10;
  int64_t eval_batches = 4;
  std::vector<int64_t> inject_oom;  // steps (from 1) whose first micro-batch fails once
  std::string json_log;
  std::string report_html;          // empty: no HTML report
  bool progress = true;
  // world_size > 1: this process is one rank of data-parallel training over the global
  // `batch` (see distributed.h); rank 0 alone writes the log, the report and saved state.
  DistributedOptions distributed;
  std::string dump_weights;         // testing: all parameters as raw float32, in order (rank 0)
};

// Bytes of the training state on one rank, measured at the last optimizer step.
struct RankState {
  int rank = 0;
  int64_t weights = 0;
  int64_t gradients = 0;
  int64_t optimizer_state = 0;
};

struct TrainPlan {
  int64_t micro_batch = 0;
  Precision precision = Precision::kFP32;
  CheckpointPlan checkpoint;
  std::string checkpoint_mode;      // "auto" (solved by the planner) or the user's spec
  int64_t predicted_peak = 0;       // bytes
  int64_t plain_predicted_peak = 0; // the whole batch, nothing recomputed
  double predicted_step_seconds = 0;
  double plain_step_seconds = 0;
  std::vector<std::string> notes;   // why this plan, said plainly
};

struct TrainSummary {
  int64_t steps = 0;                // last step number reached
  int64_t samples = 0;              // samples trained on in this run
  double final_loss = 0;
  double eval_loss = 0;
  int64_t peak_bytes = 0;           // tracker peak over this run's training steps
  int64_t budget_bytes = 0;
  int64_t oom_recoveries = 0;
  std::string weights_sha256;
  TrainPlan plan;
  std::vector<double> losses;       // per step of this run
  int world_size = 1;
  int zero_stage = 0;
  std::vector<RankState> ranks;     // every rank's state bytes (gathered on every rank)
  nlohmann::json json() const;      // the {"type": "summary", ...} line
};

// Runs the whole job, printing the plan, progress and summary to `out`. Installs
// BudgetAllocator (if not yet) and its own MemoryTracker on this thread. Throws
// std::invalid_argument for bad options (one line), std::runtime_error for failures
// (corrupt state, a budget below the smallest plan, with the smallest budget that would work).
TrainSummary train(const TrainOptions& options, std::ostream& out);

// sha256 over the bytes of all parameters, in order, as lowercase hex.
std::string weights_sha256(const torch::nn::Module& module);

}  // namespace memfit
