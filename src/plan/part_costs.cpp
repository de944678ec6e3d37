#include "plan/part_costs.h"

#include <algorithm>
#include <numeric>

namespace memfit {
namespace {

// A span's moments in bytes above `offset`, as its peak (`peak`, unclamped) is; unusable where
// the part was not recorded or the events miss the peak.
PeakMoments moments_of(const MemoryTracker& tracker, MemoryDevice device, const EventSpan& span, int64_t offset,
                       int64_t peak) {
  if (!span.recorded) return {};
  return peak_moments(tracker.events(), span.first, span.last, device, span.live0, offset, peak);
}

// Whether each part's output counts as kept: the last part's (the loss) always; another's when
// it is alive at the end of forward and this part made it (a view of the batch, or of an earlier
// part's tensor, is not this part's to keep). A part whose output is its input (an in-place op
// that returns what it wrote into) takes the storage over, kept where it was, counted once: as
// this part's, so that a segment starting with it counts both the saved input and the output
// it makes on its own copy.
struct KeptOutputs {
  std::vector<bool> kept;
  std::vector<int64_t> kept_bytes;  // each part's, the storage handed on counted by its last holder
};

// Whether part i's output is its input's storage (an in-place op returning what it wrote into).
bool output_is_input(const PartsMeasured& r, size_t i) {
  const StorageAt& input = r.input_storages[i];
  return i > 0 && i + 1 < r.input_storages.size() && input.data != nullptr && r.input_storages[i + 1].data == input.data;
}

// Whether part i's graph keeps its input for backward (a copy of it, inside a checkpointed
// segment that copies the input of a part writing into it): the input still alive when the
// part's backward starts, where the part before does not keep it in its own graph and it is not
// the part's output.
bool keeps_input(const PartsMeasured& r, size_t i) {
  if (i == 0 || output_is_input(r, i)) return false;
  return r.backward_storages[i].input_alive && !r.backward_storages[i - 1].output_alive;
}

KeptOutputs kept_outputs(const PartsMeasured& r) {
  const size_t n = r.output_bytes.size();
  KeptOutputs k{std::vector<bool>(n), r.kept_bytes};
  for (size_t i = 0; i < n; ++i) {
    k.kept[i] = i + 1 == n || (r.output_alive[i] && r.kept_bytes[i] >= r.output_bytes[i]);
    if (output_is_input(r, i) && k.kept[i - 1]) {
      k.kept[i - 1] = false;
      k.kept_bytes[i - 1] -= r.output_bytes[i - 1];
      k.kept[i] = true;
      k.kept_bytes[i] += r.output_bytes[i];
    }
  }
  return k;
}

// What is live at each part's start beyond what the model counts there (the bytes the parts
// before keep, the input where it is not kept): what their forward left until forward ends (a
// Python model's locals such as the embeddings' sum, key/value caches returned with its
// output). Gone by backward, so a part's forward peak is taken above them.
std::vector<int64_t> left_before(const PartsMeasured& r, const std::vector<bool>& kept_output,
                                 const std::vector<int64_t>& bases) {
  std::vector<int64_t> left;
  for (size_t i = 0; i < bases.size(); ++i) {
    const int64_t unkept_input = i > 0 && !kept_output[i - 1] ? r.output_bytes[i - 1] : 0;
    left.push_back(std::max<int64_t>(0, r.forward_events[i].live0 - bases[i] - unkept_input));
  }
  return left;
}

// What a part's backward peak grows by had some storages not been freed in it (each counted
// from its free to the span's end): its input (held by a checkpointed segment that starts with
// the part, or by the part before); its output and the gradient that arrived for it (held to a
// reentrant segment's end); all three. With the moments of those whole peaks. A storage freed
// before the span, or whose address comes back for another allocation, is not counted.
struct HeldGrowth {
  int64_t input = 0, segment_end = 0, all = 0;
  PeakMoments input_moments, segment_end_moments, all_moments;
};

HeldGrowth held_growth(const std::vector<MemoryEvent>& events, const EventSpan& span, MemoryDevice device,
                       const BackwardStorages& s, int64_t offset, int64_t peak) {
  HeldGrowth h;
  if (!span.recorded) return h;
  const void* gradient = s.gradient.data;
  bool output_alive = s.output_alive && s.output.data != nullptr && s.output.data != s.input.data;
  bool input_alive = s.input_alive && s.input.data != nullptr;
  bool gradient_alive = gradient != nullptr;
  int64_t g = 0, o = 0, in = 0;  // bytes freed so far of each
  const int64_t at0 = span.live0 - offset;
  int64_t input_held = at0, segment_end = at0, all = at0;
  PeakMomentsRecorder input_moments(at0), segment_end_moments(at0), all_moments(at0);
  for (size_t i = span.first; i < std::min(span.last, events.size()); ++i) {
    const MemoryEvent& e = events[i];
    if (e.device != device) continue;
    const bool freed = e.delta < 0;
    if (!freed) {  // the address taken by a new storage: the old one is gone
      output_alive = output_alive && e.ptr != s.output.data;
      input_alive = input_alive && e.ptr != s.input.data;
      gradient_alive = gradient_alive && e.ptr != gradient;
    } else if (gradient_alive && e.ptr == gradient) {
      g = s.gradient.bytes;
      gradient_alive = false;
    } else if (input_alive && e.ptr == s.input.data) {
      in = s.input.bytes;
      input_alive = false;
    } else if (output_alive && e.ptr == s.output.data) {
      o = s.output.bytes;
      output_alive = false;
    }
    const int64_t at = e.live - offset;
    input_held = std::max(input_held, at + in);
    segment_end = std::max(segment_end, at + g + o);
    all = std::max(all, at + g + o + in);
    input_moments.add(e, at + in);
    segment_end_moments.add(e, at + g + o);
    all_moments.add(e, at + g + o + in);
  }
  const auto above = [peak](int64_t whole) { return std::max<int64_t>(0, whole - peak); };
  h.input = above(input_held);
  h.segment_end = above(segment_end);
  h.all = above(all);
  h.input_moments = input_moments.take(input_held);
  h.segment_end_moments = segment_end_moments.take(segment_end);
  h.all_moments = all_moments.take(all);
  return h;
}

}  // namespace

PartCosts part_costs(const PartwiseModel& model, const MemoryTracker& tracker, MemoryDevice device,
                     const PartsMeasured& r) {
  const size_t n = r.output_bytes.size();
  const KeptOutputs outputs = kept_outputs(r);
  const std::vector<bool>& kept_output = outputs.kept;
  std::vector<int64_t> internal(n), bases(n);
  int64_t held = 0;  // each part's start as the model counts it: what the parts before keep
  for (size_t i = 0; i < n; ++i) {
    internal[i] = std::max<int64_t>(0, outputs.kept_bytes[i] - (kept_output[i] ? r.output_bytes[i] : 0));
    bases[i] = r.run_live0 + held;
    held += internal[i] + (kept_output[i] ? r.output_bytes[i] : 0);
  }
  const std::vector<int64_t> left = left_before(r, kept_output, bases);
  PartCosts out;
  for (size_t i = 0; i < n; ++i) {
    BlockCost c;
    c.output_bytes = r.output_bytes[i];
    c.output_kept = kept_output[i];
    c.kept_bytes = outputs.kept_bytes[i];
    c.forward_left_bytes = i + 1 < n ? left[i + 1] - left[i] : 0;
    const int64_t later_gradients = std::accumulate(r.gradient_bytes.begin() + static_cast<long>(i) + 1,
                                                    r.gradient_bytes.end(), int64_t{0});
    // Its output is alive under its backward where something (its own graph) still holds it then.
    c.keeps_own_output = r.backward_storages[i].output_alive;
    const int64_t own_output = c.keeps_own_output ? c.output_bytes : 0;
    const PartOffsets o{bases[i] + left[i], bases[i] + later_gradients + own_output + internal[i]};
    c.forward_peak = std::max<int64_t>(0, r.forward_peak[i] - o.forward);
    if (r.block_forward_peak[i] >= 0) c.recompute_peak = std::max<int64_t>(0, r.block_forward_peak[i] - o.forward);
    c.backward_peak = std::max<int64_t>(0, r.backward_peak[i] - o.backward);
    c.param_bytes = r.gradient_bytes[i];
    c.cast_bytes = 0;  // measured inside the parts' own bytes (casts made as the step makes them)
    c.recomputable = model.recomputable(static_cast<int>(i)) && r.state_changes[i].empty();
    c.input_copy_bytes = r.input_copy_bytes[i];
    c.input_copy_kept = c.input_copy_bytes > 0 && keeps_input(r, i);
    // The gradient arriving for the output is inside the backward's peak (measured here with the
    // parameters' gradients absent, a step's first micro-batch; with them there in
    // add_accumulating); what holding some storages past their use adds, from the same events.
    const HeldGrowth held = held_growth(tracker.events(), r.backward_events[i], device, r.backward_storages[i], o.backward,
                                        r.backward_peak[i] - o.backward);
    c.backward_held_input_bytes = held.input;
    c.backward_held_by_segment_bytes = held.segment_end;
    c.backward_held_all_bytes = held.all;
    BlockMoments m;
    m.forward = moments_of(tracker, device, r.forward_events[i], o.forward, r.forward_peak[i] - o.forward);
    m.backward = moments_of(tracker, device, r.backward_events[i], o.backward, r.backward_peak[i] - o.backward);
    m.backward_input_held = held.input_moments;
    m.backward_segment_end = held.segment_end_moments;
    m.backward_all = held.all_moments;
    out.costs.push_back(c);
    out.moments.push_back(std::move(m));
    out.offsets.push_back(o);
    out.block_output_saved_bytes.push_back(r.block_output_saved[i] ? r.block_output_bytes[i] : 0);
  }
  return out;
}

void add_accumulating(PartCosts& parts, const MemoryTracker& tracker, MemoryDevice device, const PartsMeasured& plain,
                      const PartsMeasured& accumulating) {
  int64_t later_gradients = 0;
  for (size_t k = parts.costs.size(); k-- > 0;) {
    BlockCost& c = parts.costs[k];
    c.forward_seconds = accumulating.forward_seconds[k];
    c.backward_seconds = accumulating.backward_seconds[k];
    const int64_t offset = parts.offsets[k].backward - plain.run_live0 - later_gradients + accumulating.run_live0;
    const int64_t peak = accumulating.backward_peak[k] - offset;
    c.backward_peak_accumulating = std::max<int64_t>(0, peak);
    parts.moments[k].backward_accumulating = moments_of(tracker, device, accumulating.backward_events[k], offset, peak);
    const int64_t read = accumulating.first_read_live[k];
    // The gradient arriving for its output is not in the offset: it is counted here.
    if (read >= 0) c.recompute_start_extra_bytes = std::max<int64_t>(0, read - offset);
    later_gradients += c.param_bytes;
  }
}

void add_streamed(PartCosts& parts, const PartsMeasured& plain, const PartsMeasured& streamed) {
  int64_t later_gradients = 0;
  for (size_t k = parts.costs.size(); k-- > 0;) {
    BlockCost& c = parts.costs[k];
    const int64_t offset = parts.offsets[k].backward - plain.run_live0 - later_gradients + streamed.run_live0;
    c.backward_peak_streamed = std::max<int64_t>(0, streamed.backward_peak[k] - offset);
    later_gradients += c.param_bytes;
  }
}

namespace {

// Bytes of `handed`, and of those not in `before` (handed to the block before too).
std::pair<int64_t, int64_t> handed_bytes(const std::vector<StorageAt>& handed, const std::vector<StorageAt>* before) {
  int64_t all = 0, fresh = 0;
  for (const StorageAt& s : handed) {
    all += s.bytes;
    const bool seen = before != nullptr && std::any_of(before->begin(), before->end(),
                                                       [&](const StorageAt& b) { return b.data == s.data; });
    if (!seen) fresh += s.bytes;
  }
  return {all, fresh};
}

}  // namespace

void add_nograd(PartCosts& parts, const MemoryTracker& tracker, MemoryDevice device, const PartsMeasured& nograd) {
  for (size_t i = 0; i < parts.costs.size(); ++i) {
    const EventSpan& span = nograd.forward_events[i];
    const int64_t peak = nograd.forward_peak[i] - span.live0;
    BlockCost& c = parts.costs[i];
    c.forward_nograd_peak = std::max<int64_t>(0, peak);
    parts.moments[i].forward_nograd = moments_of(tracker, device, span, span.live0, peak);
    if (i + 1 == parts.costs.size()) continue;  // the last part (the loss) is never in a segment
    c.segment_output_kept = nograd.output_alive[i];
    const int64_t output = c.segment_output_kept ? nograd.output_bytes[i] : 0;
    c.segment_kept_bytes = std::max<int64_t>(0, nograd.kept_bytes[i] - output);
    // Kept by the code after the block in a segment's forward, saved by its graph in a plain run.
    if (nograd.block_output_alive[i] && i < parts.block_output_saved_bytes.size()) {
      c.recomputed_output_copy_bytes = parts.block_output_saved_bytes[i];
    }
    if (i < nograd.handed.size()) {
      const auto [all, fresh] = handed_bytes(nograd.handed[i], i > 0 ? &nograd.handed[i - 1] : nullptr);
      c.handed_bytes = all;
      c.handed_new_bytes = fresh;
    }
  }
}

}  // namespace memfit
