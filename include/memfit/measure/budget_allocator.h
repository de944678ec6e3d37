// budget_allocator.h — a CPU allocator with a hard budget, so an over-budget step fails on
// CPU exactly as it would on a GPU: with LibTorch's c10::OutOfMemoryError, catchable, after
// which the process goes on (the failed step's tensors are freed as the exception unwinds).
//
// What the budget covers: tensor storage allocated through LibTorch's CPU allocator (every
// at::empty and everything built on it). What it cannot cover: memory that BLAS, oneDNN or
// the C++ runtime allocate for themselves (workspaces, thread stacks), and tensors allocated
// before the allocator was installed.
//
//   auto& alloc = memfit::BudgetAllocator::install();   // once, before creating tensors
//   alloc.set_budget(512 << 20);                          // 512 MiB of tensor storage
//   try { step(); } catch (const c10::OutOfMemoryError& e) { ... }
//
// Layout of one allocation: a 64-byte header holding the size and the memory space, then the
// data (64-byte aligned, like c10's own allocator). Each allocation and free is reported to the
// thread's memory reporter (MemoryTracker), as c10's allocator does.
//
// Two pools (memory_space.h): allocations made under a HostSpaceGuard go to the host pool,
// counted apart (host_allocated, host_peak) and never refused; the budget covers the device
// pool only.
#pragma once

#include <c10/core/Allocator.h>

#include <atomic>
#include <cstdint>
#include <limits>

#include "memfit/compat.h"

namespace memfit {

class BudgetAllocator final : public c10::Allocator {
 public:
  static constexpr int64_t kUnlimited = std::numeric_limits<int64_t>::max();

  // Installs the process-wide allocator as LibTorch's CPU allocator (idempotent) and returns it.
  static BudgetAllocator& install();
  // The installed allocator, or nullptr if install() was never called.
  static BudgetAllocator* installed();

  // Budget in bytes of live tensor storage; kUnlimited turns the limit off.
  void set_budget(int64_t bytes);
  int64_t budget() const { return budget_.load(); }
  int64_t allocated() const { return allocated_.load(); }
  int64_t peak() const { return peak_.load(); }
  void reset_peak() { peak_.store(allocated_.load()); }
  int64_t oom_count() const { return ooms_.load(); }
  // The host pool (offloaded bytes): live and peak.
  int64_t host_allocated() const { return host_allocated_.load(); }
  int64_t host_peak() const { return host_peak_.load(); }
  // Whether `data` is memory of this allocator's host pool (made under a HostSpaceGuard).
  static bool in_host_pool(const c10::DataPtr& data);

  // Fault injection for tests and demos: the n-th allocation from now (1 = the next one)
  // fails as if over budget. 0 disarms.
  void fail_allocation_after(int64_t n) { fail_countdown_.store(n); }

  c10::DataPtr allocate(size_t nbytes) MEMFIT_ALLOCATE_CONST override;
  c10::DeleterFnPtr raw_deleter() const override { return &Delete; }
  MEMFIT_ALLOCATOR_COPY_DATA

 private:
  BudgetAllocator() = default;
  static void Delete(void* data);
  c10::DataPtr allocate_host(int64_t n) const;
  static c10::DataPtr with_header(int64_t n, bool host, int64_t total);

  static constexpr size_t kHeader = 64;  // keeps data 64-byte aligned
  mutable std::atomic<int64_t> budget_{kUnlimited};
  mutable std::atomic<int64_t> allocated_{0};
  mutable std::atomic<int64_t> peak_{0};
  mutable std::atomic<int64_t> ooms_{0};
  mutable std::atomic<int64_t> fail_countdown_{0};
  mutable std::atomic<int64_t> host_allocated_{0};
  mutable std::atomic<int64_t> host_peak_{0};
};

// Sets the installed allocator's budget for a scope, restoring the previous one after.
class BudgetGuard {
 public:
  explicit BudgetGuard(int64_t bytes);
  ~BudgetGuard();
  BudgetGuard(const BudgetGuard&) = delete;
  BudgetGuard& operator=(const BudgetGuard&) = delete;

 private:
  int64_t previous_;
};

}  // namespace memfit
