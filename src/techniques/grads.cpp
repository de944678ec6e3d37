#include "memfit/techniques/grads.h"

namespace memfit {

void zero_grad(const std::vector<at::Tensor>& parameters, bool set_to_none) {
  for (const at::Tensor& p : parameters) {
    at::Tensor& g = const_cast<at::Tensor&>(p).mutable_grad();
    if (!g.defined()) continue;
    if (set_to_none) {
      g.reset();
    } else {
      if (g.grad_fn()) g = g.detach();
      g.requires_grad_(false);
      g.zero_();
    }
  }
}

void zero_grad(torch::optim::Optimizer& optimizer, bool set_to_none) {
  for (auto& group : optimizer.param_groups()) zero_grad(group.params(), set_to_none);
}

int64_t gradient_bytes(const std::vector<at::Tensor>& parameters) {
  int64_t total = 0;
  for (const at::Tensor& p : parameters) {
    if (p.grad().defined()) total += p.grad().storage().nbytes();
  }
  return total;
}

}  // namespace memfit
