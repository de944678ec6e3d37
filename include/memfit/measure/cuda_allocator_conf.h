// cuda_allocator_conf.h — which rules PyTorch's CUDA caching allocator follows, and the
// settings PYTORCH_CUDA_ALLOC_CONF gives it, as the allocator model (cuda_allocator_model.h)
// reads them. No torch headers: the model and its tests build without LibTorch.
//
// Semantics from c10/cuda/CUDACachingAllocator.cpp (its CachingAllocatorConfig) of v1.13.1, and
// from c10/core/AllocatorConfig.cpp + c10/cuda/CUDAAllocatorConfig.cpp of 2.x (as in 2.11):
//   max_split_size_mb:N            blocks of N MiB or more are never split (1.13: N > 20; 2.x: N >= 20)
//   roundup_power2_divisions:N     requests round up to one of N steps per power of two (N a power of 2)
//   roundup_power2_divisions:[MB:N,...,>:N]   2.x: N per power-of-two interval of the size in MiB
//   roundup_bypass_threshold_mb:N  1.13: requests over N MiB skip the power-of-two rounding
//   garbage_collection_threshold:X with a memory fraction set, cached blocks are freed once
//                                  reserved bytes pass X of the allowed maximum (0 < X < 1)
//   expandable_segments:True|False 2.x: one growing segment per stream and pool
//   max_non_split_rounding_mb:N    2.x: an oversize block serves requests up to N MiB smaller (N >= 20)
//   backend:native, release_lock_on_cudamalloc, pinned_*: accepted; they change no reserved byte.
#pragma once

#include <array>
#include <cstdint>
#include <limits>
#include <string>

namespace memfit {

// The caching allocator's rules differ between LibTorch 1.13 and 2.x; compat.h names the
// version this build uses (compat::kCudaAllocatorRulesName).
enum class CudaAllocatorRules : uint8_t { k1_13, k2 };
const char* cuda_allocator_rules_name(CudaAllocatorRules rules);  // "1.13" or "2.x"
// "1.13" or "2.x"; throws OptionError("cuda_allocator_rules", ...) otherwise.
CudaAllocatorRules cuda_allocator_rules_from_name(const std::string& name);

namespace cuda_sizes {
constexpr int64_t kMiB = 1 << 20;
constexpr int64_t kMinBlockSize = 512;        // every request rounds up to a multiple of 512 B
constexpr int64_t kSmallSize = 1 * kMiB;      // the largest request served by the small pool
constexpr int64_t kSmallBuffer = 2 * kMiB;    // small-pool segments (and expandable pages)
constexpr int64_t kLargeBuffer = 20 * kMiB;   // segments for requests of 1 to 10 MiB (and expandable pages)
constexpr int64_t kMinLargeAlloc = 10 * kMiB; // requests from here get a segment of their own size
constexpr int64_t kRoundLarge = 2 * kMiB;     // ... rounded up to 2 MiB
constexpr int kRoundupIntervals = 16;         // 2.x: one divisions setting per power of two, 1 MiB to 64 GiB
constexpr int64_t kNoLimit = std::numeric_limits<int64_t>::max();
// floor(log2(v)) for v >= 1: the power-of-two interval a size falls in.
constexpr int log2_floor(int64_t v) {
  int log = 0;
  while (v > 1) v >>= 1, ++log;
  return log;
}
}  // namespace cuda_sizes

struct CudaAllocatorConf {
  int64_t max_split_size = cuda_sizes::kNoLimit;
  int64_t max_non_split_rounding = cuda_sizes::kLargeBuffer;
  // Per interval (2.x: index = log2(size in MiB), clamped to 0..15); 1.13 uses entry 0 for all.
  std::array<int64_t, cuda_sizes::kRoundupIntervals> roundup_power2_divisions{};
  int64_t roundup_bypass_threshold = cuda_sizes::kNoLimit;
  double garbage_collection_threshold = 0;
  bool expandable_segments = false;
  std::string text;  // as given (empty: the defaults)
};

// Parses PYTORCH_CUDA_ALLOC_CONF's text under `rules`, as that version accepts it. Throws
// OptionError("PYTORCH_CUDA_ALLOC_CONF", ...) naming the bad item and what is accepted.
CudaAllocatorConf parse_cuda_alloc_conf(const std::string& text, CudaAllocatorRules rules);
// The settings in the environment (unset: the defaults).
CudaAllocatorConf cuda_alloc_conf_from_env(CudaAllocatorRules rules);

}  // namespace memfit
