// commands.h — `memfit report`, `plan` and `train`: each builds the workload from its flags,
// calls the library and prints.
#pragma once

#include <string>

#include "flags.h"

namespace memfit::cli {

struct ReportFlags {
  int64_t steps = 3;
  bool eval = false;
  bool json = false;
  std::string html;
  int world_size = 1;
  int zero_stage = 0;
};

struct PlanFlags {
  std::string budget;
  std::string offload = "none";
  std::string host_budget;
  bool json = false;
  bool verify = true;
  int verify_steps = 3;
};

struct TrainFlags {
  TrainOptions options;
  std::string budget;
  std::string inject_oom;
  std::string offload = "none";
  std::string host_budget;
  bool progress = true;
  int64_t progress_every = 0;  // not on a terminal: a line every K steps (0: about 20 lines a run)
  std::string dump_weights;    // the trained weights as raw float32, for tests (Trainer::dump_weights_at_summary)
};

int run_report_command(WorkloadFlags& workload, const StepFlags& step, const ReportFlags& flags);
int run_plan_command(WorkloadFlags& workload, const StepFlags& step, const PlanFlags& flags);
int run_train_command(WorkloadFlags& workload, const StepFlags& step, TrainFlags& flags);

}  // namespace memfit::cli
