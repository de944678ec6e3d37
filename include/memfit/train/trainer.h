// trainer.h — `memfit train` as a library: train a workload (any Chain, data and loss) with any
// torch::optim family under a hard memory budget, in one process or as one rank of many.
//
//   memfit::TrainOptions o;
//   o.step.batch = 32;
//   o.budget_bytes = 512 << 20;
//   o.step.optimizer.family = memfit::OptimizerFamily::kSGD;  o.step.optimizer.momentum = 0.9;
//   memfit::Trainer trainer(workload, o);
//   trainer.add_observer(my_observer);                    // events.h: plan, steps, summary
//   memfit::TrainSummary s = trainer.run();                // or the parts below, in order
//
// The parts:
// 1. set_up: checks the options, installs the budget allocator and a tracker on this thread,
//    makes the strategy (strategy.h: one process, or ZeRO over c10d), builds the optimizer,
//    resumes saved state.
// 2. plan: measures the workload and the optimizer (or reads them from the profile cache) and
//    plans (plan/job.h): precision, micro-batch and recomputed blocks predicted fastest under
//    the budget; a resumed run takes its saved plan; every rank takes rank 0's. From here on the
//    budget is enforced.
// 3. step: every step processes exactly `batch` samples through the step runner's micro-batch
//    loop (runtime/step.h) with out-of-memory recovery plugged in (oom_recovery.h): no sample
//    lost or counted twice; repeated real OOMs re-plan smaller.
// 4. evaluate, save (atomically, every K steps: saved_state.h), summarize (the summary, and the
//    JSON log and HTML report when asked for).
// A Trainer works on the thread that created it (the tracker is thread-local).
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "memfit/measure/cuda_budget.h"
#include "memfit/plan/planner.h"
#include "memfit/plan/profile_cache.h"
#include "memfit/plan/rank_states.h"
#include "memfit/runtime/step_config.h"
#include "memfit/runtime/workload.h"
#include "memfit/train/events.h"
#include "memfit/train/process_group.h"

namespace memfit {

struct TrainOptions {
  // The step: batch (samples per optimizer step, over all ranks), device, set_to_none and the
  // optimizer (state auto: fp32 or 8-bit, planned). micro_batch 0: planned. precision and
  // checkpoint: planned unless pinned below.
  StepConfig step = default_step();
  bool pin_precision = false;       // run step.precision (else fp32 or a mixed precision the device runs)
  bool pin_checkpoint = false;      // recompute step.checkpoint (else the plan's schedule)
  OffloadMode offload = OffloadMode::kNone;  // what the plan may move to the host (one process)
  int64_t host_budget_bytes = 0;    // host bytes the plan may use when offloading (0: unlimited)
  int64_t steps = 30;               // counted from the start of training, resumes included
  int64_t budget_bytes = 0;         // 0: halfway between the smallest plan and the plain step
  std::string save_dir;
  int64_t save_every = 10;
  std::string resume_dir;
  int64_t eval_every = 10;          // 0: never
  int64_t eval_batches = 4;
  std::vector<int64_t> inject_oom;  // steps (from 1) whose first micro-batch fails once
  std::string json_log;             // JSON lines: plan, steps, summary ("": none)
  std::string report_html;          // the HTML report of the last step ("": none)
  // world_size > 1: this process is one rank of data-parallel training over the global batch
  // (strategy.h); rank 0 alone writes the log, the report and saved state.
  DistributedOptions distributed;
  // Where the planner's measurements are kept between runs (plan/profile_cache.h); dir "": not
  // kept. replan: measure even when kept.
  ProfileCacheOptions profile_cache;

  static StepConfig default_step() {
    StepConfig s;
    s.batch = 16;
    return s;
  }
};

// Throws OptionError naming the first bad option (before any work).
void check_train_options(const TrainOptions& options, const Workload& workload);

struct TrainSummary {
  int64_t first_step = 1;           // of this run (after a resume: the step after the saved one)
  int64_t steps = 0;                // last step number reached
  int64_t samples = 0;              // samples trained on in this run
  double final_loss = 0;
  bool evaluated = false;           // a held-out evaluation ran
  double eval_loss = 0;             // the last one
  int64_t peak_bytes = 0;           // the highest step peak of this run, bytes outside the tracker included
  int64_t host_peak_bytes = 0;      // the highest in the host space (offloaded bytes; memory_space.h)
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
  std::vector<RankStateBytes> ranks;  // every rank's state bytes at the last optimizer step, by rank
  std::map<std::string, double> phase_seconds;  // training's time per tracker phase (data, forward, ...)
  double seconds = 0;               // the training loop, wall clock
  bool interrupted = false;         // stopped early on request (stop_signal.h), state saved if saving
  std::string report_file;          // the HTML report written ("": none)
  // On CUDA: the caching allocator's counters over the training steps (peaks since the budget
  // was enforced, allocator retries, out-of-memory errors) and the memory outside it.
  std::optional<CudaAllocatorCounters> cuda;
  int64_t cuda_outside_bytes = 0;
  nlohmann::json json() const;      // the {"type": "summary", ...} line
};

class Trainer {
 public:
  Trainer(Workload& workload, TrainOptions options);
  ~Trainer();
  Trainer(const Trainer&) = delete;
  Trainer& operator=(const Trainer&) = delete;

  // Events go to `observer` too (it must outlive the Trainer's use of it), in the order added.
  void add_observer(TrainObserver& observer);

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
  // For comparing runs within a tolerance (the tests, through the CLI's hidden --dump-weights):
  // summarize() also writes every parameter to `path` as raw float32, in order, on rank 0
  // (strategy.h's WeightsDump). "": nothing written.
  void dump_weights_at_summary(std::string path);

  int64_t start_step() const;       // the step a resumed run continues after (0: fresh)
  torch::optim::Optimizer& optimizer();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Trainer(workload, options) with `observer`, run.
TrainSummary train(Workload& workload, const TrainOptions& options, TrainObserver& observer);

}  // namespace memfit
