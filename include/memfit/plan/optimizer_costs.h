// optimizer_costs.h — what the optimizer keeps and makes, measured by one rule whoever steps it
// (a C++ torch::optim optimizer, or the Python package's copy of the user's), and what the
// planner is given of it.
#pragma once

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <vector>

#include "memfit/measure/memory_tracker.h"
#include "memfit/runtime/optimizer.h"

namespace memfit {

// What the optimizer keeps and makes, on this process, with one state precision.
struct OptimizerCost {
  int64_t state_bytes = 0;  // alive between steps (AdamW: 2x the parameters' bytes; 8-bit: ~0.5x,
                            // plus its maps, made once per process: techniques/optimizer_8bit.h)
  int64_t step_bytes = 0;   // temporaries at the peak of a steady-state step, above the state
  double seconds = 0;       // one steady-state step (0: not measured)
  StatePrecision state = StatePrecision::kFP32;  // fp32 or 8bit, never auto
  // Where the planner places it (not measured, not in the cache's JSON): on the host, the state,
  // the step, fp32 masters and the gradients are host bytes (train/optimizer_offload.h).
  bool on_host = false;
};

// Three real steps of `spec` over `parameters` (zero gradients), the first making the state,
// the others in steady state (bytes; seconds: the best of the two); the parameters are put back
// exactly afterwards. A spec with state auto is measured as fp32.
OptimizerCost measure_optimizer(const OptimizerSpec& spec, const std::vector<at::Tensor>& parameters,
                                MemoryTracker& tracker);

// The one rule by which an optimizer's costs are measured, whoever steps it (the C++ optimizers
// above; the Python package's copy of the user's optimizer): `step` runs one step over
// parameters with zero gradients; the first makes the state (state_bytes: what it left alive on
// `device`), two more run in steady state (step_bytes: their temporaries above the state;
// seconds: the faster). The 8-bit state's dynamic maps are made by the first 8-bit step in a
// process and kept for its life: counted here when this first step made them, as resident bytes
// (alive before the step, like the weights) once they exist.
OptimizerCost measure_optimizer_steps(const std::function<void()>& step, StatePrecision state, MemoryTracker& tracker,
                                      MemoryDevice device);

// The costs the planner chooses among: the spec's state precision alone, or with auto fp32 and
// then (Adam, AdamW) 8-bit.
std::vector<OptimizerCost> measure_optimizer_states(const OptimizerSpec& spec, const std::vector<at::Tensor>& parameters,
                                                    MemoryTracker& tracker);

// Its JSON form in the profile cache (profile_json.cpp); the reader throws std::invalid_argument
// naming the first bad field.
nlohmann::json optimizer_cost_json(const OptimizerCost& cost);
OptimizerCost optimizer_cost_from_json(const nlohmann::json& j);

}  // namespace memfit
