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
// momentum 1x, plain SGD none, RMSprop 1x (+1x momentum, +1x centered), Adagrad 1x; AdamW/Adam
// with 8-bit state ~0.5x (techniques/optimizer_8bit.h). memfit measures these bytes
// (plan/profile.h) rather than assuming them.
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

// How the optimizer keeps its state: fp32 (torch::optim, exact); 8bit (Adam and AdamW: both
// moments blockwise 8-bit, techniques/optimizer_8bit.h); auto (the planner chooses, keeping
// fp32 unless 8-bit lets a faster plan fit or nothing fits otherwise; fp32 until it has).
enum class StatePrecision { kFP32, k8Bit, kAuto };
// "fp32" | "8bit" | "auto"; throws OptionError("optimizer.state", ...) naming the value.
StatePrecision parse_state_precision(const std::string& text);
const char* state_precision_name(StatePrecision state);
// Whether the family has an 8-bit state (Adam, AdamW); and with these options (the 8-bit state
// keeps neither amsgrad's maximum nor maximize's sign).
bool has_8bit_state(OptimizerFamily family);
bool has_8bit_state(OptimizerFamily family, bool amsgrad, bool maximize);
// The family of an optimizer class as torch.optim and torch::optim name it ("AdamW", "SGD", ...);
// none for another class (a user's own optimizer: planned with its measured costs, as AdamW's
// family, with no 8-bit state).
std::optional<OptimizerFamily> optimizer_family_of_class(const std::string& class_name);

struct OptimizerSpec {
  OptimizerFamily family = OptimizerFamily::kAdamW;
  double lr = 1e-3;
  double momentum = 0;                 // sgd, rmsprop
  std::optional<double> weight_decay;  // unset: the family's default (AdamW 0.01, others 0)
  double beta1 = 0.9, beta2 = 0.999;   // adam, adamw
  StatePrecision state = StatePrecision::kFP32;

  double effective_weight_decay() const;
  // "AdamW lr 0.001, betas 0.9/0.999, weight decay 0.01" (+ ", 8-bit state" / ", state auto")
  std::string describe() const;
  // The spec with `state` as given (auto stays auto); for the planner's candidates.
  OptimizerSpec with_state(StatePrecision state) const;
};

// Throws OptionError ("optimizer.lr", "optimizer.momentum", ..., "optimizer.state") unless the
// values are finite and in range, and each one given applies to the family (8-bit state:
// adam and adamw only).
void check_optimizer_spec(const OptimizerSpec& spec);

// The torch::optim optimizer of `spec` over `parameters` (checked first): memfit::Adam8bit for
// 8-bit state; auto builds the fp32 one (what auto means until a plan resolves it).
std::unique_ptr<torch::optim::Optimizer> make_optimizer(const OptimizerSpec& spec, std::vector<at::Tensor> parameters);

// Makes the 8-bit state's code maps on `device` where `spec` may keep 8-bit state (8bit, or auto
// for Adam and AdamW). They stay for the process's life (dynamic_map): made before the resident
// bytes are read, a plan counts them as memory held from the start, as the budget then sees them.
void make_8bit_maps_if_used(const OptimizerSpec& spec, c10::Device device);

// The one JSON form: {"family", "lr", "momentum", "weight_decay", "betas", "state"}.
nlohmann::json optimizer_spec_json(const OptimizerSpec& spec);
OptimizerSpec optimizer_spec_from_json(const nlohmann::json& json);

// One parameter's optimizer state, whatever the family: its step count and its tensors in the
// family's fixed order (undefined where an option leaves one unused, e.g. max_exp_avg_sq
// without amsgrad). 8-bit state: exp_avg, exp_avg_sq (fp32, small tensors), exp_avg_codes,
// exp_avg_absmax, exp_avg_sq_codes, exp_avg_sq_absmax.
struct ParamStateRecord {
  int64_t step = 0;
  std::vector<at::Tensor> tensors;
};
ParamStateRecord read_param_state(const torch::optim::OptimizerParamState& state);
// How many tensors the family keeps per parameter (the length of ParamStateRecord::tensors);
// the spec's form counts the 8-bit state's.
size_t param_state_slots(OptimizerFamily family);
size_t param_state_slots(const OptimizerSpec& spec);
std::unique_ptr<torch::optim::OptimizerParamState> make_param_state(OptimizerFamily family,
                                                                   const ParamStateRecord& record);
std::unique_ptr<torch::optim::OptimizerParamState> make_param_state(const OptimizerSpec& spec,
                                                                   const ParamStateRecord& record);
// An uninitialized tensor of the shape and dtype state slot `slot` has for `parameter` (to
// receive it into): the parameter's own, or the 8-bit state's codes (uint8, one per value) and
// absmax (fp32, one per block).
at::Tensor empty_param_state_slot(const OptimizerSpec& spec, size_t slot, const at::Tensor& parameter);
// Every state tensor the optimizer holds, for all its parameters (undefined ones left out).
std::vector<at::Tensor> optimizer_state_tensors(const torch::optim::Optimizer& optimizer);

// The key torch::optim uses for a parameter in Optimizer::state() (text in 1.13, a pointer in 2.x).
compat::OptimizerStateKey param_state_key(const at::Tensor& parameter);

}  // namespace memfit
