// trainer_impl.h — the Trainer's state, shared by its parts (trainer.cpp) and its output
// (train_output.cpp). Private to src/train.
#pragma once

#include <chrono>
#include <limits>
#include <fstream>
#include <memory>
#include <optional>
#include <ostream>

#include "memfit/measure/budget_allocator.h"
#include "memfit/measure/memory_tracker.h"
#include "memfit/techniques/grad_scaler.h"
#include "memfit/techniques/metrics.h"
#include "memfit/train/oom_recovery.h"
#include "memfit/train/trainer.h"

namespace memfit {

using TrainClock = std::chrono::steady_clock;

// A JSON-lines log written to FILE.tmp and renamed to FILE when the run ends.
class JsonLog {
 public:
  explicit JsonLog(const std::string& path);
  ~JsonLog();
  void write(const nlohmann::json& line);
  void commit();

 private:
  std::string path_, tmp_;
  std::ofstream out_;
};

// One point of the steps chart.
struct StepPoint {
  int64_t step = 0;
  double loss = 0;
  int64_t live_bytes = 0, peak_bytes = 0;
  double eval_loss = std::numeric_limits<double>::quiet_NaN();  // NaN: not evaluated then
};

// The steps chart's points in preallocated storage of at most kCapacity points: when full,
// every other point goes and the stride doubles. Nothing per step outlives the step on the
// heap, so a run of 10^5 steps holds what a run of 10^3 does (long-lived small allocations
// interleaved with tensors' made the heap grow by tens of KB per step).
class StepHistory {
 public:
  static constexpr size_t kCapacity = 1024;
  StepHistory() { points_.reserve(kCapacity); }
  void add(const StepPoint& point);
  nlohmann::json json() const;

 private:
  std::vector<StepPoint> points_;
  StepPoint last_;
  int64_t stride_ = 1;
};

struct TrainerState {
  TrainerState(Workload& workload, TrainOptions options, std::ostream& out);

  Workload& w;
  TrainOptions o;
  std::ostream& out;
  bool primary = true;              // rank 0: writes the log, the report, saved state
  bool model_file_note = false;     // ZeRO 3's "no model.pt" said once
  bool tty = false;
  BatchSlice local;                 // this rank's samples of each batch
  std::vector<at::Tensor> params;

  BudgetAllocator* alloc = nullptr;
  std::shared_ptr<MemoryTracker> tracker;
  std::unique_ptr<TrackerScope> scope;
  std::unique_ptr<BudgetGuard> budget_guard;
  std::unique_ptr<DistributedContext> context;
  std::unique_ptr<ShardedDataParallel> sdp;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  OptimizerSpec optimizer_spec;     // what `optimizer` was built with: o.optimizer, state resolved

  int64_t resident_bytes = 0;       // counted by the budget, outside the tracker (caller's data)
  int64_t start_step = 0;
  nlohmann::json resumed_meta;      // null unless resumed
  CostsSource costs_source;          // the planner's measurements: measured now, or from the cache
  std::optional<Planner> planner;
  Plan plan;
  int64_t budget = 0;
  std::unique_ptr<GradScaler> scaler;
  std::unique_ptr<SplitRecovery> recovery;
  int64_t eval_micro_batch = 1;     // the plan's micro-batch, halved by out-of-memory errors
  int64_t eval_recoveries = 0;
  int64_t last_saved_step = -1;

  std::unique_ptr<JsonLog> log;
  LeakDetector leaks;
  TrainSummary summary;
  RankStateBytes own_state;         // measured at the last optimizer step
  StepHistory history;              // what the HTML report's steps chart draws, bounded
  nlohmann::json last_step_doc;     // the last step, analysed for the HTML report
  TrainClock::time_point run_start;

  int64_t parameter_count = 0;      // of the whole model (counted before ZeRO 3 shards it)
  int64_t parameter_bytes = 0;

  bool sharded_optimizer() const { return sdp && sdp->zero_stage() > 0; }
  bool sharded_weights() const { return sdp && sdp->zero_stage() == 3; }
  // The tensors holding this rank's weights (and gradients): the parameters, or at ZeRO 3
  // this rank's shards of them.
  std::vector<at::Tensor> held_parameters() const { return sharded_weights() ? sdp->optimized_parameters() : params; }
  StepOptions step_options();
};

// train_output.cpp: what the trainer prints and writes.
void print_header(TrainerState& t);
void print_plan(TrainerState& t);
void print_progress(TrainerState& t, int64_t step, const nlohmann::json& step_line);
void print_summary(TrainerState& t);
nlohmann::json step_document(TrainerState& t, const KnownStorage& known);
void write_report(TrainerState& t);

}  // namespace memfit
