// trainer.h — `memfit train` as a library: train a workload (any Chain, data and loss) with any
// torch::optim family under a hard memory budget.
//
//   memfit::TrainOptions o;
//   o.budget_bytes = 512 << 20;
//   o.optimizer.family = memfit::OptimizerFamily::kSGD;  o.optimizer.momentum = 0.9;
//   memfit::Trainer trainer(workload, o, std::cout);
//   memfit::TrainSummary s = trainer.run();              // or the parts below, in order
//
// The parts:
// 1. set_up: checks the options, installs the budget allocator and a tracker on this thread,
//    joins the ranks (distributed.h), builds the optimizer, resumes saved state.
// 2. plan: profiles the workload and measures the optimizer (plan/profile.h), then the Planner
//    chooses precision, micro-batch and recomputed blocks predicted fastest whose peak fits the
//    budget minus a margin, counting this rank's state; a resumed run takes its saved plan;
//    every rank takes rank 0's. The budget is then enforced.
// 3. step: every step processes exactly `batch` samples through the step runner's micro-batch
//    loop (runtime/step.h), with out-of-memory recovery plugged in (oom_recovery.h): no sample
//    lost or counted twice; repeated real OOMs re-plan smaller.
// 4. evaluate, save (atomically, every K steps: saved_state.h), summarize (summary, JSON log,
//    HTML report).
// A Trainer works on the thread that created it (the tracker is thread-local).
#pragma once

#include <c10/core/Device.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <iosfwd>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "memfit/plan/planner.h"
#include "memfit/plan/rank_states.h"
#include "memfit/runtime/step.h"
#include "memfit/runtime/workload.h"
#include "memfit/techniques/rng.h"
#include "memfit/train/distributed.h"

namespace memfit {

class SavedState;  // train/saved_state.h

struct TrainOptions {
  int64_t batch = 16;               // samples per optimizer step, over all ranks
  int64_t steps = 30;               // counted from the start of training, resumes included
  int64_t budget_bytes = 0;         // 0: halfway between the smallest plan and the plain step
  c10::Device device = c10::kCPU;
  std::string precision = "auto";   // auto | fp32 | bf16 | fp16
  int64_t micro_batch = 0;          // 0: chosen by the plan
  std::optional<CheckpointPlan> checkpoint;  // unset: chosen by the plan
  bool keep_grads = false;          // zero gradients instead of releasing them
  OptimizerSpec optimizer;          // state auto: the plan chooses fp32 or 8-bit
  std::string save_dir;
  int64_t save_every = 10;
  std::string resume_dir;
  int64_t eval_every = 10;          // 0: never
  int64_t eval_batches = 4;
  std::vector<int64_t> inject_oom;  // steps (from 1) whose first micro-batch fails once
  std::string json_log;
  std::string report_html;          // empty: no HTML report
  bool progress = true;
  int64_t progress_every = 0;       // not on a terminal: a line every K steps; 0: about 20 lines a run
  // world_size > 1: this process is one rank of data-parallel training over the global
  // `batch` (see distributed.h); rank 0 alone writes the log, the report and saved state.
  DistributedOptions distributed;
  // Where the planner's measurements are kept between runs (plan/profile_cache.h); dir "": not
  // kept (the CLI's default: default_profile_cache_dir()). replan: measure even when kept.
  ProfileCacheOptions profile_cache;
  std::string dump_weights;         // testing: all parameters as raw float32, in order (rank 0)
};

// Throws OptionError naming the first bad option (before any work).
void check_train_options(const TrainOptions& options, const Workload& workload);

// Bytes of the training state on one rank, measured at the last optimizer step.
struct RankState {
  int rank = 0;
  RankStateBytes bytes;
};

struct TrainSummary {
  int64_t steps = 0;                // last step number reached
  int64_t samples = 0;              // samples trained on in this run
  double final_loss = 0;
  double eval_loss = 0;
  int64_t peak_bytes = 0;           // tracker peak over this run's training steps
  int64_t budget_bytes = 0;
  int64_t oom_recoveries = 0;
  int64_t skipped_steps = 0;        // optimizer steps the loss scaler skipped (inf/NaN gradients)
  int64_t skipped_updates = 0;      // 8-bit state: parameter updates skipped for a non-finite
                                    // gradient (all ranks; optimizer_8bit.h)
  std::string weights_sha256;
  double planning_seconds = 0;      // profiling (or reading the cache) and the search
  bool profile_cached = false;      // the profile came from the cache
  Plan plan;                        // what ran (after any re-plan)
  std::vector<double> losses;       // per step of this run
  int world_size = 1;
  int zero_stage = 0;
  std::vector<RankState> ranks;     // every rank's state bytes (gathered on every rank)
  double seconds = 0;               // the training loop, wall clock
  bool interrupted = false;         // stopped early on request (stop_signal.h), state saved if saving
  nlohmann::json json() const;      // the {"type": "summary", ...} line
};

struct TrainerState;  // src/train/trainer_impl.h

class Trainer {
 public:
  Trainer(Workload& workload, TrainOptions options, std::ostream& out);
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // set_up, plan, step after step (evaluating and saving as the options say, stopping early
  // after a step when stop_requested(): stop_signal.h), summarize.
  TrainSummary run();

  void set_up();
  const Plan& plan();
  // One optimizer step (numbered from 1): its mean loss over the global batch.
  double step(int64_t step);
  double evaluate();
  void save(int64_t step);
  TrainSummary summarize();

  int64_t start_step() const;       // the step a resumed run continues after (0: fresh)
  torch::optim::Optimizer& optimizer();

 private:
  void build_optimizer(StatePrecision state);
  void resume_state_precision(const nlohmann::json& meta, const std::string& where);
  void resume();
  void save_gathered(const nlohmann::json& meta);  // ZeRO 3's save
  void resume_gathered(const SavedState& saved);   // ZeRO 3's resume
  void make_planner();
  void choose_budget();
  void choose_plan();
  ChainTimer chain_timer();      // times micro-batches the search picks that were not profiled
  void adopt_rank0_plan();
  StepResult accumulate(int64_t step, const Batch& batch);
  void update(bool last_step);
  void replan_after_oom(int64_t smallest_ok);
  void record(int64_t step, double loss, double seconds);
  bool stop_agreed();
  [[noreturn]] void stop_on_nonfinite_loss(int64_t step, double loss, const RngState& rng_at_start);

  std::unique_ptr<TrainerState> impl_;
};

// Trainer(workload, options, out).run().
TrainSummary train(Workload& workload, const TrainOptions& options, std::ostream& out);

}  // namespace memfit
