#include "memfit/plan/partwise.h"

#include <optional>

#include <torch/torch.h>

#include "memfit/runtime/step.h"
#include "memfit/techniques/rng.h"

namespace memfit {

ChainParts::ChainParts(Workload& workload, Batch batch) : workload_(workload), batch_(std::move(batch)) {
  // Which blocks write into their input decides what a run copies (the batch is the caller's):
  // known before the first run.
  RngScope rng(batch_.input.device());
  workload_.chain->learn_input_writes(batch_.input);
}

int ChainParts::parts() const { return workload_.chain->size(); }

std::string ChainParts::part_name(int part) const { return workload_.chain->describe_block(part); }

int64_t ChainParts::input_copy_bytes(int part, const at::Tensor& input) const {
  return workload_.chain->may_write_input(part) && input.defined() ? static_cast<int64_t>(input.nbytes()) : 0;
}

std::vector<at::Tensor> ChainParts::parameters() const {
  std::vector<at::Tensor> out;
  for (const auto& p : workload_.chain->parameters()) {
    if (p.requires_grad()) out.push_back(p);
  }
  return out;
}

int64_t ChainParts::weight_bytes() const { return parameter_bytes(*workload_.chain); }

at::Tensor ChainParts::forward(const PartRun& run, PartObserver* observer) {
  Chain& chain = *workload_.chain;
  // Block 0's part starts with the run; the others as the chain reaches them.
  if (observer != nullptr) {
    chain.set_block_start([observer](int index, const at::Tensor& input) {
      if (index > 0) observer->enter(index, input);
    });
  }
  struct ClearBlockStart {
    Chain& chain;
    ~ClearBlockStart() { chain.set_block_start({}); }
  } clear{chain};
  StepConfig config;
  config.precision = run.precision;
  // A chain has no code between its blocks: the whole forward runs without grad.
  std::optional<at::NoGradGuard> no_grad;
  if (run.blocks_without_grad) no_grad.emplace();
  return forward_loss(workload_, batch_.slice(0, run.samples), config, run.recompute_all);
}

}  // namespace memfit
