// rng.h — the random generator states a step draws from (dropout masks), captured and put
// back. Checkpointing restores them for the recompute; out-of-memory recovery takes back the
// draws of a failed attempt; saved state carries them. CPU's generator always, and on a CUDA
// device that device's generator too.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Device.h>

namespace memfit {

struct RngState {
  at::Tensor cpu;
  at::Tensor cuda;       // undefined unless captured for a CUDA device
  int cuda_device = -1;
};

RngState capture_rng(c10::Device device);
void restore_rng(const RngState& state);

// Leaves the random states as they were at entry when the scope ends, whatever it drew (or
// threw): measuring runs draw dropout masks the caller's stream must not see.
class RngScope {
 public:
  explicit RngScope(c10::Device device) : state_(capture_rng(device)) {}
  ~RngScope() { restore_rng(state_); }
  RngScope(const RngScope&) = delete;
  RngScope& operator=(const RngScope&) = delete;

 private:
  RngState state_;
};

// Puts `state` in place for a scope, then the states current at entry back.
class RngStateGuard {
 public:
  explicit RngStateGuard(const RngState& state);
  ~RngStateGuard();
  RngStateGuard(const RngStateGuard&) = delete;
  RngStateGuard& operator=(const RngStateGuard&) = delete;

 private:
  RngState previous_;
};

}  // namespace memfit
