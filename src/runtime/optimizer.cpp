#include "memfit/runtime/optimizer.h"

#include <torch/optim.h>

#include <cmath>
#include <sstream>

#include "memfit/errors.h"
#include "memfit/techniques/optimizer_8bit.h"
#include "runtime/json_fields.h"

namespace memfit {
namespace {

using namespace torch::optim;

struct FamilyName {
  OptimizerFamily family;
  const char* name;
  const char* class_name;  // torch.optim's and torch::optim's
};
constexpr FamilyName kFamilies[] = {{OptimizerFamily::kAdamW, "adamw", "AdamW"},
                                    {OptimizerFamily::kAdam, "adam", "Adam"},
                                    {OptimizerFamily::kSGD, "sgd", "SGD"},
                                    {OptimizerFamily::kRMSprop, "rmsprop", "RMSprop"},
                                    {OptimizerFamily::kAdagrad, "adagrad", "Adagrad"}};

constexpr std::pair<StatePrecision, const char*> kStates[] = {
    {StatePrecision::kFP32, "fp32"}, {StatePrecision::k8Bit, "8bit"}, {StatePrecision::kAuto, "auto"}};

bool uses_momentum(OptimizerFamily f) { return f == OptimizerFamily::kSGD || f == OptimizerFamily::kRMSprop; }
bool uses_betas(OptimizerFamily f) { return f == OptimizerFamily::kAdamW || f == OptimizerFamily::kAdam; }

// Adam and AdamW keep the same three tensors.
template <class State>
ParamStateRecord read_adam_like(const State& s) {
  return {s.step(), {s.exp_avg(), s.exp_avg_sq(), s.max_exp_avg_sq()}};
}
template <class State>
std::unique_ptr<State> make_adam_like(const ParamStateRecord& r) {
  auto s = std::make_unique<State>();
  s->step(r.step).exp_avg(r.tensors.at(0)).exp_avg_sq(r.tensors.at(1)).max_exp_avg_sq(r.tensors.at(2));
  return s;
}

// The 8-bit state's tensors, in the record's order.
ParamStateRecord read_8bit(const Adam8bitParamState& s) {
  return {s.step(),
          {s.exp_avg(), s.exp_avg_sq(), s.exp_avg_codes(), s.exp_avg_absmax(), s.exp_avg_sq_codes(), s.exp_avg_sq_absmax()}};
}
std::unique_ptr<Adam8bitParamState> make_8bit(const ParamStateRecord& r) {
  auto s = std::make_unique<Adam8bitParamState>();
  s->step(r.step).exp_avg(r.tensors.at(0)).exp_avg_sq(r.tensors.at(1)).exp_avg_codes(r.tensors.at(2));
  s->exp_avg_absmax(r.tensors.at(3)).exp_avg_sq_codes(r.tensors.at(4)).exp_avg_sq_absmax(r.tensors.at(5));
  return s;
}
constexpr size_t k8BitSlots = 6;

std::unique_ptr<Optimizer> make_8bit_optimizer(const OptimizerSpec& s, std::vector<at::Tensor> params) {
  Adam8bitOptions o(s.lr);
  o.betas({s.beta1, s.beta2}).weight_decay(s.effective_weight_decay());
  o.decoupled_weight_decay(s.family == OptimizerFamily::kAdamW);
  return std::make_unique<Adam8bit>(std::move(params), o);
}

}  // namespace

StatePrecision parse_state_precision(const std::string& text) {
  for (const auto& [state, name] : kStates) {
    if (text == name) return state;
  }
  throw OptionError("optimizer.state", "'" + text + "'", "expected fp32, 8bit or auto");
}

const char* state_precision_name(StatePrecision state) {
  for (const auto& [s, name] : kStates) {
    if (s == state) return name;
  }
  return "?";
}

bool has_8bit_state(OptimizerFamily family) { return uses_betas(family); }

bool has_8bit_state(OptimizerFamily family, bool amsgrad, bool maximize) {
  return has_8bit_state(family) && !amsgrad && !maximize;
}

std::optional<OptimizerFamily> optimizer_family_of_class(const std::string& class_name) {
  for (const auto& f : kFamilies) {
    if (class_name == f.class_name) return f.family;
  }
  return std::nullopt;
}

OptimizerFamily parse_optimizer_family(const std::string& text) {
  for (const auto& f : kFamilies) {
    if (text == f.name) return f.family;
  }
  throw OptionError("optimizer", "'" + text + "'", "expected adamw, adam, sgd, rmsprop or adagrad");
}

const char* optimizer_family_name(OptimizerFamily family) {
  for (const auto& f : kFamilies) {
    if (family == f.family) return f.name;
  }
  return "?";
}

double OptimizerSpec::effective_weight_decay() const {
  if (weight_decay) return *weight_decay;
  return family == OptimizerFamily::kAdamW ? 1e-2 : 0.0;  // torch::optim's defaults
}

std::string OptimizerSpec::describe() const {
  static const char* const display[] = {"AdamW", "Adam", "SGD", "RMSprop", "Adagrad"};
  std::ostringstream out;
  out << display[static_cast<int>(family)] << " lr " << lr;
  if (uses_betas(family)) out << ", betas " << beta1 << "/" << beta2;
  if (uses_momentum(family)) out << ", momentum " << momentum;
  out << ", weight decay " << effective_weight_decay();
  if (state == StatePrecision::k8Bit) out << ", 8-bit state";
  if (state == StatePrecision::kAuto) out << ", state auto";
  return out.str();
}

OptimizerSpec OptimizerSpec::with_state(StatePrecision s) const {
  OptimizerSpec out = *this;
  out.state = s;
  return out;
}

void check_optimizer_spec(const OptimizerSpec& s) {
  const std::string family = optimizer_family_name(s.family);
  check_option(std::isfinite(s.lr) && s.lr > 0, "optimizer.lr", s.lr, "expected a finite number > 0");
  check_option(std::isfinite(s.momentum) && s.momentum >= 0 && s.momentum < 1, "optimizer.momentum", s.momentum,
               "expected 0 <= momentum < 1");
  check_option(s.momentum == 0 || uses_momentum(s.family), "optimizer.momentum", s.momentum,
               "momentum applies to sgd and rmsprop, not " + family);
  const double wd = s.effective_weight_decay();
  check_option(std::isfinite(wd) && wd >= 0, "optimizer.weight_decay", wd, "expected a finite number >= 0");
  for (double beta : {s.beta1, s.beta2}) {
    check_option(std::isfinite(beta) && beta >= 0 && beta < 1, "optimizer.betas", beta, "expected 0 <= beta < 1");
  }
  check_option(uses_betas(s.family) || (s.beta1 == 0.9 && s.beta2 == 0.999), "optimizer.betas",
               std::to_string(s.beta1) + "," + std::to_string(s.beta2), "betas apply to adam and adamw, not " + family);
  check_option(s.state != StatePrecision::k8Bit || has_8bit_state(s.family), "optimizer.state", "'8bit'",
               "8-bit state applies to adam and adamw, not " + family + " (fp32 or auto)");
}

void make_8bit_maps_if_used(const OptimizerSpec& spec, c10::Device device) {
  const bool may_be_8bit = spec.state == StatePrecision::k8Bit ||
                           (spec.state == StatePrecision::kAuto && has_8bit_state(spec.family));
  if (!may_be_8bit) return;
  dynamic_map(true, device);
  dynamic_map(false, device);
}

std::unique_ptr<Optimizer> make_optimizer(const OptimizerSpec& s, std::vector<at::Tensor> params) {
  check_optimizer_spec(s);
  const double wd = s.effective_weight_decay();
  if (s.state == StatePrecision::k8Bit) return make_8bit_optimizer(s, std::move(params));
  switch (s.family) {
    case OptimizerFamily::kAdamW:
      return std::make_unique<AdamW>(params, AdamWOptions(s.lr).betas({s.beta1, s.beta2}).weight_decay(wd));
    case OptimizerFamily::kAdam:
      return std::make_unique<Adam>(params, AdamOptions(s.lr).betas({s.beta1, s.beta2}).weight_decay(wd));
    case OptimizerFamily::kSGD:
      return std::make_unique<SGD>(params, SGDOptions(s.lr).momentum(s.momentum).weight_decay(wd));
    case OptimizerFamily::kRMSprop:
      return std::make_unique<RMSprop>(params, RMSpropOptions(s.lr).momentum(s.momentum).weight_decay(wd));
    case OptimizerFamily::kAdagrad:
      return std::make_unique<Adagrad>(params, AdagradOptions(s.lr).weight_decay(wd));
  }
  TORCH_CHECK(false, "memfit::make_optimizer: unknown optimizer family");
}

nlohmann::json optimizer_spec_json(const OptimizerSpec& s) {
  return {{"family", optimizer_family_name(s.family)},
          {"lr", s.lr},
          {"momentum", s.momentum},
          {"weight_decay", s.effective_weight_decay()},
          {"betas", {s.beta1, s.beta2}},
          {"state", state_precision_name(s.state)}};
}

OptimizerSpec optimizer_spec_from_json(const nlohmann::json& j) {
  namespace jf = json_fields;
  OptimizerSpec s;
  s.family = parse_optimizer_family(jf::text(j, "family"));
  s.lr = jf::number(j, "lr");
  s.momentum = jf::number(j, "momentum");
  s.weight_decay = jf::number(j, "weight_decay");
  const auto& betas = jf::array(j, "betas", 2);
  s.beta1 = jf::value_number(betas[0], "betas");
  s.beta2 = jf::value_number(betas[1], "betas");
  // Absent from plans and saved states written before the state precision existed: fp32 then.
  if (j.contains("state")) {
    try {
      s.state = parse_state_precision(jf::text(j, "state"));
    } catch (const OptionError& e) {
      jf::refuse("state", j.at("state"), e.expected());
    }
  }
  check_optimizer_spec(s);
  return s;
}

ParamStateRecord read_param_state(const OptimizerParamState& state) {
  if (const auto* s = dynamic_cast<const AdamWParamState*>(&state)) return read_adam_like(*s);
  if (const auto* s = dynamic_cast<const AdamParamState*>(&state)) return read_adam_like(*s);
  if (const auto* s = dynamic_cast<const SGDParamState*>(&state)) return {0, {s->momentum_buffer()}};
  if (const auto* s = dynamic_cast<const RMSpropParamState*>(&state)) {
    return {s->step(), {s->square_avg(), s->momentum_buffer(), s->grad_avg()}};
  }
  if (const auto* s = dynamic_cast<const AdagradParamState*>(&state)) return {s->step(), {s->sum()}};
  if (const auto* s = dynamic_cast<const Adam8bitParamState*>(&state)) return read_8bit(*s);
  TORCH_CHECK(false,
              "memfit: optimizer state of an unknown family (expected AdamW, Adam (fp32 or 8-bit), SGD, RMSprop or Adagrad)");
}

size_t param_state_slots(OptimizerFamily family) {
  switch (family) {
    case OptimizerFamily::kAdamW:
    case OptimizerFamily::kAdam:
    case OptimizerFamily::kRMSprop: return 3;
    case OptimizerFamily::kSGD:
    case OptimizerFamily::kAdagrad: return 1;
  }
  return 0;
}

size_t param_state_slots(const OptimizerSpec& spec) {
  return spec.state == StatePrecision::k8Bit ? k8BitSlots : param_state_slots(spec.family);
}

std::unique_ptr<OptimizerParamState> make_param_state(const OptimizerSpec& spec, const ParamStateRecord& r) {
  if (spec.state != StatePrecision::k8Bit) return make_param_state(spec.family, r);
  TORCH_CHECK(r.tensors.size() == k8BitSlots, "memfit::make_param_state: 8-bit state keeps ", k8BitSlots,
              " tensors, got ", r.tensors.size());
  return make_8bit(r);
}

at::Tensor empty_param_state_slot(const OptimizerSpec& spec, size_t slot, const at::Tensor& p) {
  TORCH_CHECK(slot < param_state_slots(spec), "memfit::empty_param_state_slot: slot ", slot, " of ",
              param_state_slots(spec));
  if (spec.state != StatePrecision::k8Bit || slot < 2) return at::empty_like(p, at::MemoryFormat::Contiguous);
  if (slot == 2 || slot == 4) return at::empty({p.numel()}, p.options().dtype(at::kByte));
  return at::empty({num_quant_blocks(p.numel())}, p.options().dtype(at::kFloat));
}

std::unique_ptr<OptimizerParamState> make_param_state(OptimizerFamily family, const ParamStateRecord& r) {
  TORCH_CHECK(r.tensors.size() == param_state_slots(family), "memfit::make_param_state: ",
              optimizer_family_name(family), " keeps ", param_state_slots(family), " tensors, got ", r.tensors.size());
  switch (family) {
    case OptimizerFamily::kAdamW: return make_adam_like<AdamWParamState>(r);
    case OptimizerFamily::kAdam: return make_adam_like<AdamParamState>(r);
    case OptimizerFamily::kSGD: {  // (torch::optim's setters chain)
      auto s = std::make_unique<SGDParamState>();
      s->momentum_buffer(r.tensors[0]);
      return s;
    }
    case OptimizerFamily::kRMSprop: {
      auto s = std::make_unique<RMSpropParamState>();
      s->step(r.step).square_avg(r.tensors[0]).momentum_buffer(r.tensors[1]).grad_avg(r.tensors[2]);
      return s;
    }
    case OptimizerFamily::kAdagrad: {
      auto s = std::make_unique<AdagradParamState>();
      s->step(r.step).sum(r.tensors[0]);
      return s;
    }
  }
  TORCH_CHECK(false, "memfit::make_param_state: unknown optimizer family");
}

std::vector<at::Tensor> optimizer_state_tensors(const Optimizer& optimizer) {
  std::vector<at::Tensor> out;
  for (const auto& entry : optimizer.state()) {
    for (auto& t : read_param_state(*entry.second).tensors) {
      if (t.defined()) out.push_back(std::move(t));
    }
  }
  return out;
}

compat::OptimizerStateKey param_state_key(const at::Tensor& parameter) {
  return compat::optimizer_state_key(parameter);
}

}  // namespace memfit
