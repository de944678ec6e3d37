// cuda_allocator_model.h — PyTorch's CUDA caching allocator, simulated: which segments it would
// reserve for a sequence of allocations and frees, without a GPU. No torch headers.
//
// The rules, from c10/cuda/CUDACachingAllocator.cpp of v1.13.1 and of 2.x (as in 2.11); the
// semantics are reimplemented here, no code is taken:
// - a request rounds up to 512 B (or to a power-of-two division: roundup_power2_divisions);
// - requests up to 1 MiB use the small pool, carved from 2 MiB segments; larger ones the large
//   pool: under 10 MiB from 20 MiB segments, from 10 MiB a segment of the request rounded to 2 MiB;
// - a free block of the same stream and pool is reused by best fit (smallest size, then lowest
//   address); a block of max_split_size or more serves only requests of max_split_size or more
//   that are at most max_non_split_rounding (20 MiB) smaller;
// - a block larger than the request is split when the rest is at least 512 B (small pool, or
//   any pool with expandable segments) or, in the large pool, more than 1 MiB and the request is
//   under max_split_size; freed blocks merge with free neighbours of the same segment;
// - with a memory fraction (a limit here), a new segment that would pass it first triggers
//   garbage collection (garbage_collection_threshold), then frees cached oversize blocks and
//   retries, then frees every unsplit cached block and retries (num_alloc_retries), then fails
//   (num_ooms);
// - 2.x's expandable segments: one segment per stream and pool whose pages (2 MiB small,
//   20 MiB large) are mapped as needed at the lowest free address; freeing the cache unmaps
//   whole free pages;
// - empty_cache frees every unsplit cached segment (and unmaps free pages).
//
//   CudaAllocatorModel model({CudaAllocatorRules::k2, conf});
//   const int64_t a = model.malloc(3 << 20);   // 3 MiB: a 20 MiB segment is reserved
//   model.free(a);                              // cached: reserved stays 20 MiB
//   model.empty_cache();                        // reserved 0
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "memfit/measure/cuda_allocator_conf.h"

namespace memfit {

struct CudaAllocatorModelOptions {
  CudaAllocatorRules rules = CudaAllocatorRules::k2;
  CudaAllocatorConf conf;
  // The memory fraction's allowed maximum of reserved bytes (fraction x device total); 0: none set.
  int64_t limit_bytes = 0;
  // The device's memory: cudaMalloc fails past it, and expandable segments reserve address
  // space for 9/8 of it.
  int64_t device_bytes = int64_t{80} << 30;
};

// Rounding and segment sizes, as the allocator computes them.
int64_t cuda_round_size(int64_t bytes, CudaAllocatorRules rules, const CudaAllocatorConf& conf);
int64_t cuda_segment_size(int64_t rounded_bytes);

class CudaAllocatorModel {
 public:
  explicit CudaAllocatorModel(CudaAllocatorModelOptions options);
  ~CudaAllocatorModel();
  CudaAllocatorModel(const CudaAllocatorModel&) = delete;
  CudaAllocatorModel& operator=(const CudaAllocatorModel&) = delete;

  // A block for `bytes` on `stream`: its id (> 0), or 0 when the allocator would raise
  // out-of-memory (counted in num_ooms).
  int64_t malloc(int64_t bytes, int stream = 0);
  void free(int64_t id);
  void empty_cache();

  // Bytes, as the allocator's statistics count them: allocated = the blocks handed out (rounded,
  // and a block not split counts whole); reserved = segments (expandable: mapped pages).
  int64_t allocated() const;
  int64_t reserved() const;
  int64_t peak_allocated() const;
  int64_t peak_reserved() const;
  void reset_peaks();
  int64_t num_alloc_retries() const;
  int64_t num_ooms() const;
  int64_t segments() const;  // cudaMalloc'd segments (expandable: one per stream and pool)

  // A handed-out block's size and (simulated) address: where it sits in its segment.
  int64_t block_size(int64_t id) const;
  int64_t block_address(int64_t id) const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// One allocator event of a recorded trace: +bytes allocates `ptr`, -bytes frees it.
struct AllocationEvent {
  const void* ptr;
  int64_t delta;
  int stream = 0;
};

struct AllocationReplay {
  int64_t peak_reserved = 0;
  int64_t peak_allocated = 0;
  int64_t final_reserved = 0;
  // Reserved bytes after each event applied from `first_series_event` on, with the value before
  // it first (a free of a pointer not live is skipped, as breakdown.h's timeline skips it).
  std::vector<int64_t> reserved_series;
  int64_t num_alloc_retries = 0;
  int64_t num_ooms = 0;
};

// Replays `events` on `model` in order (a failed allocation's later free is ignored).
AllocationReplay replay_allocations(CudaAllocatorModel& model, const std::vector<AllocationEvent>& events,
                                    size_t first_series_event = 0);

}  // namespace memfit
