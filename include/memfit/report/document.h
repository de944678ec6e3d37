// document.h — what the HTML report draws, as one value: an analysed step (its timeline by
// category, phases, per-block activations) and what a run adds (the plan, the steps, the
// ranks). `memfit report` fills one from its Report, `memfit train` from its run; to_json() is
// the one JSON form render_html_report reads (html_report.h lists its fields).
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "memfit/measure/breakdown.h"
#include "memfit/measure/cuda_reserved.h"
#include "memfit/plan/rank_states.h"
#include "memfit/runtime/step_config.h"

namespace memfit {

// One point of a run's steps chart.
struct StepPoint {
  int64_t step = 0;
  double loss = 0;
  int64_t live_bytes = 0;
  int64_t peak_bytes = 0;
  std::optional<double> eval_loss;  // held-out loss, when evaluated after this step
};

struct ReportDocument {
  std::string title;
  std::string device;
  std::optional<int64_t> budget_bytes;     // drawn as a line
  std::optional<StepAnalysis> step;        // the analysed step (none: a run stopped before its last step)
  std::vector<std::string> block_names;    // one per block of the chain
  std::vector<bool> block_recomputed;
  std::vector<std::pair<std::string, std::string>> plan_rows;  // label, value
  std::optional<StepConfig> plan_config;
  std::vector<RankStateBytes> ranks;       // by rank; drawn when there are several
  int zero_stage = 0;
  int64_t largest_gathered_block_bytes = 0;  // ZeRO 3: one block's weights in full, beside the shards
  std::vector<StepPoint> steps;            // a run's steps chart
  // What the step would reserve on a CUDA device (cuda_reserved.h): drawn as a line beside the
  // allocated bytes where its series matches the step's timeline.
  CudaReservedPrediction cuda_reserved;

  nlohmann::json to_json() const;
};

}  // namespace memfit
