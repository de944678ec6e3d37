// rank_states.h — each data-parallel rank's share of the training state at ZeRO stages 0-2,
// predicted from the parameters alone (no process group needed): what `memfit report
// --world-size N --zero S` shows, and what each rank of `memfit train` plans with.
//
// Parameters are partitioned in order into contiguous ranges balanced by bytes; a rank steps
// (and keeps optimizer state for) its own range at stages 1 and 2, and at stage 2 keeps only
// its range's gradients at the optimizer step.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <vector>

namespace memfit {

// The owner of each parameter: a parameter goes to the rank whose equal share of the total
// bytes holds its middle byte. Throws OptionError unless world_size >= 1.
std::vector<int> partition_by_bytes(const std::vector<at::Tensor>& parameters, int world_size);

// Bytes of the training state on one rank at the optimizer step.
struct RankStateBytes {
  int64_t weights = 0;
  int64_t gradients = 0;        // after the reduction
  int64_t optimizer_state = 0;
};

// Every rank's state bytes at `zero_stage` over `world_size` ranks. optimizer_state_per_byte:
// the optimizer's state bytes per parameter byte (AdamW 2, SGD with momentum 1, plain SGD 0;
// measured: profile.h's measure_optimizer over all parameters, divided by their bytes).
// Throws OptionError for a stage other than 0, 1, 2 or a world size below 1.
std::vector<RankStateBytes> predicted_rank_states(const std::vector<at::Tensor>& parameters, int world_size,
                                                  int zero_stage, double optimizer_state_per_byte);

}  // namespace memfit
