// rank_states.h — each data-parallel rank's share of the training state at ZeRO stages 0-3,
// predicted from the parameters alone (no process group needed): what `memfit report
// --world-size N --zero S` shows, and what each rank of `memfit train` plans with.
//
// Parameters are partitioned in order into contiguous ranges balanced by bytes; a rank steps
// (and keeps optimizer state for) its own range at stages 1 and 2, and at stage 2 keeps only
// its range's gradients at the optimizer step. At stage 3 each block's parameters are laid
// out flat (each parameter from a 64-byte boundary), padded to a multiple of the world size,
// and every rank keeps an equal piece of each block (weights, gradients and optimizer state):
// ~1/N of each, per rank.
#pragma once

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <vector>

namespace memfit {

// The owner of each parameter: a parameter goes to the rank whose equal share of the total
// bytes holds its middle byte. Throws OptionError unless world_size >= 1.
std::vector<int> partition_by_bytes(const std::vector<at::Tensor>& parameters, int world_size);

// ZeRO 3: one block's parameter bytes in full (gathered around its forward and backward) and
// each rank's piece of them.
struct GatheredBlockBytes {
  int64_t full = 0;    // the flat layout's bytes (flat_layout: the alignment gaps included)
  int64_t shard = 0;
  int64_t pieces = 0;  // N x shard: its gradients' pieces an owner sums (reduction in flight)
};
// Elements per rank of a block of `numel` elements over `world_size` ranks (padded).
int64_t shard_numel(int64_t numel, int world_size);

// ZeRO 3's flat layout of one block's parameters: each starts on a 64-byte boundary, as a
// tensor allocated on its own does, because BLAS kernels (MKL's among them) round
// differently on differently aligned operands: a gathered weight must give the bits the
// one-process weight gives.
struct FlatLayout {
  std::vector<int64_t> offsets;  // each parameter's first element
  int64_t numel = 0;             // up to the last parameter's end, the gaps included
};
constexpr int64_t kFlatAlignmentBytes = 64;
FlatLayout flat_layout(const std::vector<at::Tensor>& params);

// Bytes of the training state on one rank at the optimizer step.
struct RankStateBytes {
  int64_t weights = 0;
  int64_t gradients = 0;        // after the reduction
  int64_t optimizer_state = 0;
};

// Every rank's state bytes at `zero_stage` over `world_size` ranks. optimizer_state_per_byte:
// the optimizer's state bytes per parameter byte (AdamW 2, SGD with momentum 1, plain SGD 0;
// measured: profile.h's measure_optimizer over all parameters, divided by their bytes).
// block_of_parameter (stage 3): each parameter's block, non-decreasing; empty: each
// parameter its own block. Throws OptionError for a stage outside 0-3 or a world size below 1.
std::vector<RankStateBytes> predicted_rank_states(const std::vector<at::Tensor>& parameters, int world_size,
                                                  int zero_stage, double optimizer_state_per_byte,
                                                  const std::vector<int>& block_of_parameter = {});

// The one JSON form of every rank's state bytes: [{"rank", "weights", "gradients",
// "optimizer_state"}, ...] in rank order (reports, summaries, the HTML report).
nlohmann::json ranks_json(const std::vector<RankStateBytes>& ranks);

// ZeRO 3: per block of `blocks` (each block's parameters), its bytes in full and per rank.
std::vector<GatheredBlockBytes> gathered_block_bytes(const std::vector<std::vector<at::Tensor>>& blocks, int world_size);

}  // namespace memfit
