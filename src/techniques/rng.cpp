#include "memfit/techniques/rng.h"

#include <ATen/CPUGeneratorImpl.h>

#include <mutex>

#if MEMFIT_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#endif

namespace memfit {
namespace {

at::Tensor get_state(at::Generator gen) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_state(at::Generator gen, const at::Tensor& state) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

at::Generator cuda_generator(int device) {
#if MEMFIT_WITH_CUDA
  return at::cuda::detail::getDefaultCUDAGenerator(static_cast<c10::DeviceIndex>(device));
#else
  (void)device;
  TORCH_CHECK(false, "memfit: a CUDA generator was requested in a build without CUDA");
#endif
}

}  // namespace

RngState capture_rng(c10::Device device) {
  RngState s;
  s.cpu = get_state(at::detail::getDefaultCPUGenerator());
  if (device.is_cuda()) {
    s.cuda_device = device.has_index() ? device.index() : 0;
    s.cuda = get_state(cuda_generator(s.cuda_device));
  }
  return s;
}

void restore_rng(const RngState& s) {
  set_state(at::detail::getDefaultCPUGenerator(), s.cpu);
  if (s.cuda.defined()) set_state(cuda_generator(s.cuda_device), s.cuda);
}

RngStateGuard::RngStateGuard(const RngState& state)
    : previous_(capture_rng(state.cuda.defined() ? c10::Device(c10::kCUDA, static_cast<c10::DeviceIndex>(state.cuda_device))
                                                 : c10::Device(c10::kCPU))) {
  restore_rng(state);
}

RngStateGuard::~RngStateGuard() { restore_rng(previous_); }

}  // namespace memfit
