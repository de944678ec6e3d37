// events.h — what a Trainer tells its observers as it runs. The Trainer prints nothing itself:
// the CLI renders these events as text (src/cli/train_output.cpp), the JSON-lines log writes
// them as lines, and a caller may add observers of its own (Trainer::add_observer).
//
//   struct Losses : memfit::TrainObserver {
//     void on_step(const memfit::StepEvent& e) override { std::cout << e.step << " " << e.loss << "\n"; }
//   };
//   Losses losses;
//   trainer.add_observer(losses);
//
// Every event comes on the thread that runs the Trainer, on every rank (rank 0's are the ones
// a front end shows: StartEvent::primary).
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "memfit/plan/planner.h"

namespace memfit {

struct TrainSummary;  // trainer.h

// Before planning: what is trained, and how.
struct StartEvent {
  std::string description;         // the workload's
  int64_t parameters = 0;          // of the whole model
  int64_t parameter_bytes = 0;
  int64_t batch = 0;               // samples per step over all ranks
  int64_t local_start = 0;         // this rank's samples of each batch: [local_start, +local_length)
  int64_t local_length = 0;
  std::string optimizer;           // OptimizerSpec::describe()
  int threads = 0;                 // LibTorch's
  std::string device;
  std::string strategy;            // Strategy::describe(): "" for one process
  std::vector<std::string> notes;  // the workload's
  bool primary = true;             // rank 0
  int64_t steps = 0;               // the step training ends after
};

// The plan chosen (or resumed), before the first step.
struct PlanEvent {
  const Plan& plan;
  const std::vector<std::string>& block_names;
  double planning_seconds = 0;     // profiling (or reading the cache) and the search
  bool profile_cached = false;     // the measurements came from the profile cache
  bool profile_stored = false;     // they are kept there for the next run
};

// After each optimizer step.
struct StepEvent {
  int64_t step = 0;                // from 1
  int64_t first_step = 1;          // of this run (after a resume: the step after the saved one)
  int64_t last_step = 0;           // training ends after it
  double loss = 0;                 // mean over the global batch
  int64_t samples = 0;             // of the step, over all ranks
  int64_t tokens_per_sample = 1;   // what a sample holds (a sequence: this batch's length)
  int64_t micro_batch = 0;         // this rank's samples per forward + backward, chosen for this batch
  int64_t recomputed_blocks = 0;   // blocks recomputed in this step's backward (as chosen for it)
  double seconds = 0;
  int64_t live_bytes = 0;          // tracked bytes after the step
  int64_t peak_bytes = 0;          // the step's peak, bytes the budget counts outside the tracker included
  int64_t host_peak_bytes = 0;     // the step's peak in the host space (offloaded bytes)
  int64_t budget_bytes = 0;
  int64_t oom_recoveries = 0;      // in the run so far
  std::optional<double> eval_loss; // held-out loss, when evaluated after this step
};

// A held-out evaluation.
struct EvalEvent {
  int64_t step = 0;
  double loss = 0;
};

// State saved (after `step`) into `dir`.
struct SaveEvent {
  int64_t step = 0;
  std::string dir;
  bool model_file = false;         // the trained model was written too (dir/model.pt)
};

class TrainObserver {
 public:
  virtual ~TrainObserver() = default;
  virtual void on_start(const StartEvent& event) {}
  virtual void on_plan(const PlanEvent& event) {}
  virtual void on_step(const StepEvent& event) {}
  virtual void on_eval(const EvalEvent& event) {}
  virtual void on_save(const SaveEvent& event) {}
  // Something the user should know, in a sentence: a re-plan, an out-of-memory error recovered,
  // a leak suspected, a resume, a stop on request.
  virtual void on_note(const std::string& note) {}
  virtual void on_summary(const TrainSummary& summary) {}
};

}  // namespace memfit
