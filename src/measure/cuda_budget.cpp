#include "memfit/measure/cuda_budget.h"

#include <torch/torch.h>

#include <algorithm>

#include "memfit/compat.h"

#if MEMFIT_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_runtime_api.h>
#endif

namespace memfit {

#if MEMFIT_WITH_CUDA
namespace {

bool has_cuda_device(int device) { return device >= 0 && device < static_cast<int>(c10::cuda::device_count()); }

// (free, total) bytes of the current device, as the driver reports them.
std::pair<int64_t, int64_t> free_and_total() {
  size_t free = 0, total = 0;
  C10_CUDA_CHECK(cudaMemGetInfo(&free, &total));
  return {static_cast<int64_t>(free), static_cast<int64_t>(total)};
}

}  // namespace

CudaMemoryFractionGuard::CudaMemoryFractionGuard(int64_t cap_bytes, int device) : device_(device) {
  if (!has_cuda_device(device)) return;
  c10::cuda::CUDAGuard on(static_cast<c10::DeviceIndex>(device));
  const int64_t total = free_and_total().second;
  previous_ = compat::cuda_memory_fraction(device);
  fraction_ = std::clamp(static_cast<double>(cap_bytes) / static_cast<double>(total), 0.0, 1.0);
  compat::set_cuda_memory_fraction(fraction_, device);
  limit_bytes_ = static_cast<int64_t>(fraction_ * static_cast<double>(total));  // as the allocator rounds it
  active_ = true;
}

CudaMemoryFractionGuard::~CudaMemoryFractionGuard() {
  if (active_) compat::set_cuda_memory_fraction(previous_, device_);
}

OutsideMemory measure_outside_memory(int device) {
  OutsideMemory m;
  if (!has_cuda_device(device)) return m;
  c10::cuda::CUDAGuard on(static_cast<c10::DeviceIndex>(device));
  const auto [free_with_context, total] = free_and_total();  // the first runtime call makes the context
  const int64_t reserved_before = cuda_allocator_counters(device).reserved;
  {
    // 64 x 64 fp32 (16 KiB each): enough to make cuBLAS create its handle and workspace.
    const auto a = torch::ones({64, 64}, torch::TensorOptions().device(torch::kCUDA, device));
    (void)torch::mm(a, a);
    c10::cuda::device_synchronize();
  }
  const int64_t free_after_cublas = free_and_total().first;
  const int64_t reserved_after = cuda_allocator_counters(device).reserved;
  m.device_total = total;
  m.context_and_others = std::max<int64_t>(0, total - free_with_context - reserved_before);
  m.cublas = std::max<int64_t>(0, (free_with_context - free_after_cublas) - (reserved_after - reserved_before));
  return m;
}

CudaAllocatorCounters cuda_allocator_counters(int device) {
  CudaAllocatorCounters c;
  if (!has_cuda_device(device)) return c;
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(device));
  const size_t all = compat::kAggregateStat;
  c.allocated = stats.allocated_bytes[all].current;
  c.reserved = stats.reserved_bytes[all].current;
  c.peak_allocated = stats.allocated_bytes[all].peak;
  c.peak_reserved = stats.reserved_bytes[all].peak;
  c.num_alloc_retries = stats.num_alloc_retries;
  c.num_ooms = stats.num_ooms;
  return c;
}

void reset_cuda_allocator_counters(int device) {
  if (!has_cuda_device(device)) return;
  c10::cuda::CUDACachingAllocator::resetPeakStats(static_cast<c10::DeviceIndex>(device));
  c10::cuda::CUDACachingAllocator::resetAccumulatedStats(static_cast<c10::DeviceIndex>(device));
}

#else  // no CUDA: nothing to cap or measure

CudaMemoryFractionGuard::CudaMemoryFractionGuard(int64_t, int device) : device_(device) {}
CudaMemoryFractionGuard::~CudaMemoryFractionGuard() = default;
OutsideMemory measure_outside_memory(int) { return {}; }
CudaAllocatorCounters cuda_allocator_counters(int) { return {}; }
void reset_cuda_allocator_counters(int) {}

#endif

}  // namespace memfit
