// step_config.h — one value for how a training step runs: the device, the precision, the
// micro-batch (and so the accumulation), which blocks are recomputed, whether gradients are
// released, and the optimizer. The planner chooses one, `memfit train` runs one, saved state
// and the plan output record one, ranks agree on one: always this value, always through the
// one JSON form below.
//
//   memfit::StepConfig c;
//   c.batch = 16; c.micro_batch = 4;                            // 4 micro-batches of 4
//   c.precision = memfit::Precision::kBF16;
//   c.checkpoint = memfit::CheckpointPlan::parse("every:2", chain->size());
//   memfit::train_step(workload, *optimizer, batch, memfit::StepOptions{c});
#pragma once

#include <c10/core/Device.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "memfit/runtime/chain.h"
#include "memfit/runtime/optimizer.h"
#include "memfit/techniques/autocast.h"

namespace memfit {

constexpr int kMaxPrefetchDepth = 2;

// What lives in the host space instead of the device's (measure/memory_space.h).
struct OffloadPlan {
  // The optimizer: its state, its step and fp32 master weights on the host, each gradient
  // streamed there as backward makes it (train/optimizer_offload.h).
  bool optimizer = false;
  // Blocks whose tensors saved for backward go to the host during their forward and come back
  // before their backward (techniques/activation_offload.h); sorted, none recomputed.
  std::vector<int> activation_blocks;

  bool any() const { return optimizer || !activation_blocks.empty(); }
  // "none", "optimizer", "activations of blocks 1,3", "optimizer, activations of blocks 0-5"
  std::string describe() const;
};

struct StepConfig {
  c10::Device device = c10::kCPU;
  int64_t batch = 1;                   // samples per optimizer step (this rank's)
  int64_t micro_batch = 0;             // samples per forward + backward; 0: the whole batch
  Precision precision = Precision::kFP32;
  CheckpointPlan checkpoint;           // blocks recomputed in backward
  bool set_to_none = true;             // gradients released after the step (else zeroed)
  OptimizerSpec optimizer;
  // ZeRO 3: how many blocks' weights are gathered ahead of the block running (0 to
  // kMaxPrefetchDepth); each costs one more gathered block's bytes and hides its gather.
  int prefetch_depth = 0;
  OffloadPlan offload;

  int64_t micro_batch_size() const { return micro_batch > 0 ? micro_batch : batch; }
  int64_t accumulation() const { return batch < 1 ? 0 : (batch - 1) / micro_batch_size() + 1; }  // no overflow
  // "micro-batch 4 x 4, bf16, recompute 1,3"
  std::string describe() const;
};

// Throws OptionError unless batch >= 1, 0 <= micro_batch <= batch, the checkpoint segments
// lie inside `blocks`, the precision runs on the device, the prefetch depth is 0 to
// kMaxPrefetchDepth, the offloaded blocks lie inside `blocks` (sorted, none recomputed), and the
// optimizer spec holds.
void check_step_config(const StepConfig& config, int blocks);

// The one JSON form (plan output, saved state, summary, HTML, the broadcast to ranks):
// {"device", "batch", "micro_batch", "accumulation", "precision", "segments",
//  "recomputed_blocks", "set_to_none", "optimizer", "prefetch_depth",
//  "offload": {"optimizer", "activation_blocks"}}. Reading checks the value against `blocks`.
nlohmann::json step_config_json(const StepConfig& config);
StepConfig step_config_from_json(const nlohmann::json& json, int blocks);

}  // namespace memfit
