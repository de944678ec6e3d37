#include "memfit/measure/budget_allocator.h"

#include <c10/core/CPUAllocator.h>
#include <c10/core/impl/alloc_cpu.h>
#include <c10/util/Exception.h>

#include <cstring>
#include <string>

#include "memfit/measure/memory_space.h"
#include "memfit/measure/memory_tracker.h"
#include "memfit/measure/size.h"

namespace memfit {
namespace {
std::atomic<BudgetAllocator*> g_installed{nullptr};

// The header's fields: the size, then whether the allocation is in the host pool.
constexpr size_t kHostFlagOffset = sizeof(int64_t);

void running_max(std::atomic<int64_t>& peak, int64_t value) {
  // A lost race only delays the peak by one allocation.
  int64_t seen = peak.load();
  while (value > seen && !peak.compare_exchange_weak(seen, value)) {
  }
}
}  // namespace

BudgetAllocator& BudgetAllocator::install() {
  static BudgetAllocator* instance = [] {
    auto* a = new BudgetAllocator();  // never destroyed: tensors may outlive static destructors
    c10::SetCPUAllocator(a, /*priority=*/100);
    g_installed.store(a);
    return a;
  }();
  return *instance;
}

BudgetAllocator* BudgetAllocator::installed() { return g_installed.load(); }

void BudgetAllocator::set_budget(int64_t bytes) {
  TORCH_CHECK(bytes > 0, "memfit: budget must be positive, got ", bytes, " bytes");
  budget_.store(bytes);
}

c10::DataPtr BudgetAllocator::allocate(size_t nbytes) MEMFIT_ALLOCATE_CONST {
  const c10::Device cpu(c10::kCPU);
  if (nbytes == 0) return c10::DataPtr(nullptr, nullptr, &Delete, cpu);
  const auto n = static_cast<int64_t>(nbytes);
  if (current_cpu_space() == MemorySpace::kHost) return allocate_host(n);

  const int64_t countdown = fail_countdown_.load();
  bool injected = false;
  if (countdown > 0) injected = fail_countdown_.fetch_sub(1) == 1;

  const int64_t after = allocated_.fetch_add(n) + n;
  if (injected || after > budget_.load()) {
    allocated_.fetch_sub(n);
    ooms_.fetch_add(1);
    c10::reportOutOfMemoryToProfiler(n, after - n, after - n, cpu_reported_device());
    const int64_t budget = budget_.load();
    TORCH_CHECK_WITH(OutOfMemoryError, false, "memfit: CPU out of memory",
                     injected ? " (injected)" : "", ": tried to allocate ", format_bytes(n),
                     "; budget ", budget == kUnlimited ? std::string("unlimited") : format_bytes(budget),
                     ", ", format_bytes(after - n), " already allocated");
  }
  running_max(peak_, after);
  return with_header(n, /*host=*/false, after);
}

c10::DataPtr BudgetAllocator::allocate_host(int64_t n) const {
  const int64_t after = host_allocated_.fetch_add(n) + n;
  running_max(host_peak_, after);
  return with_header(n, /*host=*/true, after);
}

c10::DataPtr BudgetAllocator::with_header(int64_t n, bool host, int64_t total) {
  const c10::Device cpu(c10::kCPU);
  auto* base = static_cast<char*>(c10::alloc_cpu(static_cast<size_t>(n) + kHeader));
  std::memcpy(base, &n, sizeof(n));
  base[kHostFlagOffset] = host ? 1 : 0;
  void* data = base + kHeader;
  // The tracker tells the pools apart by the thread's space (memory_tracker.cpp); the device
  // pool is reported as the device it is counted as (cuda:0 in the counted-as-CUDA mode).
  c10::reportMemoryUsageToProfiler(data, n, total, total, host ? cpu : cpu_reported_device());
  return c10::DataPtr(data, data, &Delete, cpu);
}

void BudgetAllocator::Delete(void* data) {
  if (data == nullptr) return;
  char* base = static_cast<char*>(data) - kHeader;
  int64_t n = 0;
  std::memcpy(&n, base, sizeof(n));
  BudgetAllocator* self = g_installed.load();
  const bool host = base[kHostFlagOffset] != 0;
  auto& pool = host ? self->host_allocated_ : self->allocated_;
  const int64_t after = pool.fetch_sub(n) - n;
  c10::reportMemoryUsageToProfiler(data, -n, after, after, host ? c10::Device(c10::kCPU) : cpu_reported_device());
  c10::free_cpu(base);
}

bool BudgetAllocator::in_host_pool(const c10::DataPtr& data) {
  if (data.get() == nullptr || data.get_deleter() != &Delete) return false;
  return (static_cast<const char*>(data.get()) - kHeader)[kHostFlagOffset] != 0;
}

BudgetGuard::BudgetGuard(int64_t bytes) {
  auto& alloc = BudgetAllocator::install();
  previous_ = alloc.budget();
  alloc.set_budget(bytes);
}

BudgetGuard::~BudgetGuard() { BudgetAllocator::install().set_budget(previous_); }

}  // namespace memfit
