// compat.h — every difference between LibTorch 1.13 (Debian) and 2.x lives here, nowhere else.
#pragma once

#include <ATen/autocast_mode.h>
#include <c10/core/Allocator.h>
#include <torch/version.h>

#define MEMFIT_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||         \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

// MEMFIT_WITH_CUDA is defined by CMake when the Torch it found was built with CUDA.
#ifndef MEMFIT_WITH_CUDA
#define MEMFIT_WITH_CUDA 0
#endif

namespace memfit::compat {

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

}  // namespace memfit::compat
