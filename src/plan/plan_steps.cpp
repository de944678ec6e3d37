#include "memfit/plan/plan_steps.h"

#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <optional>

#include "memfit/errors.h"
#include "memfit/measure/memory_space.h"
#include "memfit/runtime/optimizer_offload.h"
#include "memfit/runtime/step.h"
#include "memfit/techniques/grads.h"

namespace memfit {

PlanSteps run_plan_steps(Workload& w, const Batch& data, const StepConfig& config, MemoryTracker& tracker, int steps) {
  check_option(steps >= 2, "verify_steps", steps, "expected 2 or more (the first step only warms up)");
  const MemoryDevice device = memory_device_of(data.input.device());
  auto optimizer = make_optimizer(config.optimizer, w.chain->parameters());
  StepOptions options{config};
  std::optional<OptimizerOffload> offload;
  if (config.offload.optimizer) {
    offload.emplace(w.chain->parameters());
    offload->adopt(*optimizer);
    offload->attach(options);
  }
  PlanSteps r;
  r.best_seconds = 1e30;
  try {
    for (int step = 1; step <= steps; ++step) {
      tracker.reset_peak();
      const auto t0 = std::chrono::steady_clock::now();
      accumulate_gradients(w, data, split_batch(data.size(), config.micro_batch_size()), options);
      const auto optimizer_part = [&] { optimizer_step(*optimizer, options); };
      offload ? offload->step(optimizer_part) : optimizer_part();
      const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      if (step < 2) continue;
      r.best_seconds = std::min(r.best_seconds, s);
      r.peak = std::max(r.peak, tracker.peak(device));
    }
  } catch (const c10::OutOfMemoryError&) {
    zero_grad(w.chain->parameters(), true);
    throw;
  }
  return r;
}

ModelStateGuard::ModelStateGuard(Workload& w) : rng_(capture_rng(w.chain->parameters().empty()
                                                                      ? c10::Device(c10::kCPU)
                                                                      : w.chain->parameters().front().device())) {
  tensors_ = w.chain->parameters();
  const std::vector<at::Tensor> buffers = w.chain->buffers();
  tensors_.insert(tensors_.end(), buffers.begin(), buffers.end());
  at::NoGradGuard no_grad;
  for (const at::Tensor& t : tensors_) {
    values_.push_back(copy_to_host(t.detach()));
    gradients_.push_back(t.grad().defined() ? copy_to_host(t.grad()) : at::Tensor());
  }
}

ModelStateGuard::~ModelStateGuard() {
  at::NoGradGuard no_grad;
  for (size_t i = 0; i < tensors_.size(); ++i) {
    at::Tensor t = tensors_[i];
    t.detach().copy_(values_[i]);
    if (gradients_[i].defined()) {
      t.mutable_grad() = copy_to_device(gradients_[i], t.device());
    } else if (t.grad().defined()) {
      t.mutable_grad().reset();
    }
  }
  restore_rng(rng_);
}

}  // namespace memfit
