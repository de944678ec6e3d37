// grads.h — releasing or zeroing gradients between steps (optimizer.zero_grad(set_to_none)).
//
// LibTorch 1.13's Optimizer::zero_grad() only fills gradients with zeros, keeping their
// storage (as many bytes as the parameters) alive between steps; set_to_none releases it, so
// live bytes between steps drop by exactly the gradient bytes. Works on 1.13 and 2.x alike.
#pragma once

#include <torch/optim/optimizer.h>

#include <vector>

namespace memfit {

// set_to_none=true: release each .grad (PyTorch 2.x's default); false: zero it in place.
void zero_grad(torch::optim::Optimizer& optimizer, bool set_to_none = true);
void zero_grad(const std::vector<at::Tensor>& parameters, bool set_to_none = true);

// Bytes held by the .grad tensors of `parameters` (storage, counted once per tensor).
int64_t gradient_bytes(const std::vector<at::Tensor>& parameters);

}  // namespace memfit
