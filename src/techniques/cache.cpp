#include "memfit/techniques/cache.h"

#include "memfit/compat.h"

#if MEMFIT_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#endif

namespace memfit {

bool cuda_available() {
#if MEMFIT_WITH_CUDA
  return c10::cuda::device_count() > 0;
#else
  return false;
#endif
}

DeviceMemory cuda_memory(int device) {
  DeviceMemory m;
#if MEMFIT_WITH_CUDA
  if (!cuda_available()) return m;
  const auto stats = c10::cuda::CUDACachingAllocator::getDeviceStats(device);
  const size_t all = compat::kAggregateStat;
  m.allocated = stats.allocated_bytes[all].current;
  m.reserved = stats.reserved_bytes[all].current;
  m.peak_allocated = stats.allocated_bytes[all].peak;
#else
  (void)device;
#endif
  return m;
}

void empty_cache() {
#if MEMFIT_WITH_CUDA
  if (cuda_available()) c10::cuda::CUDACachingAllocator::emptyCache();
#endif
}

}  // namespace memfit
