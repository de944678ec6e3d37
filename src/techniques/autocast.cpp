#include "memfit/techniques/autocast.h"

#include <c10/util/Exception.h>
#include <torch/nn/module.h>
#include <torch/nn/modules/conv.h>
#include <torch/nn/modules/linear.h>

#include <stdexcept>

#include "memfit/errors.h"
#include "memfit/compat.h"
#include "memfit/measure/memory_tracker.h"

namespace memfit {

Precision parse_precision(const std::string& text) {
  if (text == "fp32") return Precision::kFP32;
  if (text == "bf16") return Precision::kBF16;
  if (text == "fp16") return Precision::kFP16;
  throw OptionError("precision", "'" + text + "'", "expected fp32, bf16 or fp16");
}

const char* precision_name(Precision precision) {
  switch (precision) {
    case Precision::kFP32: return "fp32";
    case Precision::kBF16: return "bf16";
    case Precision::kFP16: return "fp16";
  }
  return "?";
}

at::ScalarType precision_dtype(Precision precision) {
  switch (precision) {
    case Precision::kFP32: return at::kFloat;
    case Precision::kBF16: return at::kBFloat16;
    case Precision::kFP16: return at::kHalf;
  }
  return at::kFloat;
}

bool precision_supported(Precision precision, c10::DeviceType device, std::string* why) {
  if (precision == Precision::kFP32) return true;
  if (device == c10::kCUDA) {
    if (!MEMFIT_WITH_CUDA) {
      if (why) *why = "this memfit was built without CUDA";
      return false;
    }
    return true;
  }
  if (device == c10::kCPU && precision == Precision::kFP16 && !MEMFIT_TORCH_AT_LEAST(2, 2)) {
    if (why) *why = "CPU autocast in LibTorch " TORCH_VERSION " supports bf16 only (fp16 needs CUDA)";
    return false;
  }
  return device == c10::kCPU;
}

Autocast::Autocast(c10::DeviceType device, at::ScalarType dtype, bool enabled)
    : device_(device),
      enabled_(enabled),
      dtype_(dtype),
      previous_enabled_(compat::autocast_enabled(device)),
      previous_dtype_(compat::autocast_dtype(device)) {
  TORCH_CHECK(device == c10::kCPU || device == c10::kCUDA,
              "memfit::Autocast: device must be cpu or cuda, got ", device);
  if (device == c10::kCPU && !MEMFIT_TORCH_AT_LEAST(2, 2)) {
    TORCH_CHECK(!enabled || dtype == at::kBFloat16,
                "memfit::Autocast: CPU autocast supports bf16 only in this LibTorch, got ", dtype);
  }
  compat::set_autocast_dtype(device, dtype);
  compat::set_autocast_enabled(device, enabled);
  at::autocast::increment_nesting();
}

Autocast::Autocast(c10::DeviceType device, Precision precision)
    : Autocast(device, precision == Precision::kFP32 ? at::kBFloat16 : precision_dtype(precision),
               precision != Precision::kFP32) {}

Autocast::~Autocast() {
  if (at::autocast::decrement_nesting() == 0) {
    // Tag the cache's frees so the tracker can tell them from activations.
    BlockTagGuard tag(kAutocastCacheTag);
    at::autocast::clear_cache();
  }
  compat::set_autocast_enabled(device_, previous_enabled_);
  compat::set_autocast_dtype(device_, previous_dtype_);
}

void Autocast::warm_cast_cache(const std::vector<at::Tensor>& params) {
  if (!enabled_) return;
  BlockTagGuard tag(kAutocastCacheTag);
  for (const at::Tensor& p : params) {
    if (p.device().type() == device_ && p.scalar_type() == at::kFloat) {
      at::autocast::cached_cast(dtype_, p, device_);
    }
  }
}

std::vector<at::Tensor> autocast_cast_parameters(const torch::nn::Module& module) {
  std::vector<at::Tensor> out;
  for (const auto& m : module.modules(/*include_self=*/true)) {
    const bool casts = m->as<torch::nn::Linear>() || m->as<torch::nn::Conv1d>() ||
                       m->as<torch::nn::Conv2d>() || m->as<torch::nn::Conv3d>();
    if (!casts) continue;
    for (const auto& p : m->parameters(/*recurse=*/false)) out.push_back(p);
  }
  return out;
}

AutocastState AutocastState::capture() {
  return AutocastState{compat::autocast_enabled(c10::kCPU), compat::autocast_dtype(c10::kCPU),
                       compat::autocast_enabled(c10::kCUDA), compat::autocast_dtype(c10::kCUDA)};
}

}  // namespace memfit
