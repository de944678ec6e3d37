#include "memfit/train/single_process.h"

#include <torch/torch.h>

#include "memfit/train/saved_state.h"

namespace memfit {

SingleProcess::SingleProcess(Chain& chain) : Strategy(std::make_unique<ProcessGroup>(), chain) {}

void SingleProcess::save(const SaveRequest& r) { save_state(r.dir, chain_, r.optimizer, r.spec, r.meta, r.device); }

void SingleProcess::resume(SavedState& saved, torch::optim::Optimizer& optimizer, const OptimizerSpec& spec,
                           c10::Device device) {
  saved.load_into(chain_, optimizer, spec, device);
}

std::string SingleProcess::weights_sha256(const std::string& dump_path) {
  dump_weights(dump_path, chain_.parameters());
  return memfit::weights_sha256(chain_);
}

StrategyEntry single_process_entry() {
  return {"single process", [](const DistributedOptions& o) { return !o.enabled(); }, nullptr,
          [](const DistributedOptions&, Chain& chain) -> std::unique_ptr<Strategy> {
            return std::make_unique<SingleProcess>(chain);
          }};
}

}  // namespace memfit
