#include "memfit/runtime/workload.h"

#include <torch/nn/module.h>

#include <unordered_set>

#include "memfit/errors.h"

namespace memfit {

void check_workload(const Workload& w) {
  check_option(w.chain != nullptr && w.chain->size() >= 1, "workload.chain", w.chain ? w.chain->size() : 0,
               "expected a Chain of at least one block");
  check_option(w.data != nullptr, "workload.data", "(none)", "expected a Dataset");
  check_option(static_cast<bool>(w.loss), "workload.loss", "(none)", "expected a loss function");
}

namespace {

// Each parameter once: a tensor two submodules hold (tied weights) is one parameter.
std::vector<at::Tensor> distinct_parameters(const torch::nn::Module& module) {
  std::vector<at::Tensor> out;
  std::unordered_set<const c10::TensorImpl*> seen;
  for (const auto& p : module.parameters()) {
    if (seen.insert(p.unsafeGetTensorImpl()).second) out.push_back(p);
  }
  return out;
}

}  // namespace

int64_t parameter_count(const torch::nn::Module& module) {
  int64_t n = 0;
  for (const auto& p : distinct_parameters(module)) n += p.numel();
  return n;
}

int64_t parameter_bytes(const torch::nn::Module& module) {
  int64_t n = 0;
  // Each parameter's own bytes (ZeRO 3 gathers a block's parameters as views of one buffer).
  for (const auto& p : distinct_parameters(module)) n += static_cast<int64_t>(p.nbytes());
  return n;
}

}  // namespace memfit
