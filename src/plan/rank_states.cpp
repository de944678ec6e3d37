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

std::vector<RankStateBytes> predicted_rank_states(const std::vector<at::Tensor>& parameters, int world_size,
                                                  int zero_stage, double optimizer_state_per_byte) {
  check_option(zero_stage >= 0 && zero_stage <= 2, "zero_stage", zero_stage, "expected 0, 1 or 2");
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
    b.weights = total;  // every rank holds all weights (ZeRO 3 would shard them too)
    b.gradients = zero_stage == 2 ? mine : total;
    const int64_t stepped = zero_stage == 0 ? total : mine;
    b.optimizer_state = std::llround(optimizer_state_per_byte * static_cast<double>(stepped));
    ranks.push_back(b);
  }
  return ranks;
}

}  // namespace memfit
