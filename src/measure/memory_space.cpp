#include "memfit/measure/memory_space.h"

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <chrono>
#include <future>

#include "memfit/compat.h"
#include "memfit/measure/budget_allocator.h"
#include "memfit/measure/cuda_budget.h"
#include "memfit/measure/memory_tracker.h"

#if MEMFIT_WITH_CUDA
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif

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

struct CopyToDevice::Pending {
  at::Tensor host, device;
  std::future<void> done;  // the CPU's copy
#if MEMFIT_WITH_CUDA
  std::unique_ptr<at::cuda::CUDAEvent> copied;  // recorded on the side stream after the copy
#endif
};

namespace {

#if MEMFIT_WITH_CUDA
// The copy on a side stream, after what the compute stream has queued; `copied` marks its end.
void start_on_side_stream(CopyToDevice::Pending& p, const c10::Device& device) {
  const c10::cuda::CUDAStream compute = c10::cuda::getCurrentCUDAStream(device.index());
  const c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool(false, device.index());
  p.device = at::empty(p.host.sizes(), p.host.options().device(device));  // on the compute stream
  p.device.record_stream(side);  // not reused before the side stream is done with it
  at::cuda::CUDAEvent made;
  made.record(compute);
  made.block(side);
  c10::cuda::CUDAStreamGuard on_side(side);
  p.device.copy_(p.host, /*non_blocking=*/true);  // pinned host memory: asynchronous
  p.copied = std::make_unique<at::cuda::CUDAEvent>();
  p.copied->record(side);
}
#endif

// The copy (a memcpy) on one of LibTorch's inter-op threads; `done` marks its end.
void start_on_inter_op_thread(CopyToDevice::Pending& p) {
  {
    DeviceSpaceGuard on_device;
    p.device = at::empty_like(p.host, at::MemoryFormat::Preserve);
  }
  // The task's references live in one shared job, dropped before the caller is told: at::launch
  // keeps copies of the task until its thread is done with it, and the caller's references must
  // be the last, so that the memory is freed on the caller's thread, where its MemoryTracker
  // counts the free.
  struct Job {
    at::Tensor from, to;
    std::promise<void> done;
  };
  auto job = std::make_shared<Job>();
  job->from = p.host;
  job->to = p.device;
  p.done = job->done.get_future();
  at::launch([job] {
    std::exception_ptr error;
    try {
      job->to.copy_(job->from);
    } catch (...) {
      error = std::current_exception();
    }
    job->from = at::Tensor();
    job->to = at::Tensor();
    if (error) {
      job->done.set_exception(error);
    } else {
      job->done.set_value();
    }
  });
}

}  // namespace

CopyToDevice::CopyToDevice(const at::Tensor& host, const c10::Device& device) : pending_(std::make_unique<Pending>()) {
  pending_->host = host;
#if MEMFIT_WITH_CUDA
  if (device.is_cuda()) {
    start_on_side_stream(*pending_, device);
    return;
  }
#endif
  start_on_inter_op_thread(*pending_);
}

CopyToDevice::~CopyToDevice() {
  if (pending_ && pending_->done.valid()) pending_->done.wait();
}

at::Tensor CopyToDevice::wait() {
  Pending& p = *pending_;
#if MEMFIT_WITH_CUDA
  if (p.copied) p.copied->block(c10::cuda::getCurrentCUDAStream(p.device.device().index()));
#endif
  if (p.done.valid()) p.done.get();
  p.host = at::Tensor();
  return p.device;
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

int64_t allocated_on(const c10::Device& device) {
  if (device.is_cuda()) return cuda_allocator_counters(device.has_index() ? device.index() : 0).allocated;
  return BudgetAllocator::install().allocated();
}

int64_t untracked_bytes(const MemoryTracker& tracker, const c10::Device& device) {
  return std::max<int64_t>(0, allocated_on(device) - tracker.current(memory_device_of(device)));
}

}  // namespace memfit
