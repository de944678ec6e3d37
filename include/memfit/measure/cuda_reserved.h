// cuda_reserved.h — what a recorded run would reserve on a CUDA device: the tracker's
// allocation trace replayed on the caching allocator model (cuda_allocator_model.h), under the
// rules of the LibTorch in use and PYTORCH_CUDA_ALLOC_CONF.
//
// A trace recorded on the CPU gives a prediction before any GPU runs (its requests are the
// tensors' bytes, which the model rounds as CUDA would); one recorded on CUDA (events carry the
// allocator's block sizes) checks the model against the allocator's own counters.
//
//   tracker.start_recording();  ... steps ...
//   AllocationTrace trace = recorded_trace(tracker);
//   CudaReservedPrediction p = predict_cuda_reserved(trace, MemoryDevice::kCPU, cuda_prediction_options_from_env());
//   p.peak_reserved;  // >= the allocated peak
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "memfit/measure/cuda_allocator_model.h"
#include "memfit/measure/memory_tracker.h"

namespace memfit {

// A run's allocations: what was alive when recording started (in the order it was made), then
// every event. Several recordings of one run append into one trace.
struct AllocationTrace {
  std::vector<LiveAllocation> live_at_start;
  std::vector<MemoryEvent> events;
};
// The tracker's current recording.
AllocationTrace recorded_trace(const MemoryTracker& tracker);
// Adds the tracker's current recording, which started where `trace` ends (between the two,
// nothing was allocated or freed).
void append_recording(AllocationTrace& trace, const MemoryTracker& tracker);

struct CudaPredictionOptions {
  CudaAllocatorRules rules = CudaAllocatorRules::k2;
  CudaAllocatorConf conf;
  int64_t limit_bytes = 0;  // a memory fraction's cap on reserved bytes; 0: none
  // On CUDA, the allocator's own bytes when the trace started (-1: unknown). What they hold
  // beyond the trace's live allocations (cuBLAS's workspace, a cache warmed before the tracker)
  // is added to the prediction as it is, and taken off the cap.
  int64_t reserved_at_start = -1;
  int64_t allocated_at_start = -1;
  // Allocations the trace lacks, made before its first event: cuBLAS's workspaces, one per
  // thread that runs matrix products (the caller's, autograd's device thread), which the
  // caching allocator holds for the process's life. Given for a trace recorded off CUDA; one
  // recorded on CUDA holds them already.
  std::vector<int64_t> workspaces;
};

// cuBLAS's workspace per (handle, stream), as LibTorch 2.x sizes it on a device of compute
// capability `major`: CUBLAS_WORKSPACE_CONFIG's ":SIZE_KiB:COUNT" pairs summed, or by default
// 32 MiB on Hopper and Blackwell (9, 10, 12), 8 MiB + 128 KiB before.
int64_t cublas_workspace_bytes(int major);
// The workspaces a training step's threads hold on CUDA: the caller's and autograd's device
// thread's (a checkpointed block's recompute runs on the latter).
std::vector<int64_t> training_workspaces(int major);
// The rules of the LibTorch in use (compat.h) and PYTORCH_CUDA_ALLOC_CONF (OptionError if malformed).
CudaPredictionOptions cuda_prediction_options_from_env();

struct CudaReservedPrediction {
  bool valid = false;
  CudaAllocatorRules rules = CudaAllocatorRules::k2;
  std::string conf_text;
  CudaAllocatorConf conf;
  int64_t peak_reserved = 0;   // over the whole trace (as max_memory_reserved after the run)
  int64_t peak_allocated = 0;  // blocks handed out, rounded (as max_memory_allocated)
  int64_t num_alloc_retries = 0;  // frees of the cache to retry under options.limit_bytes
  int64_t num_ooms = 0;           // allocations that failed even then
  int64_t workspace_bytes = 0;    // the options' workspaces, included above
  int64_t reserved_outside_trace = 0;   // from CudaPredictionOptions::reserved_at_start, included above
  int64_t allocated_outside_trace = 0;
  // From event `series_from` of the trace: reserved bytes before it, then after each event
  // that breakdown.h's timeline also draws (one value per timeline point of that part).
  std::vector<int64_t> reserved_series;
};

// Replays the trace's allocations on `device` (CPU-recorded ones as if made on CUDA).
CudaReservedPrediction predict_cuda_reserved(const AllocationTrace& trace, MemoryDevice device,
                                             const CudaPredictionOptions& options, size_t series_from = 0);

// {"cuda_reserved_peak_bytes", "cuda_allocated_peak_bytes", "cuda_num_alloc_retries", "cuda_num_ooms",
//  "cuda_workspace_bytes", "cuda_reserved_outside_trace_bytes", "cuda_allocator_rules",
//  "cuda_allocator_conf": {...}} for the reports' and plans' JSON.
nlohmann::json cuda_prediction_json(const CudaReservedPrediction& prediction);

}  // namespace memfit
