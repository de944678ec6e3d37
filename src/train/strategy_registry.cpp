// The one list of strategies. A new strategy: its entry function declared in its header, one
// line below, and a case in tests/test_strategies.cpp.
#include "memfit/train/strategy_registry.h"

#include "memfit/train/single_process.h"
#include "memfit/train/zero_replicated.h"
#include "memfit/train/zero_sharded.h"

namespace memfit {

const std::vector<StrategyEntry>& strategy_registry() {
  static const std::vector<StrategyEntry> entries = {
      single_process_entry(),
      zero_sharded_entry(),
      zero_replicated_entry(),
  };
  return entries;
}

const StrategyEntry& strategy_entry_for(const DistributedOptions& options) {
  for (const StrategyEntry& entry : strategy_registry()) {
    if (entry.selects(options)) return entry;
  }
  throw std::logic_error("no strategy selects world size " + std::to_string(options.world_size) + ", ZeRO stage " +
                         std::to_string(options.zero_stage));
}

std::unique_ptr<Strategy> make_strategy(const DistributedOptions& options, Chain& chain) {
  validate(options);
  return strategy_entry_for(options).make(options, chain);
}

void check_strategy_options(const StrategyAsk& ask) {
  validate(ask.distributed);
  const StrategyEntry& entry = strategy_entry_for(ask.distributed);
  if (entry.check != nullptr) entry.check(ask);
}

}  // namespace memfit
