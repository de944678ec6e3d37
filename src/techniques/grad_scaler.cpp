#include "memfit/techniques/grad_scaler.h"

#include <ATen/ATen.h>
#include <ATen/core/grad_mode.h>  // at::NoGradGuard (ATen.h lacks it on 2.x)
#include <c10/util/Exception.h>

#include <cmath>

namespace memfit {

GradScaler::GradScaler(GradScalerOptions options) : options_(options) {
  TORCH_CHECK(options_.growth_factor > 1.0, "GradScaler: growth_factor must be > 1, got ",
              options_.growth_factor);
  TORCH_CHECK(options_.backoff_factor < 1.0 && options_.backoff_factor > 0.0,
              "GradScaler: backoff_factor must be in (0, 1), got ", options_.backoff_factor);
  TORCH_CHECK(options_.growth_interval > 0, "GradScaler: growth_interval must be > 0, got ",
              options_.growth_interval);
}

void GradScaler::check_scale_initialized(const char* function) const {
  TORCH_CHECK(scale_.defined(), "Attempted ", function,
              " but the scale is not initialized. This may indicate your loop did not use "
              "scaler.scale(loss) earlier in the iteration.");
}

at::Tensor GradScaler::scale(const at::Tensor& loss) {
  if (!options_.enabled) return loss;
  if (!scale_.defined()) {
    scale_ = at::full({}, options_.init_scale, loss.options().dtype(at::kFloat));
  }
  return loss * scale_.to(loss.device());
}

void GradScaler::unscale_(torch::optim::Optimizer& optimizer) {
  if (!options_.enabled) return;
  check_scale_initialized("unscale_");
  PerOptimizer& state = per_optimizer_[&optimizer];
  TORCH_CHECK(state.stage != OptState::kUnscaled,
              "unscale_() has already been called on this optimizer since the last update().");
  TORCH_CHECK(state.stage != OptState::kStepped, "unscale_() is being called after step().");

  // inv_scale in double, then float, as PyTorch computes it (scale.double().reciprocal().float()).
  const at::Tensor inv_scale = scale_.to(at::kDouble).reciprocal().to(at::kFloat);
  at::Tensor found_inf = at::zeros({}, scale_.options());
  at::NoGradGuard no_grad;
  for (auto& group : optimizer.param_groups()) {
    for (auto& p : group.params()) {
      if (!p.grad().defined()) continue;
      at::Tensor g = p.mutable_grad();
      TORCH_CHECK(g.scalar_type() != at::kHalf,
                  "Attempting to unscale FP16 gradients: keep parameters in fp32 under autocast.");
      // A gradient with inf or NaN marks the whole step as skipped.
      found_inf = at::maximum(found_inf, at::logical_not(at::isfinite(g).all()).to(at::kFloat).to(found_inf.device()));
      g.mul_(inv_scale.to(g.device()));
    }
  }
  state.found_inf = found_inf;
  state.stage = OptState::kUnscaled;
}

StepOutcome GradScaler::step(torch::optim::Optimizer& optimizer) {
  if (!options_.enabled) {
    optimizer.step();
    return {};
  }
  PerOptimizer& state = per_optimizer_[&optimizer];
  TORCH_CHECK(state.stage != OptState::kStepped,
              "step() has already been called since the last update().");
  if (state.stage == OptState::kReady) unscale_(optimizer);
  TORCH_CHECK(state.found_inf.defined(), "No inf checks were recorded for this optimizer.");
  StepOutcome outcome;
  outcome.skipped = state.found_inf.item<float>() != 0.0f;
  if (!outcome.skipped) optimizer.step();
  state.stage = OptState::kStepped;
  return outcome;
}

void GradScaler::apply_update(bool found_inf) {
  // Same rule as PyTorch's _amp_update_scale_: back off on inf; grow after growth_interval
  // clean steps in a row, but never to an infinite scale.
  float scale = scale_.item<float>();
  if (found_inf) {
    scale = static_cast<float>(scale * options_.backoff_factor);
    growth_tracker_ = 0;
  } else if (growth_tracker_ + 1 == options_.growth_interval) {
    const float grown = static_cast<float>(scale * options_.growth_factor);
    if (std::isfinite(grown)) scale = grown;
    growth_tracker_ = 0;
  } else {
    ++growth_tracker_;
  }
  scale_.fill_(scale);
}

void GradScaler::update() {
  if (!options_.enabled) return;
  check_scale_initialized("update");
  bool any_recorded = false;
  bool found_inf = false;
  for (auto& [opt, state] : per_optimizer_) {
    if (!state.found_inf.defined()) continue;
    any_recorded = true;
    found_inf = found_inf || state.found_inf.item<float>() != 0.0f;
  }
  TORCH_CHECK(any_recorded, "No inf checks were recorded prior to update.");
  apply_update(found_inf);
  per_optimizer_.clear();
}

void GradScaler::update(double new_scale) {
  if (!options_.enabled) return;
  check_scale_initialized("update");
  scale_.fill_(new_scale);
  per_optimizer_.clear();
}

double GradScaler::get_scale() const {
  if (!options_.enabled) return 1.0;
  return scale_.defined() ? scale_.item<double>() : options_.init_scale;
}

std::map<std::string, double> GradScaler::state_dict() const {
  if (!options_.enabled) return {};
  return {{"scale", get_scale()},
          {"growth_factor", options_.growth_factor},
          {"backoff_factor", options_.backoff_factor},
          {"growth_interval", static_cast<double>(options_.growth_interval)},
          {"_growth_tracker", static_cast<double>(growth_tracker_)}};
}

void GradScaler::load_state_dict(const std::map<std::string, double>& state) {
  TORCH_CHECK(options_.enabled, "load_state_dict() called on a disabled GradScaler.");
  TORCH_CHECK(!state.empty(),
              "The source state dict is empty, possibly because it was saved from a disabled "
              "instance of GradScaler.");
  auto get = [&](const char* key) {
    auto it = state.find(key);
    TORCH_CHECK(it != state.end(), "GradScaler state dict has no '", key, "' entry.");
    return it->second;
  };
  options_.init_scale = get("scale");
  options_.growth_factor = get("growth_factor");
  options_.backoff_factor = get("backoff_factor");
  options_.growth_interval = static_cast<int64_t>(get("growth_interval"));
  growth_tracker_ = static_cast<int64_t>(get("_growth_tracker"));
  if (scale_.defined()) scale_.fill_(options_.init_scale);
}

}  // namespace memfit
