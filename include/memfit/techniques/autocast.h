// autocast.h — mixed precision as an RAII guard, following torch.autocast's protocol.
//
//   { memfit::Autocast bf16(c10::kCPU, at::kBFloat16);   // matmuls now run in bf16
//     loss = model(x); }                                  // cast cache freed here
//   loss.backward();
//
// Protocol: the previous enabled flag and dtype of the device are saved and restored; a
// nesting counter is kept, and the weight-cast cache (bf16/fp16 copies of parameters, about
// half the fp32 weight bytes) is cleared when the outermost guard exits. Exit autocast before
// backward, as PyTorch does. The frees of that cache are tagged kAutocastCacheTag for the
// memory tracker, so breakdowns can report the cache separately.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/DeviceType.h>
#include <c10/core/ScalarType.h>

#include <string>
#include <vector>

namespace torch::nn {
class Module;
}

namespace memfit {

enum class Precision { kFP32, kBF16, kFP16 };

// "fp32" | "bf16" | "fp16"; throws std::invalid_argument naming the value and the choices.
Precision parse_precision(const std::string& text);
const char* precision_name(Precision precision);
at::ScalarType precision_dtype(Precision precision);
// Whether autocast can run `precision` on `device` in this LibTorch build; if not, `why` says so.
bool precision_supported(Precision precision, c10::DeviceType device, std::string* why = nullptr);

class Autocast {
 public:
  Autocast(c10::DeviceType device, at::ScalarType dtype, bool enabled = true);
  // fp32 means "autocast off" (still a guard: restores the previous state at exit).
  Autocast(c10::DeviceType device, Precision precision);
  ~Autocast();

  // Casts `params` into autocast's weight-cast cache now, with their allocations tagged
  // kAutocastCacheTag, so the tracker can report the cache's bytes (the ops then hit the
  // cache: the same copies PyTorch would make lazily, only made up front). No-op when off.
  void warm_cast_cache(const std::vector<at::Tensor>& params);

  Autocast(const Autocast&) = delete;
  Autocast& operator=(const Autocast&) = delete;

 private:
  c10::DeviceType device_;
  bool enabled_;
  at::ScalarType dtype_;
  bool previous_enabled_;
  at::ScalarType previous_dtype_;
};

// Parameters that autocast casts to lower precision in a standard module tree: those of
// Linear and Conv layers (embeddings and norms stay fp32).
std::vector<at::Tensor> autocast_cast_parameters(const torch::nn::Module& module);

// The autocast state of both device types, captured and re-applied (used by checkpoint).
struct AutocastState {
  bool cpu_enabled;
  at::ScalarType cpu_dtype;
  bool cuda_enabled;
  at::ScalarType cuda_dtype;
  static AutocastState capture();
};

}  // namespace memfit
