// plan_request.h — what the planner (planner.h) is asked: the budget, the step's fixed parts,
// this process's measured optimizer costs, and what a plan may choose beyond precision,
// micro-batch and schedule: the optimizer's state precision and placement (offload), saved
// activations on the host, ZeRO 3's gathered blocks and prefetch depths. The `offload` and
// `precision` options turned into it.
#pragma once

#include <c10/core/DeviceType.h>

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "memfit/plan/plan.h"  // kPlanMargin
#include "memfit/plan/profile.h"
#include "memfit/plan/rank_states.h"
#include "memfit/runtime/step_config.h"

namespace memfit {

struct PlanRequest {
  int64_t budget_bytes = 0;
  // The fixed parts of the step: device, batch (this rank's samples per step), set_to_none,
  // optimizer; micro_batch > 0 pins it (0: searched). Precision and checkpoint are chosen.
  StepConfig step;
  std::optional<CheckpointPlan> checkpoint;  // pinned schedule; unset: solved
  double margin = kPlanMargin;               // of the budget, kept free for what the model cannot see
  OptimizerCost optimizer;                   // this process's (ZeRO: its shard's); state auto: fp32's
  // Other state precisions the plan may choose instead (state auto: the 8-bit state's cost).
  std::vector<OptimizerCost> optimizer_alternatives;
  int64_t gradient_bytes = -1;               // held through the optimizer step; -1: all weights'
  int64_t extra_bytes = 0;                   // alive beside the optimizer step (state gathered to save)
  int64_t resident_bytes = 0;                // alive all along, counted by the budget but not profiled
                                             // (the caller's data tensors, other models)
  // On CUDA the budget is the device's: the caching allocator reserves more than it hands out, and
  // memory outside it (context, cuBLAS) counts too. A plan's allocated peak must then fit
  // (budget - outside_bytes) / reserved_per_allocated (the reserved/allocated relation a replay
  // of a recorded step gave: cuda_reserved.h); 1 and 0 on the CPU, whose allocator caches nothing.
  double reserved_per_allocated = 1.0;
  int64_t outside_bytes = 0;
  // ZeRO 3 (empty otherwise): per block, its weights in full and this rank's shard. Weights
  // and gradients held are then the shards; a block's full weights are added around its
  // forward, recompute and backward (one block at a time); every block is recomputed, so
  // `checkpoint` must be every block (the trainer pins it).
  std::vector<GatheredBlockBytes> gathered_blocks;
  // ZeRO 3: the prefetch depths a plan may use (StepConfig::prefetch_depth), in order of
  // preference; at each micro-batch the first that fits is taken. The time model does not see
  // the gathers a depth hides, so deeper is preferred where it costs no compute.
  std::vector<int> prefetch_depths{0};
  // Where the optimizer may run, in order of preference: on the device (false), offloaded to
  // the host (true: train/optimizer_offload.h). {false, true}: offload only where it pays.
  std::vector<bool> optimizer_offload{false};
  // Blocks' saved activations may go to the host (techniques/activation_offload.h): the schedule
  // then chooses per block between keeping, recomputing and offloading, by time.
  bool activation_offload = false;
  // Host <-> device copies, bytes per second: the time offloading adds (0: not counted). Measured
  // where copies are real (CUDA); on a CPU-only machine a memcpy's, a model of a real link.
  double host_copy_bytes_per_second = 0;
  int64_t host_budget_bytes = 0;  // the host bytes a plan may use (0: unlimited)
};

// What the planner may move to the host (`offload`): nothing; the optimizer; saved activations;
// both (all); or each where it pays (auto: only when the device alone does not fit, or faster).
enum class OffloadMode : uint8_t { kNone, kOptimizer, kActivations, kAll, kAuto };
// "none", "optimizer", "activations", "all", "auto"; throws OptionError("offload", ...) otherwise.
OffloadMode parse_offload_mode(const std::string& text);
const char* offload_mode_name(OffloadMode mode);
// Sets what `mode` allows into the request (optimizer_offload).
void allow_offload(PlanRequest& request, OffloadMode mode);

// "auto": fp32, then the mixed precisions autocast runs on `device` (bf16 on CPU; bf16 and
// fp16 on CUDA). Otherwise the one named, if supported. Throws OptionError("precision", ...).
std::vector<Precision> precision_candidates(const std::string& text, c10::DeviceType device);

}  // namespace memfit
