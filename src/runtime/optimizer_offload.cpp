#include "memfit/runtime/optimizer_offload.h"

#include <torch/torch.h>

#include "memfit/measure/memory_space.h"
#include "memfit/runtime/optimizer.h"

namespace memfit {
namespace {

// Moves the optimizer's state entry for `from` to `to` (the same state object).
void rekey(torch::optim::Optimizer& optimizer, const at::Tensor& from, const at::Tensor& to) {
  auto& state = optimizer.state();
  auto it = state.find(param_state_key(from));
  if (it == state.end()) return;
  auto entry = std::move(it->second);
  state.erase(it);
  state[param_state_key(to)] = std::move(entry);
}

void swap_group_parameters(torch::optim::Optimizer& optimizer, const std::vector<at::Tensor>& from,
                           const std::vector<at::Tensor>& to) {
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) {
      for (size_t i = 0; i < from.size(); ++i) {
        if (p.is_same(from[i])) {
          p = to[i];
          break;
        }
      }
    }
  }
}

}  // namespace

OptimizerOffload::OptimizerOffload(std::vector<at::Tensor> device_parameters) : device_(std::move(device_parameters)) {
  at::NoGradGuard no_grad;
  host_.reserve(device_.size());
  for (const auto& p : device_) host_.push_back(copy_to_host(p.detach()).set_requires_grad(true));
  for (size_t i = 0; i < device_.size(); ++i) {
    hooks_.push_back(device_[i].register_hook([this, i](const at::Tensor& grad) { stream(i, grad); }));
  }
}

OptimizerOffload::~OptimizerOffload() {
  for (size_t i = 0; i < device_.size(); ++i) device_[i].remove_hook(hooks_[i]);
}

void OptimizerOffload::stream(size_t index, const at::Tensor& grad) {
  release_device_gradients();  // the ones autograd stored since the last hook
  if (!grad.defined()) return;  // (LibTorch 2.x calls the hook for a gradient that is not there too)
  at::NoGradGuard no_grad;
  at::Tensor& sum = host_[index].mutable_grad();
  if (!sum.defined()) {
    sum = copy_to_host(grad);
  } else if (grad.is_cuda()) {
    sum.add_(copy_to_host(grad));
  } else {
    // As autograd adds a gradient into one already there (in place; the same float sums). On
    // the CPU the host and the device share RAM: the add reads the device gradient directly.
    HostSpaceGuard host;
    sum.add_(grad);
  }
  streamed_.push_back(index);
}

void OptimizerOffload::release_device_gradients() {
  for (size_t i : streamed_) device_[i].mutable_grad() = at::Tensor();
  streamed_.clear();
}

void OptimizerOffload::attach(StepOptions& options) {
  options.gradient_holders = host_;
  options.after_backward = [this] { release_device_gradients(); };
}

void OptimizerOffload::adopt(torch::optim::Optimizer& optimizer) const {
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < device_.size(); ++i) {
    auto it = optimizer.state().find(param_state_key(device_[i]));
    if (it == optimizer.state().end()) continue;
    for (at::Tensor t : read_param_state(*it->second).tensors) {
      if (t.defined()) t.set_(copy_to_host(t));  // the state object's own tensor now on the host
    }
    rekey(optimizer, device_[i], host_[i]);
  }
  swap_group_parameters(optimizer, device_, host_);
}

void OptimizerOffload::release(torch::optim::Optimizer& optimizer) const {
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < device_.size(); ++i) {
    auto it = optimizer.state().find(param_state_key(host_[i]));
    if (it == optimizer.state().end()) continue;
    for (at::Tensor t : read_param_state(*it->second).tensors) {
      if (t.defined()) t.set_(state_tensor_to_device(t, device_[i]));
    }
    rekey(optimizer, host_[i], device_[i]);
  }
  swap_group_parameters(optimizer, host_, device_);
}

void OptimizerOffload::step(const std::function<void()>& step) {
  {
    HostSpaceGuard host;  // the step's temporaries, and state made on its first step
    step();
  }
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < device_.size(); ++i) device_[i].copy_(host_[i]);
}

OptimizerOffload::DeviceKeys::DeviceKeys(const OptimizerOffload& offload, torch::optim::Optimizer& optimizer)
    : offload_(offload), optimizer_(optimizer) {
  for (size_t i = 0; i < offload_.device_.size(); ++i) rekey(optimizer_, offload_.host_[i], offload_.device_[i]);
}

OptimizerOffload::DeviceKeys::~DeviceKeys() {
  for (size_t i = 0; i < offload_.device_.size(); ++i) rekey(optimizer_, offload_.device_[i], offload_.host_[i]);
}

at::Tensor state_tensor_to_device(const at::Tensor& host_state, const at::Tensor& device_parameter) {
  const bool moment = host_state.sizes() == device_parameter.sizes();
  return copy_to_device(host_state, moment ? device_parameter.device() : c10::Device(c10::kCPU));
}

}  // namespace memfit
