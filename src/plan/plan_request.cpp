#include "memfit/plan/plan_request.h"

#include "memfit/errors.h"

namespace memfit {

std::vector<Precision> precision_candidates(const std::string& text, c10::DeviceType device) {
  if (text == "auto") {
    std::vector<Precision> out{Precision::kFP32};
    for (Precision p : {Precision::kBF16, Precision::kFP16}) {
      if (precision_supported(p, device)) out.push_back(p);
    }
    return out;
  }
  const Precision p = parse_precision(text);  // throws, naming the value and the choices
  std::string why;
  check_option(precision_supported(p, device, &why), "precision", text, why);
  return {p};
}

OffloadMode parse_offload_mode(const std::string& text) {
  for (OffloadMode m : {OffloadMode::kNone, OffloadMode::kOptimizer, OffloadMode::kActivations, OffloadMode::kAll,
                        OffloadMode::kAuto}) {
    if (text == offload_mode_name(m)) return m;
  }
  throw OptionError("offload", text, "expected none, optimizer, activations, all or auto");
}

const char* offload_mode_name(OffloadMode mode) {
  switch (mode) {
    case OffloadMode::kNone: return "none";
    case OffloadMode::kOptimizer: return "optimizer";
    case OffloadMode::kActivations: return "activations";
    case OffloadMode::kAll: return "all";
    case OffloadMode::kAuto: return "auto";
  }
  return "none";
}

void allow_offload(PlanRequest& request, OffloadMode mode) {
  switch (mode) {
    case OffloadMode::kOptimizer:
    case OffloadMode::kAll: request.optimizer_offload = {true}; break;
    case OffloadMode::kAuto: request.optimizer_offload = {false, true}; break;
    default: request.optimizer_offload = {false};
  }
  request.activation_offload = mode == OffloadMode::kActivations || mode == OffloadMode::kAll || mode == OffloadMode::kAuto;
}

}  // namespace memfit
