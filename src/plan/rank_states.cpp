#include "memfit/plan/rank_states.h"

#include <algorithm>
#include <cmath>

#include "memfit/errors.h"

namespace memfit {

std::vector<int> partition_by_bytes(const std::vector<at::Tensor>& parameters, int world_size) {
  check_option(world_size >= 1, "world_size", world_size, "expected >= 1");
  double total = 0;
  for (const auto& p : parameters) total += static_cast<double>(p.nbytes());
  std::vector<int> owner;
  double before = 0;
  for (const auto& p : parameters) {
    const double bytes = static_cast<double>(p.nbytes());
    const double middle = before + bytes / 2;
    const int r = total > 0 ? static_cast<int>(middle * world_size / total) : 0;
    owner.push_back(std::min(r, world_size - 1));
    before += bytes;
  }
  return owner;
}

int64_t shard_numel(int64_t numel, int world_size) {
  check_option(world_size >= 1, "world_size", world_size, "expected >= 1");
  return (numel + world_size - 1) / world_size;
}

FlatLayout flat_layout(const std::vector<at::Tensor>& params) {
  FlatLayout layout;
  for (const auto& p : params) {
    const auto step = std::max<int64_t>(1, kFlatAlignmentBytes / static_cast<int64_t>(p.element_size()));
    const int64_t offset = (layout.numel + step - 1) / step * step;
    layout.offsets.push_back(offset);
    layout.numel = offset + p.numel();
  }
  return layout;
}

std::vector<GatheredBlockBytes> gathered_block_bytes(const std::vector<std::vector<at::Tensor>>& blocks, int world_size) {
  std::vector<GatheredBlockBytes> out;
  for (const auto& params : blocks) {
    const int64_t element = params.empty() ? 0 : static_cast<int64_t>(params.front().element_size());
    const int64_t numel = flat_layout(params).numel;
    const int64_t shard = shard_numel(numel, world_size) * element;
    out.push_back({numel * element, shard, world_size * shard});
  }
  return out;
}

namespace {

// Stage 3: every rank holds its padded piece of every block.
std::vector<RankStateBytes> zero3_rank_states(const std::vector<at::Tensor>& parameters, int world_size,
                                              double optimizer_state_per_byte, const std::vector<int>& block_of_parameter) {
  std::vector<std::vector<at::Tensor>> blocks;
  for (size_t i = 0; i < parameters.size(); ++i) {
    const bool new_block = blocks.empty() || block_of_parameter.empty() || block_of_parameter[i] != block_of_parameter[i - 1];
    if (new_block) blocks.emplace_back();
    blocks.back().push_back(parameters[i]);
  }
  int64_t shard = 0;
  for (const auto& b : gathered_block_bytes(blocks, world_size)) shard += b.shard;
  RankStateBytes r;
  r.weights = shard;
  r.gradients = shard;
  r.optimizer_state = std::llround(optimizer_state_per_byte * static_cast<double>(shard));
  return std::vector<RankStateBytes>(static_cast<size_t>(world_size), r);
}

}  // namespace

std::vector<RankStateBytes> predicted_rank_states(const std::vector<at::Tensor>& parameters, int world_size,
                                                  int zero_stage, double optimizer_state_per_byte,
                                                  const std::vector<int>& block_of_parameter) {
  check_option(zero_stage >= 0 && zero_stage <= 3, "zero_stage", zero_stage, "expected 0, 1, 2 or 3");
  check_option(block_of_parameter.empty() || block_of_parameter.size() == parameters.size(), "block_of_parameter",
               block_of_parameter.size(), "expected one block index per parameter (" + std::to_string(parameters.size()) + ")");
  if (zero_stage == 3) return zero3_rank_states(parameters, world_size, optimizer_state_per_byte, block_of_parameter);
  const std::vector<int> owner = partition_by_bytes(parameters, world_size);
  int64_t total = 0;
  std::vector<int64_t> owned(static_cast<size_t>(world_size), 0);
  for (size_t i = 0; i < parameters.size(); ++i) {
    total += static_cast<int64_t>(parameters[i].nbytes());
    owned[static_cast<size_t>(owner[i])] += static_cast<int64_t>(parameters[i].nbytes());
  }
  std::vector<RankStateBytes> ranks;
  for (int r = 0; r < world_size; ++r) {
    const int64_t mine = owned[static_cast<size_t>(r)];
    RankStateBytes b;
    b.weights = total;  // every rank holds all weights (ZeRO 3 shards them too: above)
    b.gradients = zero_stage == 2 ? mine : total;
    const int64_t stepped = zero_stage == 0 ? total : mine;
    b.optimizer_state = std::llround(optimizer_state_per_byte * static_cast<double>(stepped));
    ranks.push_back(b);
  }
  return ranks;
}

nlohmann::json ranks_json(const std::vector<RankStateBytes>& ranks) {
  nlohmann::json a = nlohmann::json::array();
  for (size_t r = 0; r < ranks.size(); ++r) {
    a.push_back({{"rank", static_cast<int>(r)}, {"weights", ranks[r].weights}, {"gradients", ranks[r].gradients},
                 {"optimizer_state", ranks[r].optimizer_state}});
  }
  return a;
}

}  // namespace memfit
