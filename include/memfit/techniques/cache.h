// cache.h — cached versus allocated memory, and giving the cache back.
//
// CUDA's caching allocator keeps freed blocks for reuse: "reserved" bytes exceed "allocated"
// ones. empty_cache() returns unused cached blocks to the driver; it frees no live tensor, so
// it never fixes a leak. On CPU memfit's allocator caches nothing: reserved == allocated.
#pragma once

#include <cstdint>

namespace memfit {

struct DeviceMemory {
  int64_t allocated = 0;  // bytes of live tensor storage
  int64_t reserved = 0;   // bytes held by the allocator (>= allocated)
  int64_t peak_allocated = 0;
};

bool cuda_available();
// CUDA device `device` (current counters of the caching allocator); zeros without CUDA.
DeviceMemory cuda_memory(int device = 0);
// Releases unused cached CUDA blocks; no-op without CUDA.
void empty_cache();

}  // namespace memfit
