// flags.h — the flags shared by `memfit report`, `plan` and `train`, declared once, and how
// library errors are said in flag names.
#pragma once

#include <CLI/CLI.hpp>

#include <optional>
#include <string>

#include "memfit/memfit.h"
#include "memfit/zoo/workloads.h"

namespace memfit::cli {

// The model, its shape and data: how the built-in workload is made.
struct WorkloadFlags {
  ModelOptions model;
  std::string loss = "cross-entropy";  // a TorchScript model's loss: cross-entropy | mse | model
  std::optional<int64_t> layers;  // gpt: transformer layers; mlp: hidden layers (unset: the model's default)
  int threads = 0;     // LibTorch threads (0: all cores)
};

// The step: batch and the techniques, and the optimizer.
struct StepFlags {
  int64_t batch = 16;
  int64_t micro_batch = 0;
  std::string precision;   // report: fp32; plan and train: auto
  std::string checkpoint;  // report: none; plan and train: auto
  bool keep_grads = false;
  std::string device = "cpu";
  std::string optimizer = "adamw";
  double lr = 1e-3;
  double momentum = 0;
  std::optional<double> weight_decay;
  bool large_weight_decay = false;  // accept --weight-decay >= 1
  std::string betas = "0.9,0.999";
  std::string optimizer_state;  // plan and train: auto (8bit | fp32); report: fp32 (| 8bit)
  std::string profile_cache;  // plan and train: a directory, or none ("": the default one)
  bool replan = false;        // plan and train: measure even when the cache holds the measurements
};

// --profile-cache and --replan as the library's options (the default directory unless given).
ProfileCacheOptions profile_cache_options(const StepFlags& flags);

void add_workload_flags(CLI::App& app, WorkloadFlags& flags);
// `planned`: plan and train, whose precision and checkpoint default to auto (chosen).
void add_step_flags(CLI::App& app, StepFlags& flags, bool planned);

// Applies --threads and --layers, then builds the workload: a built-in one (seeded), or the
// user's TorchScript file with its --data file and --loss.
Workload build_workload(WorkloadFlags& flags);
c10::Device parse_device(const std::string& text);
OptimizerSpec optimizer_spec(const StepFlags& flags);
// The step's fixed configuration: batch, micro-batch, set_to_none, optimizer, device; for
// `report` also the precision and checkpoint (plan and train leave them to the planner).
StepConfig step_config(const StepFlags& flags, int blocks);
// "auto" -> unset; anything else parsed against the chain.
std::optional<CheckpointPlan> pinned_checkpoint(const std::string& spec, int blocks);

// An OptionError said with the CLI's flag name: "invalid --micro-batch 32: expected ...".
std::string flag_message(const OptionError& error);
// A library message or note with each backquoted option name (errors.h) said as its flag:
// "`precision` fp32 forbids it" -> "--precision fp32 forbids it".
std::string in_flag_terms(const std::string& text);

}  // namespace memfit::cli
