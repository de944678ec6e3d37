// grad_scaler.h — loss scaling for fp16 (and optionally bf16) training, with the semantics of
// PyTorch's torch.cuda.amp.GradScaler, for C++ loops, on CPU and CUDA.
//
//   memfit::GradScaler scaler;                       // scale 2^16, growth 2, backoff 0.5, 2000
//   for (auto& mb : micro_batches) scaler.scale(loss(mb)).backward();   // accumulation is fine
//   scaler.unscale_(optimizer);                       // optional: before clipping
//   torch::nn::utils::clip_grad_norm_(params, 1.0);
//   auto outcome = scaler.step(optimizer);            // skipped if any gradient is inf/NaN
//   scaler.update();                                   // backoff on inf, growth after 2000 clean steps
//   if (outcome.skipped) ...                           // PyTorch only lets you guess (issue 55585)
//
// Same state errors as PyTorch: unscale_ twice per optimizer between updates, unscale_ after
// step, step twice, update with no inf check recorded, use before scale().
#pragma once

#include <torch/optim/optimizer.h>

#include <cstdint>
#include <map>
#include <string>
#include <unordered_map>

namespace memfit {

struct GradScalerOptions {
  double init_scale = 65536.0;  // 2^16
  double growth_factor = 2.0;
  double backoff_factor = 0.5;
  int64_t growth_interval = 2000;
  bool enabled = true;
};

struct StepOutcome {
  bool skipped = false;  // true when a non-finite gradient made the step skip
};

class GradScaler {
 public:
  explicit GradScaler(GradScalerOptions options = {});

  // loss * scale (loss unchanged when disabled).
  at::Tensor scale(const at::Tensor& loss);
  // Divides the optimizer's gradients by the scale in place and records whether any was inf/NaN.
  void unscale_(torch::optim::Optimizer& optimizer);
  // Unscales if not done yet; runs optimizer.step() unless a non-finite gradient was found.
  StepOutcome step(torch::optim::Optimizer& optimizer);
  // Backoff after a skipped step, growth after growth_interval clean ones; or set new_scale.
  void update();
  void update(double new_scale);

  double get_scale() const;
  int64_t get_growth_tracker() const { return growth_tracker_; }
  bool is_enabled() const { return options_.enabled; }

  // Keys as PyTorch: scale, growth_factor, backoff_factor, growth_interval, _growth_tracker.
  std::map<std::string, double> state_dict() const;
  void load_state_dict(const std::map<std::string, double>& state);

 private:
  enum class OptState { kReady, kUnscaled, kStepped };
  struct PerOptimizer {
    OptState stage = OptState::kReady;
    at::Tensor found_inf;  // 0-dim float: 1.0 if a gradient was inf/NaN
  };
  void check_scale_initialized(const char* function) const;
  void apply_update(bool found_inf);

  GradScalerOptions options_;
  at::Tensor scale_;        // 0-dim float, on the device of the first scaled loss
  int64_t growth_tracker_ = 0;
  std::unordered_map<const torch::optim::Optimizer*, PerOptimizer> per_optimizer_;
};

}  // namespace memfit
