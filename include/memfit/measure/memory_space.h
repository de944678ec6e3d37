// memory_space.h — the two memory spaces of a training process: the *device*, where the budget
// applies, and the *host*, where offloaded bytes live (counted and reported, not under the
// budget). On CUDA they are the GPU and pinned CPU memory. On a CPU-only machine both are the
// same RAM, so the host is a second pool of the same allocator (BudgetAllocator): a tensor made
// under a HostSpaceGuard is counted in the host pool (MemoryDevice::kHost) and never refused,
// which keeps every byte figure of an offloaded run exact.
//
//   at::Tensor state;
//   { memfit::HostSpaceGuard host; state = at::zeros_like(weight); }   // counted as host bytes
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>

#include <memory>

namespace memfit {

enum class MemorySpace : uint8_t { kDevice = 0, kHost = 1 };

// The space this thread's CPU allocations go to now.
MemorySpace current_cpu_space();

// While alive, this thread's CPU allocations go to the host space (the previous space after).
class HostSpaceGuard {
 public:
  HostSpaceGuard();
  ~HostSpaceGuard();
  HostSpaceGuard(const HostSpaceGuard&) = delete;
  HostSpaceGuard& operator=(const HostSpaceGuard&) = delete;

 private:
  MemorySpace previous_;
};

// The reverse, inside a HostSpaceGuard: a copy brought back to the device is made on the device.
class DeviceSpaceGuard {
 public:
  DeviceSpaceGuard();
  ~DeviceSpaceGuard();
  DeviceSpaceGuard(const DeviceSpaceGuard&) = delete;
  DeviceSpaceGuard& operator=(const DeviceSpaceGuard&) = delete;

 private:
  MemorySpace previous_;
};

// A copy of `tensor` in the host space: pinned CPU memory for a CUDA tensor (page-locked, so the
// copy can overlap compute: `non_blocking`), the host pool for a CPU tensor.
at::Tensor copy_to_host(const at::Tensor& tensor, bool non_blocking = false);
// A copy of a host tensor on `device` (its device space).
at::Tensor copy_to_device(const at::Tensor& host, const c10::Device& device, bool non_blocking = false);

// A copy of a host tensor to `device` started now and finished later, beside the compute: on
// CUDA on a side stream, on the CPU on one of LibTorch's inter-op threads (a memcpy beside the
// compute's threads). The device memory is made at the start, on the calling thread, so it is
// counted and budgeted there; the host tensor is kept until the copy is done.
//
//   memfit::CopyToDevice copy(host, device);   // e.g. the next block's activations
//   ...                                        // this block's backward
//   at::Tensor back = copy.wait();
class CopyToDevice {
 public:
  CopyToDevice(const at::Tensor& host, const c10::Device& device);
  ~CopyToDevice();  // waits for an unfinished copy (its memory may not be reused under it)
  CopyToDevice(const CopyToDevice&) = delete;
  CopyToDevice& operator=(const CopyToDevice&) = delete;

  // The device tensor, the copy finished for the calling thread's work (on CUDA: its current
  // stream waits for the side stream). Rethrows an error of the copy.
  at::Tensor wait();

  struct Pending;  // the tensors and what tells the copy's end (memory_space.cpp)

 private:
  std::unique_ptr<Pending> pending_;
};

// Bytes per second of a copy from `device` to the host (pinned) and back, measured on a few MiB:
// the offload's time model. On the CPU it is a memcpy's, a stand-in for a real link.
double measure_copy_bytes_per_second(const c10::Device& device);

class MemoryTracker;
// Bytes of tensor storage the allocator of `device` holds now: memfit's BudgetAllocator's device
// pool on the CPU, the caching allocator's allocated bytes on CUDA.
int64_t allocated_on(const c10::Device& device);
// Those that `tracker` does not count (storage made before it: the caller's data tensors; on
// CUDA, cuBLAS's workspace made before it): what a budget counts beside a profiled step.
int64_t untracked_bytes(const MemoryTracker& tracker, const c10::Device& device);

}  // namespace memfit
