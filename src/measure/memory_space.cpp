#include "memfit/measure/memory_space.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <chrono>

namespace memfit {
namespace {
thread_local MemorySpace t_cpu_space = MemorySpace::kDevice;
}

MemorySpace current_cpu_space() { return t_cpu_space; }

HostSpaceGuard::HostSpaceGuard() : previous_(t_cpu_space) { t_cpu_space = MemorySpace::kHost; }
HostSpaceGuard::~HostSpaceGuard() { t_cpu_space = previous_; }

DeviceSpaceGuard::DeviceSpaceGuard() : previous_(t_cpu_space) { t_cpu_space = MemorySpace::kDevice; }
DeviceSpaceGuard::~DeviceSpaceGuard() { t_cpu_space = previous_; }

at::Tensor copy_to_host(const at::Tensor& tensor, bool non_blocking) {
  if (tensor.is_cuda()) {
    at::Tensor host = at::empty(tensor.sizes(), tensor.options().device(at::kCPU).pinned_memory(true));
    host.copy_(tensor, non_blocking);
    return host;
  }
  HostSpaceGuard host;
  return tensor.clone(at::MemoryFormat::Preserve);
}

at::Tensor copy_to_device(const at::Tensor& host, const c10::Device& device, bool non_blocking) {
  if (device.is_cuda()) return host.to(device, non_blocking, /*copy=*/true);
  DeviceSpaceGuard on_device;
  return host.clone(at::MemoryFormat::Preserve);
}

double measure_copy_bytes_per_second(const c10::Device& device) {
  constexpr int64_t kBytes = 8 << 20;
  const at::Tensor on_device = at::ones({kBytes / 4}, at::TensorOptions().device(device));
  double best = 0;
  for (int round = 0; round < 3; ++round) {  // the best of three: the first pays for first touch
    const auto t0 = std::chrono::steady_clock::now();
    const at::Tensor back = copy_to_device(copy_to_host(on_device), device);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (s > 0) best = std::max(best, 2.0 * kBytes / s);
  }
  return best;
}

}  // namespace memfit
