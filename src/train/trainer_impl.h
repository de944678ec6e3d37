// trainer_impl.h — the Trainer's parts. Private to src/train.
//
//   TrainingMemory   the budget allocator, this thread's tracker, the budget once enforced
//   Strategy         how parameters, gradients and optimizer state are held (strategy.h)
//   TrainOptimizer   the optimizer and the spec it was built from (state precision resolved)
//   TrainPlan        the plan job, the budget and the plan that runs (trainer_plan.cpp)
//   StepRecovery     the loss scaler and out-of-memory recovery of each step
//   RunRecord        what the run has done: summary, steps chart, leak watch (run_record.cpp)
//   Observers        where events go (events.h): the caller's, the JSON log
#pragma once

#include <chrono>
#include <fstream>
#include <memory>
#include <optional>
#include <vector>

#include "memfit/measure/budget_allocator.h"
#include "memfit/measure/cuda_budget.h"
#include "memfit/measure/memory_tracker.h"
#include "memfit/plan/job.h"
#include "memfit/report/document.h"
#include "memfit/techniques/grad_scaler.h"
#include "memfit/techniques/metrics.h"
#include "memfit/techniques/rng.h"
#include "memfit/runtime/oom_recovery.h"
#include "memfit/train/saved_state.h"
#include "memfit/train/strategy.h"
#include "memfit/train/trainer.h"

namespace memfit {

using TrainClock = std::chrono::steady_clock;

// The budget is the device's: on the CPU memfit's BudgetAllocator enforces it; on CUDA the
// caching allocator's memory fraction caps reserved bytes, and memory outside the allocator
// (the context, cuBLAS) is measured first and counts against it.
struct TrainingMemory {
  explicit TrainingMemory(c10::Device device);
  // From now until the Trainer goes, allocations past `budget` fail as out of memory.
  void enforce(int64_t budget);

  c10::Device device;
  BudgetAllocator& allocator;
  std::shared_ptr<MemoryTracker> tracker;
  TrackerScope scope;
  OutsideMemory outside;              // CUDA: outside the caching allocator (zeros on the CPU)
  std::optional<BudgetGuard> budget;  // CPU
  std::optional<CudaMemoryFractionGuard> cuda_cap;  // CUDA
  int64_t resident_bytes = 0;         // counted by the budget, outside the tracker (the caller's data)
  int cuda_index() const { return device.has_index() ? device.index() : 0; }
  // The tracker's counted device for this device (memory_device_of): every count the run reads.
  MemoryDevice counted() const { return memory_device_of(device); }
  // Bytes the budget counts at the last step's peak.
  int64_t step_peak() const { return tracker->peak(counted()) + resident_bytes; }
};

struct TrainOptimizer {
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  OptimizerSpec spec;  // what `optimizer` was built with: the options' spec, state resolved
  // Builds it afresh over `params` with `state` precision (the old state is released first).
  void build(const OptimizerSpec& asked, StatePrecision state, const std::vector<at::Tensor>& params);
  int64_t skipped_updates() const;  // by the 8-bit optimizer (none otherwise)
};

struct TrainPlan {
  std::optional<PlanJob> job;
  std::vector<std::string> notes;  // what the request left out (set_up_plan)
  Plan plan;
  // Each batch planned from its shape before it runs (one process): until a real out-of-memory
  // error, after which the steps run what worked (`plan`, lowered).
  std::optional<ShapePlanner> shapes;
  bool after_oom = false;
  StepConfig last_step;          // what the last step ran (the plan's, or its batch's shape's)
  int64_t last_step_length = 0;  // that step's batch length (0: none)
  int64_t budget = 0;
  double seconds = 0;  // planning took
};

struct StepRecovery {
  std::unique_ptr<GradScaler> scaler;    // fp16 only
  std::unique_ptr<SplitRecovery> split;
  int64_t eval_micro_batch = 1;          // the plan's, or what completed after a real out-of-memory error
  int64_t eval_recoveries = 0;
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
  std::vector<StepPoint> points() const;  // the kept points, and the last step always

 private:
  std::vector<StepPoint> points_;
  StepPoint last_;
  int64_t stride_ = 1;
};

struct RunRecord {
  TrainSummary summary;
  StepHistory history;
  LeakDetector leaks;
  RankStateBytes own_state;                   // this rank's, measured at the last optimizer step
  std::optional<StepAnalysis> last_step;      // analysed for the HTML report
  std::optional<StepAnalysis> last_host_step; // the same in the host space, when offloading
  int64_t start_step = 0;                     // a resumed run continues after it
  int64_t last_saved_step = -1;
  bool model_file_note = false;               // "no model file" said once
  std::optional<SavedMeta> resumed;           // the saved run's meta, when resumed
  TrainClock::time_point run_start;
};

// The events' fan-out: the caller's observers in order, then the JSON log.
class Observers : public TrainObserver {
 public:
  void add(TrainObserver& observer) { observers_.push_back(&observer); }
  void on_start(const StartEvent& e) override;
  void on_plan(const PlanEvent& e) override;
  void on_step(const StepEvent& e) override;
  void on_eval(const EvalEvent& e) override;
  void on_save(const SaveEvent& e) override;
  void on_note(const std::string& note) override;
  void on_summary(const TrainSummary& s) override;

 private:
  std::vector<TrainObserver*> observers_;
};

// The JSON-lines log: written to FILE.tmp and renamed to FILE when the run's summary is in it,
// so an interrupted run leaves no half-written log.
class JsonLog : public TrainObserver {
 public:
  explicit JsonLog(const std::string& path);
  ~JsonLog() override;
  void on_plan(const PlanEvent& e) override;
  void on_step(const StepEvent& e) override;
  void on_note(const std::string& note) override;
  void on_summary(const TrainSummary& s) override;

 private:
  void write(const nlohmann::json& line);
  std::string path_, tmp_;
  std::ofstream out_;
};

struct Trainer::Impl {
  Impl(Workload& workload, TrainOptions options);

  Workload& workload;
  TrainOptions options;
  Observers observers;
  std::unique_ptr<JsonLog> json_log;
  std::unique_ptr<TrainingMemory> memory;
  std::unique_ptr<Strategy> strategy;
  BatchSlice local;                  // this rank's samples of each batch
  TrainOptimizer optimizer;
  TrainPlan plan;
  StepRecovery recovery;
  RunRecord record;
  int64_t parameter_count = 0;       // of the whole model (counted before a strategy shards it)
  int64_t parameter_bytes = 0;
  std::string dump_weights;          // Trainer::dump_weights_at_summary ("": none)

  // Where the Trainer is in its parts (trainer.h): each part needs the ones before it.
  enum class Stage { kCreated, kSetUp, kPlanned };
  Stage stage = Stage::kCreated;
  // Throws (naming `part`, and what to call first) unless the Trainer is at `needed`.
  void require(Stage needed, const char* part) const;
  Batch local_batch(int64_t index) const;  // this rank's part of training batch `index`, on the device
  Batch local_plan_batch(int64_t index) const;  // the same of the batch a plan is made on (Dataset::plan_batch)
  StepOptions step_options() const { return step_options(plan.plan.config); }
  StepOptions step_options(const StepConfig& config) const;
  StepConfig config_for(const Batch& batch);  // the plan's, or the batch's shape's
  StartEvent start_event() const;

  // trainer_plan.cpp
  void make_plan_job();
  void choose_plan();
  void make_shape_planner();
  void adopt_rank0_plan();
  void prepare_steps();

  // trainer.cpp
  void resume();
  StepResult accumulate(int64_t step, const Batch& batch);
  void update(bool last_step);
  void replan_after_oom(int64_t smallest_ok);
  void record_step(int64_t step, double loss, double seconds);
  double evaluate();
  double evaluate_batch(const Batch& batch);  // its mean loss
  void save(int64_t step);
  [[noreturn]] void stop_on_nonfinite_loss(int64_t step, double loss, const RngState& rng_at_start);

  // run_record.cpp
  void write_report();
  ReportDocument report_document() const;
};

}  // namespace memfit
