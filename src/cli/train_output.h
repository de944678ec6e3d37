// train_output.h — `memfit train`'s text: the Trainer's events (train/events.h) rendered on
// standard output: the header, the plan, progress lines (one updated line on a terminal, a line
// every K steps in a pipe), notes and the summary.
#pragma once

#include "memfit/memfit.h"

namespace memfit::cli {

struct ProgressOptions {
  bool show = true;        // progress lines at all
  int64_t every = 0;       // not on a terminal: a line every K steps (0: about 20 lines a run)
  bool terminal = false;   // standard output is a terminal: one line, rewritten
};

class TrainOutput : public TrainObserver {
 public:
  explicit TrainOutput(ProgressOptions progress) : progress_(progress) {}
  void on_start(const StartEvent& e) override;
  void on_plan(const PlanEvent& e) override;
  void on_step(const StepEvent& e) override;
  void on_note(const std::string& note) override;
  void on_summary(const TrainSummary& s) override;

 private:
  void end_progress_line();  // a terminal's progress line ends before other text
  ProgressOptions progress_;
  bool line_open_ = false;
  std::string unit_ = "samples";
  int64_t per_sample_ = 1;
};

}  // namespace memfit::cli
