// single_process.h — the strategy of one process holding the whole model, its gradients and its
// optimizer state: what `memfit train` runs without --world-size.
#pragma once

#include "memfit/train/strategy.h"
#include "memfit/train/strategy_registry.h"

namespace memfit {

class SingleProcess : public Strategy {
 public:
  explicit SingleProcess(Chain& chain);

  std::string describe() const override { return ""; }
  std::vector<at::Tensor> optimized_parameters() const override { return chain_.parameters(); }
  std::vector<at::Tensor> held_parameters() const override { return chain_.parameters(); }
  void add_to_plan_request(PlanRequest& request, const MeasuredCosts& costs, const StateUse& state) const override {}
  void save(const SaveRequest& request) override;
  void resume(SavedState& saved, torch::optim::Optimizer& optimizer, const OptimizerSpec& spec,
              c10::Device device) override;
  std::string weights_sha256(const std::string& dump_path) override;
};

// Selected for one process (world size 1); refuses nothing.
StrategyEntry single_process_entry();

}  // namespace memfit
