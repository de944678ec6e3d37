// cuda_budget.h — on a GPU the budget is the CUDA caching allocator's: a memory fraction caps
// its reserved bytes (as torch.cuda.set_per_process_memory_fraction does), memory outside the
// allocator (the CUDA context, cuBLAS's workspace, other processes) is measured, and the
// allocator's own counters are read.
//
//   const memfit::OutsideMemory outside = memfit::measure_outside_memory(0);   // once, at start
//   {
//     memfit::CudaMemoryFractionGuard cap(budget - outside.total(), 0);        // reserved <= cap
//     ... steps: an allocation past the cap frees the cache, retries, then raises OutOfMemoryError
//   }                                                                          // fraction restored
//
// Without CUDA (a CPU build, or no device) every call here is a no-op returning zeros, and the
// guard is inactive: on the CPU the BudgetAllocator enforces the budget.
#pragma once

#include <cstdint>

namespace memfit {

// Sets the caching allocator's memory fraction of `device` to cap_bytes / its total memory
// (at most 1) for the guard's lifetime, then restores the fraction before (1, unset, where the
// LibTorch cannot read it back).
class CudaMemoryFractionGuard {
 public:
  CudaMemoryFractionGuard(int64_t cap_bytes, int device = 0);
  ~CudaMemoryFractionGuard();
  CudaMemoryFractionGuard(const CudaMemoryFractionGuard&) = delete;
  CudaMemoryFractionGuard& operator=(const CudaMemoryFractionGuard&) = delete;

  bool active() const { return active_; }
  double fraction() const { return fraction_; }
  // The reserved bytes allowed: fraction x the device's total memory, as the allocator computes it.
  int64_t limit_bytes() const { return limit_bytes_; }

 private:
  int device_ = 0;
  bool active_ = false;
  double fraction_ = 1.0;
  double previous_ = 1.0;
  int64_t limit_bytes_ = 0;
};

// Device memory the caching allocator does not hold, measured after the CUDA context exists
// and again after the first cuBLAS call (which creates its handle and workspace).
struct OutsideMemory {
  int64_t device_total = 0;
  int64_t context_and_others = 0;  // in use once the context exists, less the allocator's reserved bytes
  int64_t cublas = 0;              // what the first cuBLAS call took outside the allocator
  int64_t total() const { return context_and_others + cublas; }
};
OutsideMemory measure_outside_memory(int device = 0);

// The caching allocator's statistics for `device` (all pools).
struct CudaAllocatorCounters {
  int64_t allocated = 0;
  int64_t reserved = 0;
  int64_t peak_allocated = 0;  // max_memory_allocated
  int64_t peak_reserved = 0;   // max_memory_reserved
  int64_t num_alloc_retries = 0;
  int64_t num_ooms = 0;
};
CudaAllocatorCounters cuda_allocator_counters(int device = 0);
// Peaks start again from the current bytes; retries and out-of-memory counts from 0.
void reset_cuda_allocator_counters(int device = 0);

}  // namespace memfit
