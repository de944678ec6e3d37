// optimizer.h — the optimizer as a value: a family and its hyperparameters, which builds the
// torch::optim optimizer, travels in JSON (plans, saved state) and lets the rest of memfit
// read any family's per-parameter state without knowing the family.
//
//   memfit::OptimizerSpec spec;                 // AdamW, lr 1e-3 (PyTorch's defaults)
//   spec.family = memfit::OptimizerFamily::kSGD;
//   spec.momentum = 0.9;
//   auto optimizer = memfit::make_optimizer(spec, chain->parameters());
//
// State per parameter (fp32 parameters): AdamW/Adam 2x its bytes (3x with amsgrad), SGD with
// momentum 1x, plain SGD none, RMSprop 1x (+1x momentum, +1x centered), Adagrad 1x. memfit
// measures these bytes (plan/profile.h) rather than assuming them.
#pragma once

#include <ATen/ATen.h>
#include <nlohmann/json.hpp>
#include <torch/optim/optimizer.h>

#include "memfit/compat.h"

#include <memory>
#include <optional>
#include <string>
#include <vector>

namespace memfit {

enum class OptimizerFamily { kAdamW, kAdam, kSGD, kRMSprop, kAdagrad };

// "adamw" | "adam" | "sgd" | "rmsprop" | "adagrad"; throws OptionError naming the value.
OptimizerFamily parse_optimizer_family(const std::string& text);
const char* optimizer_family_name(OptimizerFamily family);

struct OptimizerSpec {
  OptimizerFamily family = OptimizerFamily::kAdamW;
  double lr = 1e-3;
  double momentum = 0;                 // sgd, rmsprop
  std::optional<double> weight_decay;  // unset: the family's default (AdamW 0.01, others 0)
  double beta1 = 0.9, beta2 = 0.999;   // adam, adamw

  double effective_weight_decay() const;
  std::string describe() const;        // "AdamW lr 0.001, betas 0.9/0.999, weight decay 0.01"
};

// Throws OptionError ("optimizer.lr", "optimizer.momentum", ...) unless the values are finite
// and in range, and each one given applies to the family.
void check_optimizer_spec(const OptimizerSpec& spec);

// The torch::optim optimizer of `spec` over `parameters` (checked first).
std::unique_ptr<torch::optim::Optimizer> make_optimizer(const OptimizerSpec& spec, std::vector<at::Tensor> parameters);

// The one JSON form: {"family", "lr", "momentum", "weight_decay", "betas"}.
nlohmann::json optimizer_spec_json(const OptimizerSpec& spec);
OptimizerSpec optimizer_spec_from_json(const nlohmann::json& json);

// One parameter's optimizer state, whatever the family: its step count and its tensors in the
// family's fixed order (undefined where an option leaves one unused, e.g. max_exp_avg_sq
// without amsgrad).
struct ParamStateRecord {
  int64_t step = 0;
  std::vector<at::Tensor> tensors;
};
ParamStateRecord read_param_state(const torch::optim::OptimizerParamState& state);
// How many tensors the family keeps per parameter (the length of ParamStateRecord::tensors).
size_t param_state_slots(OptimizerFamily family);
std::unique_ptr<torch::optim::OptimizerParamState> make_param_state(OptimizerFamily family,
                                                                   const ParamStateRecord& record);
// Every state tensor the optimizer holds, for all its parameters (undefined ones left out).
std::vector<at::Tensor> optimizer_state_tensors(const torch::optim::Optimizer& optimizer);

// The key torch::optim uses for a parameter in Optimizer::state() (text in 1.13, a pointer in 2.x).
compat::OptimizerStateKey param_state_key(const at::Tensor& parameter);

}  // namespace memfit
