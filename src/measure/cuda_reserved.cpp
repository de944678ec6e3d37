#include "memfit/measure/cuda_reserved.h"

#include <algorithm>
#include <cstdlib>
#include <regex>
#include <stdexcept>
#include <string>

#include "memfit/compat.h"

namespace memfit {
namespace {

// The trace as allocator events of one device: the allocations alive at the start first.
// *series_index: where event `series_from` of the trace lands among them.
std::vector<AllocationEvent> device_events(const AllocationTrace& trace, MemoryDevice device, size_t series_from,
                                           size_t* series_index, const std::vector<int64_t>& workspaces = {}) {
  std::vector<AllocationEvent> out;
  out.reserve(workspaces.size() + trace.live_at_start.size() + trace.events.size());
  // Odd addresses: no tensor's storage starts at one.
  for (size_t k = 0; k < workspaces.size(); ++k) out.push_back({reinterpret_cast<const void*>(2 * k + 1), workspaces[k]});
  for (const LiveAllocation& a : trace.live_at_start) {
    if (a.device == device) out.push_back({a.ptr, a.bytes});
  }
  *series_index = out.size();
  for (size_t i = 0; i < trace.events.size(); ++i) {
    if (i == series_from) *series_index = out.size();
    const MemoryEvent& e = trace.events[i];
    if (e.device == device) out.push_back({e.ptr, e.delta});
  }
  if (series_from >= trace.events.size()) *series_index = out.size();
  return out;
}

// What the allocator held at the trace's start beyond the trace's live allocations as the model
// places them.
struct OutsideTrace {
  int64_t reserved = 0, allocated = 0;
};

OutsideTrace outside_trace(const AllocationTrace& trace, MemoryDevice device, const CudaPredictionOptions& o) {
  if (o.reserved_at_start < 0 && o.allocated_at_start < 0) return {};
  AllocationTrace start{trace.live_at_start, {}};
  size_t unused = 0;
  CudaAllocatorModel model({o.rules, o.conf, 0});
  replay_allocations(model, device_events(start, device, 0, &unused));
  return {std::max<int64_t>(0, o.reserved_at_start - model.reserved()),
          std::max<int64_t>(0, o.allocated_at_start - model.allocated())};
}

nlohmann::json conf_json(const CudaAllocatorConf& c) {
  const auto mib_or_null = [](int64_t bytes) -> nlohmann::json {
    return bytes == cuda_sizes::kNoLimit ? nlohmann::json(nullptr) : nlohmann::json(bytes / cuda_sizes::kMiB);
  };
  return {{"PYTORCH_CUDA_ALLOC_CONF", c.text},
          {"max_split_size_mb", mib_or_null(c.max_split_size)},
          {"max_non_split_rounding_mb", c.max_non_split_rounding / cuda_sizes::kMiB},
          {"roundup_power2_divisions", c.roundup_power2_divisions},
          {"roundup_bypass_threshold_mb", mib_or_null(c.roundup_bypass_threshold)},
          {"garbage_collection_threshold", c.garbage_collection_threshold},
          {"expandable_segments", c.expandable_segments}};
}

}  // namespace

AllocationTrace recorded_trace(const MemoryTracker& tracker) {
  return {tracker.live_at_start(), tracker.events()};
}

void append_recording(AllocationTrace& trace, const MemoryTracker& tracker) {
  trace.events.insert(trace.events.end(), tracker.events().begin(), tracker.events().end());
}

CudaPredictionOptions cuda_prediction_options_from_env() {
  CudaPredictionOptions o;
  o.rules = cuda_allocator_rules_from_name(compat::kCudaAllocatorRulesName);
  o.conf = cuda_alloc_conf_from_env(o.rules);
  return o;
}

int64_t cublas_workspace_bytes(int major) {
  const char* config = std::getenv("CUBLAS_WORKSPACE_CONFIG");
  int64_t total = 0;
  if (config != nullptr) {
    static const std::regex pair(":([0-9]+):([0-9]+)");
    const std::string text(config);
    try {
      for (auto it = std::sregex_iterator(text.begin(), text.end(), pair); it != std::sregex_iterator(); ++it) {
        total += std::stoll((*it)[1].str()) * 1024 * std::stoll((*it)[2].str());
      }
    } catch (const std::out_of_range&) {
      total = 0;  // as LibTorch does with a value it cannot read: the default
    }
  }
  if (total > 0) return total;
  const bool large = major == 9 || major == 10 || major == 12;
  return large ? int64_t{4096} * 8 * 1024 : int64_t{4096} * 1024 * 2 + int64_t{16} * 1024 * 8;
}

std::vector<int64_t> training_workspaces(int major) { return std::vector<int64_t>(2, cublas_workspace_bytes(major)); }

CudaReservedPrediction predict_cuda_reserved(const AllocationTrace& trace, MemoryDevice device,
                                             const CudaPredictionOptions& options, size_t series_from) {
  size_t series_index = 0;
  const std::vector<AllocationEvent> events = device_events(trace, device, series_from, &series_index, options.workspaces);
  const OutsideTrace outside = outside_trace(trace, device, options);
  const int64_t limit = options.limit_bytes > 0 ? std::max<int64_t>(1, options.limit_bytes - outside.reserved) : 0;
  CudaAllocatorModel model({options.rules, options.conf, limit});
  AllocationReplay replay = replay_allocations(model, events, series_index);
  for (int64_t& r : replay.reserved_series) r += outside.reserved;
  CudaReservedPrediction p;
  p.reserved_outside_trace = outside.reserved;
  p.allocated_outside_trace = outside.allocated;
  p.valid = true;
  p.rules = options.rules;
  p.conf_text = options.conf.text;
  p.conf = options.conf;
  p.peak_reserved = replay.peak_reserved + outside.reserved;
  p.peak_allocated = replay.peak_allocated + outside.allocated;
  p.num_alloc_retries = replay.num_alloc_retries;
  p.num_ooms = replay.num_ooms;
  for (int64_t w : options.workspaces) p.workspace_bytes += w;
  p.reserved_series = replay.reserved_series;
  return p;
}

nlohmann::json cuda_prediction_json(const CudaReservedPrediction& p) {
  return {{"cuda_reserved_peak_bytes", p.peak_reserved},
          {"cuda_allocated_peak_bytes", p.peak_allocated},
          {"cuda_num_alloc_retries", p.num_alloc_retries},
          {"cuda_num_ooms", p.num_ooms},
          {"cuda_workspace_bytes", p.workspace_bytes},
          {"cuda_reserved_outside_trace_bytes", p.reserved_outside_trace},
          {"cuda_allocator_rules", cuda_allocator_rules_name(p.rules)},
          {"cuda_allocator_conf", conf_json(p.conf)}};
}

}  // namespace memfit
