// trainer_impl.h — the Trainer's state, shared by its parts (trainer.cpp) and its output
// (train_output.cpp). Private to src/train.
#pragma once

#include <chrono>
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

struct TrainerState {
  TrainerState(Workload& workload, TrainOptions options, std::ostream& out);

  Workload& w;
  TrainOptions o;
  std::ostream& out;
  bool primary = true;              // rank 0: writes the log, the report, saved state
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

  int64_t resident_bytes = 0;       // counted by the budget, outside the tracker (caller's data)
  int64_t start_step = 0;
  nlohmann::json resumed_meta;      // null unless resumed
  std::optional<Planner> planner;
  Plan plan;
  int64_t budget = 0;
  std::unique_ptr<GradScaler> scaler;
  std::unique_ptr<SplitRecovery> recovery;

  std::unique_ptr<JsonLog> log;
  LeakDetector leaks;
  TrainSummary summary;
  RankStateBytes own_state;         // measured at the last optimizer step
  nlohmann::json steps_json = nlohmann::json::array();
  nlohmann::json last_step_doc;     // the last step, analysed for the HTML report
  TrainClock::time_point run_start;

  bool sharded_optimizer() const { return sdp && sdp->zero_stage() > 0; }
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
