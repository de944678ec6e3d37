// optimizer_offload.h — the optimizer on the host (ZeRO-Offload; Ren et al., "ZeRO-Offload:
// Democratizing Billion-Scale Model Training", USENIX ATC 2021): its state, its step and fp32
// master copies of the weights live in the host space (memory_space.h); the device keeps the
// weights alone.
//
//   device:  weights W                       host:  masters W, gradients G, state S, step temporaries
//
// Each parameter's gradient is streamed to the host as autograd finishes it (a hook on the
// parameter sees the gradient of the whole backward, tied uses summed): added into its master's
// .grad there, as autograd would add it into .grad, so the sums are bit-equal to a run without
// offload. The device gradient autograd then stores is released at the next parameter's hook,
// so the device holds at most one parameter's gradient at a time. The optimizer, built over the
// masters, steps on the host; the updated masters are copied back into the device's weights.
//
//   memfit::OptimizerOffload offload(chain->parameters());
//   offload.adopt(*optimizer);             // built over the device parameters: now over the masters
//   ... forward, backward; offload.release_device_gradients();   (each micro-batch)
//   offload.step([&] { optimizer->step(); });                   // on the host, then copied back
#pragma once

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>

#include <functional>
#include <vector>

#include "memfit/runtime/step.h"

namespace memfit {

class OptimizerOffload {
 public:
  // Makes the host masters of `device_parameters` and hooks the parameters.
  explicit OptimizerOffload(std::vector<at::Tensor> device_parameters);
  ~OptimizerOffload();  // the hooks removed
  OptimizerOffload(const OptimizerOffload&) = delete;
  OptimizerOffload& operator=(const OptimizerOffload&) = delete;

  const std::vector<at::Tensor>& device_parameters() const { return device_; }
  // What the optimizer steps: the masters, whose .grad hold the step's gradient sums.
  const std::vector<at::Tensor>& host_parameters() const { return host_; }

  // An optimizer built over the device parameters (its state, if any, keyed by them) steps the
  // masters from now on: its parameter groups and state moved to the host.
  void adopt(torch::optim::Optimizer& optimizer) const;
  // The reverse of adopt: the optimizer steps the device parameters again, its state keyed by
  // them and brought back (state_tensor_to_device). The hooks stay until this is destroyed.
  void release(torch::optim::Optimizer& optimizer) const;
  // After each backward: the device gradients autograd still holds are released.
  void release_device_gradients();
  // Makes `options` run with this offload: gradient sums held by the masters, the device's
  // released after each backward (StepOptions::gradient_holders, after_backward).
  void attach(StepOptions& options);
  // The optimizer's step (`step`) on the host, then the masters copied into the device weights.
  void step(const std::function<void()>& step);

  // While alive, the optimizer's state is keyed by the device parameters (saving and loading
  // name state by the model's parameters), and by the masters again after.
  class DeviceKeys {
   public:
    DeviceKeys(const OptimizerOffload& offload, torch::optim::Optimizer& optimizer);
    ~DeviceKeys();
    DeviceKeys(const DeviceKeys&) = delete;
    DeviceKeys& operator=(const DeviceKeys&) = delete;

   private:
    const OptimizerOffload& offload_;
    torch::optim::Optimizer& optimizer_;
  };

 private:
  void stream(size_t index, const at::Tensor& grad);

  std::vector<at::Tensor> device_;
  std::vector<at::Tensor> host_;
  std::vector<unsigned> hooks_;
  std::vector<size_t> streamed_;  // parameters whose device gradient is still to be released
};

// A state tensor of `device_parameter` brought back from the host, where the optimizer keeps it
// for that parameter: one of the parameter's shape (a moment) on the parameter's device; another
// (torch's step count, a scalar tensor) in ordinary CPU memory.
at::Tensor state_tensor_to_device(const at::Tensor& host_state, const at::Tensor& device_parameter);

}  // namespace memfit
