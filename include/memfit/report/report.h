// report.h — `memfit report` as a library call: run a few real training steps of a workload
// under the memory tracker and explain the last one (its peak, what the peak is made of,
// per phase, per block, and the states after the optimizer).
#pragma once

#include <nlohmann/json.hpp>

#include <array>

#include <string>
#include <vector>

#include "memfit/measure/breakdown.h"
#include "memfit/measure/cuda_reserved.h"
#include "memfit/plan/rank_states.h"
#include "memfit/report/document.h"
#include "memfit/runtime/step_config.h"
#include "memfit/runtime/workload.h"

namespace memfit {

struct ReportOptions {
  StepConfig step;            // batch, micro-batch, precision, checkpoint, set_to_none, optimizer, device
  int64_t steps = 3;          // the last one is analysed (steady state: optimizer state exists)
  bool eval_only = false;     // inference only: forward passes under InferenceMode
  // Data-parallel training over world_size ranks at ZeRO zero_stage: the report adds each
  // rank's state bytes, predicted from the same partition `memfit train` uses (the step
  // itself runs in this one process).
  int world_size = 1;
  int zero_stage = 0;
};

struct Report {
  std::string model;              // the workload's name
  std::string description;
  int64_t parameters = 0;
  int64_t parameter_bytes = 0;
  int64_t batch = 0;
  ReportOptions options;
  StepAnalysis analysis;          // the last step
  Categories states;              // after backward + optimizer, before gradients are released
  int64_t between_steps_bytes = 0;  // live bytes after the last step (gradients released or not)
  std::array<int64_t, kNumPhases> phase_peak{};
  std::vector<std::string> block_names;
  std::vector<bool> block_recomputed;
  double loss = 0;
  std::vector<RankStateBytes> ranks;  // world_size entries (one when not distributed)
  // ZeRO 3: the largest block's weights, which each rank gathers in full while it runs (on
  // top of the shards above, with that block's full gradients until they are reduced).
  int64_t largest_gathered_block_bytes = 0;
  // What the run (every step, from the first) would reserve on a CUDA device; its series covers
  // the last step, one value per timeline point of `analysis`.
  CudaReservedPrediction cuda;
};

// Runs `options.steps` steps of the workload under a MemoryTracker of its own (installed on
// this thread for the call) and explains the last; the whole run's allocations are replayed on
// the CUDA caching allocator model (PYTORCH_CUDA_ALLOC_CONF is read: OptionError if malformed). The workload's weights and buffers existed
// before: they are known by their tensors, not by their allocation. Throws OptionError.
Report run_report(Workload& workload, const ReportOptions& options);

// The JSON of `memfit report --json` (bytes as integers).
nlohmann::json report_json(const Report& report);
// The HTML report's document of a report: its analysed step and per-rank state.
ReportDocument report_document(const Report& report);

}  // namespace memfit
