// strategy_registry.h — which Strategy runs for the options given, and what each refuses.
//
// Every strategy file declares its entry (single_process.h, zero_replicated.h, zero_sharded.h);
// strategy_registry.cpp lists them, most specific first. An entry says which options select it,
// checks the options only it cares about (before any work), and makes it. The base class
// (strategy.h) knows none of them.
#pragma once

#include <memory>
#include <vector>

#include "memfit/runtime/step_config.h"
#include "memfit/train/strategy.h"

namespace memfit {

// What a strategy's check looks at: the distributed options, the step asked for, which parts of
// it the user pinned (the rest is planned), how saved state is used, and the chain's blocks.
struct StrategyAsk {
  const DistributedOptions& distributed;
  const StepConfig& step;
  bool precision_pinned = false;
  bool checkpoint_pinned = false;
  StateUse state;
  OffloadMode offload = OffloadMode::kNone;  // what the plan may move to the host
  int blocks = 0;
};

struct StrategyEntry {
  const char* name;  // in messages and tests: "single process", "ZeRO 0-2", "ZeRO 3"
  bool (*selects)(const DistributedOptions& options);
  // Throws OptionError where this strategy cannot run what is asked; nullptr: accepts anything.
  void (*check)(const StrategyAsk& ask);
  // Joins the ranks (where the strategy has several) and makes it over `chain`, which must
  // outlive it.
  std::unique_ptr<Strategy> (*make)(const DistributedOptions& options, Chain& chain);
};

// Every strategy, most specific first; the first whose `selects` holds runs.
const std::vector<StrategyEntry>& strategy_registry();
const StrategyEntry& strategy_entry_for(const DistributedOptions& options);

// The strategy for `options` (validated first: a bad master fails before any work).
std::unique_ptr<Strategy> make_strategy(const DistributedOptions& options, Chain& chain);
// The options validated, then the selected strategy's check.
void check_strategy_options(const StrategyAsk& ask);

}  // namespace memfit
