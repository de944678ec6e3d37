// compat.h — every difference between LibTorch 1.13 (Debian) and 2.x lives here, nowhere else.
#pragma once

#include <ATen/autocast_mode.h>
#include <c10/core/Allocator.h>
#include <c10/util/Exception.h>
#include <torch/optim/optimizer.h>
#include <torch/version.h>

#include <sstream>
#include <string>
#include <type_traits>
#include <utility>

#define MEMFIT_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||         \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

// MEMFIT_WITH_CUDA is defined by CMake when the Torch it found was built with CUDA.
#ifndef MEMFIT_WITH_CUDA
#define MEMFIT_WITH_CUDA 0
#endif

// c10d's Gloo and NCCL process groups derive from c10d::ProcessGroup in 1.13; in 2.x they are
// c10d::Backend's (a ProcessGroup dispatches to one per device type), with the same collectives.
namespace c10d {
#if MEMFIT_TORCH_AT_LEAST(2, 0)
class Backend;
#else
class ProcessGroup;
#endif
}  // namespace c10d

namespace memfit::compat {

#if MEMFIT_TORCH_AT_LEAST(2, 0)
using ProcessGroupBackend = c10d::Backend;
#else
using ProcessGroupBackend = c10d::ProcessGroup;
#endif

// A c10::Error carrying only `message`: 1.13's constructor takes the backtrace as a string, 2.x's
// as a lazily computed value (defaulted).
template <typename Error = c10::Error>
Error error_without_backtrace(std::string message) {
  if constexpr (std::is_constructible_v<Error, std::string, std::string>) {
    return Error(std::move(message), std::string());
  } else {
    return Error(std::move(message));
  }
}

// c10::MemoryReportingInfoBase::reportMemoryUsage: the running totals were int64_t in 1.13
// and became size_t in 2.x.
#if MEMFIT_TORCH_AT_LEAST(2, 0)
using ReportTotal = size_t;
#else
using ReportTotal = int64_t;
#endif

// c10::Allocator::allocate lost its const in 2.3, which also added copy_data.
#if MEMFIT_TORCH_AT_LEAST(2, 3)
#define MEMFIT_ALLOCATE_CONST
#define MEMFIT_ALLOCATOR_COPY_DATA                                                   \
  void copy_data(void* dest, const void* src, std::size_t count) const override { \
    default_copy_data(dest, src, count);                                           \
  }
#else
#define MEMFIT_ALLOCATE_CONST const
#define MEMFIT_ALLOCATOR_COPY_DATA
#endif

// Autocast state per device type. 1.13 has per-device free functions (set_cpu_enabled,
// set_autocast_gpu_dtype, ...); 2.4 added device-typed ones and deprecated the old names.
inline bool autocast_enabled(c10::DeviceType device) {
#if MEMFIT_TORCH_AT_LEAST(2, 4)
  return at::autocast::is_autocast_enabled(device);
#else
  return device == c10::kCUDA ? at::autocast::is_enabled() : at::autocast::is_cpu_enabled();
#endif
}

inline void set_autocast_enabled(c10::DeviceType device, bool enabled) {
#if MEMFIT_TORCH_AT_LEAST(2, 4)
  at::autocast::set_autocast_enabled(device, enabled);
#else
  if (device == c10::kCUDA) {
    at::autocast::set_enabled(enabled);
  } else {
    at::autocast::set_cpu_enabled(enabled);
  }
#endif
}

inline at::ScalarType autocast_dtype(c10::DeviceType device) {
#if MEMFIT_TORCH_AT_LEAST(2, 4)
  return at::autocast::get_autocast_dtype(device);
#else
  return device == c10::kCUDA ? at::autocast::get_autocast_gpu_dtype()
                              : at::autocast::get_autocast_cpu_dtype();
#endif
}

inline void set_autocast_dtype(c10::DeviceType device, at::ScalarType dtype) {
#if MEMFIT_TORCH_AT_LEAST(2, 4)
  at::autocast::set_autocast_dtype(device, dtype);
#else
  if (device == c10::kCUDA) {
    at::autocast::set_autocast_gpu_dtype(dtype);
  } else {
    at::autocast::set_autocast_cpu_dtype(dtype);
  }
#endif
}

// The CUDA caching allocator's rules that measure/cuda_allocator_model.h follows: 1.13's, or
// 2.x's (expandable segments, roundup_power2_divisions per size interval, >= 20 MiB splits).
inline constexpr const char* kCudaAllocatorRulesName = MEMFIT_TORCH_AT_LEAST(2, 0) ? "2.x" : "1.13";

// torch::optim keys Optimizer::state() by the parameter's TensorImpl: its address as text in
// 1.13 (c10::guts::to_string, i.e. ostream << pointer), the pointer itself (void*) in 2.x.
using OptimizerStateKey =
    std::remove_reference_t<decltype(std::declval<torch::optim::Optimizer&>().state())>::key_type;

template <typename Key = OptimizerStateKey>
Key optimizer_state_key(const at::Tensor& parameter) {
  if constexpr (std::is_same_v<Key, std::string>) {
    std::ostringstream text;
    text << parameter.unsafeGetTensorImpl();
    return text.str();
  } else {
    return parameter.unsafeGetTensorImpl();
  }
}

}  // namespace memfit::compat

#if MEMFIT_WITH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>

namespace memfit::compat {

// The caching allocator's statistic kinds (StatType::AGGREGATE, ...): in
// c10::cuda::CUDACachingAllocator in 1.13; shared by every device's caching allocator, in
// c10::CachingAllocator, in 2.x (with c10/core/CachingDeviceAllocator.h).
#if __has_include(<c10/core/CachingDeviceAllocator.h>)
constexpr size_t kAggregateStat = static_cast<size_t>(c10::CachingAllocator::StatType::AGGREGATE);
#else
constexpr size_t kAggregateStat = static_cast<size_t>(c10::cuda::CUDACachingAllocator::StatType::AGGREGATE);
#endif

// The memory fraction of a device's caching allocator: set in both (an int device in 1.13, a
// DeviceIndex in 2.x); read only where the allocator has getMemoryFraction (later 2.x), else
// taken as 1, the unset fraction.
template <typename Allocator, typename = void>
struct HasGetMemoryFraction : std::false_type {};
template <typename Allocator>
struct HasGetMemoryFraction<Allocator, std::void_t<decltype(std::declval<Allocator&>().getMemoryFraction(
                                           c10::DeviceIndex{0}))>> : std::true_type {};

template <typename Allocator>
double memory_fraction_of(Allocator* allocator, int device) {
  if constexpr (HasGetMemoryFraction<Allocator>::value) {
    return allocator->getMemoryFraction(static_cast<c10::DeviceIndex>(device));
  } else {
    (void)allocator;
    (void)device;
    return 1.0;
  }
}

inline double cuda_memory_fraction(int device) {
  return memory_fraction_of(c10::cuda::CUDACachingAllocator::get(), device);
}

inline void set_cuda_memory_fraction(double fraction, int device) {
  c10::cuda::CUDACachingAllocator::setMemoryFraction(fraction, static_cast<c10::DeviceIndex>(device));
}

}  // namespace memfit::compat
#endif
