// part_measure.h — one instrumented run of a partwise model (memfit/plan/partwise.h) at one
// micro-batch size and precision: each part measured where it runs, with the tracker's exact
// bytes. Private to src/plan/: the profile (profile.cpp) turns these measurements into block
// costs (part_costs.cpp).
//
// A part starts when the model says so (PartObserver::enter), on its input, the previous part's
// output. Forward: its seconds, its peak, its output's bytes, what it leaves alive for backward
// (allocations tagged with the part, alive at the end of forward), whether its output is alive
// then. Backward: a hook on each part's input fires when that part's backward is done, so each
// part's backward seconds, peak and the gradients of parameters it makes are measured too.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "memfit/measure/memory_tracker.h"
#include "memfit/plan/partwise.h"
#include "plan/profile_clock.h"

namespace memfit {

// The recorded events [first, last) of one part's forward or backward, begun at `live0` live
// bytes; not recorded where the part had no backward of its own.
struct EventSpan {
  size_t first = 0, last = 0;
  int64_t live0 = 0;
  bool recorded = false;
};

// A storage known by its address and size only (a reference would keep it alive).
struct StorageAt {
  const void* data = nullptr;
  int64_t bytes = 0;
};

// What a part's backward could hold past its own use, as the run found them when that backward
// started: its input (the previous part's output), its output and the gradient that arrived for
// it; each alive then or not. A checkpointed segment holds some of them to its end.
struct BackwardStorages {
  StorageAt input, output, gradient;
  bool input_alive = false, output_alive = false;
};

// What one run measured, by part. Peaks and live bytes are absolute: the tracker's count on the
// model's device.
struct PartsMeasured {
  int64_t run_live0 = 0;                 // when the run started
  std::vector<double> forward_seconds, backward_seconds;
  std::vector<int64_t> forward_peak, backward_peak;
  std::vector<int64_t> block_forward_peak;  // when its block returned (-1: the part is its block)
  std::vector<EventSpan> forward_events, backward_events;
  std::vector<int64_t> output_bytes;     // of the tensor the next part started on (0: the batch as it is)
  std::vector<int64_t> gradient_bytes;   // parameters whose gradients its backward made
  std::vector<int64_t> kept_bytes;       // allocated in its forward, alive at the end of forward
  std::vector<bool> output_alive;        // its output's storage alive at the end of forward
  std::vector<int64_t> first_read_live;  // at its backward's first read of a saved tensor (-1: none)
  std::vector<int64_t> input_copy_bytes; // PartwiseModel::input_copy_bytes of its input
  std::vector<StorageAt> input_storages;            // each part's input (none for the first)
  std::vector<std::string> state_changes;           // what its forward changed that outlives it ("": none)
  std::vector<BackwardStorages> backward_storages;  // where the run had a backward
  std::vector<std::vector<StorageAt>> handed;       // PartObserver::handed, each storage once per part
  // Each block's own output (PartObserver::block_output): its bytes, whether its graph saved it,
  // whether it was alive at the end of forward (0 / false where the part has no block).
  std::vector<int64_t> block_output_bytes;
  std::vector<bool> block_output_saved, block_output_alive;
};

enum class PartRunKind : uint8_t {
  kPlain,         // as a step's first micro-batch: no gradient there before
  kAccumulating,  // every gradient there before (zeros), added into; first saved-tensor reads watched
  kStreamed,      // each gradient released once the next is made (the optimizer offloaded)
};

// Forward + backward of `run`, the gradients released after. The tracker must be installed on
// this thread and not recording; `device` is the one it counts.
PartsMeasured measure_parts(PartwiseModel& model, MemoryTracker& tracker, MemoryDevice device, const PartRun& run,
                            PartRunKind kind);

// Forward without grad (as inside a checkpointed segment): each part's peak and seconds.
PartsMeasured measure_parts_nograd(PartwiseModel& model, MemoryTracker& tracker, MemoryDevice device,
                                   const PartRun& run);

// Seconds of a forward + backward as a step runs `run`: adding into gradients already there
// unless it is the whole batch (a step's later micro-batches add; its first writes them).
double time_parts(PartwiseModel& model, const PartRun& run);

// Seconds of the forward alone of `run`, as a step runs it (its graph dropped after): a third
// or so of time_parts, for comparisons its ratio decides.
double time_forward(PartwiseModel& model, const PartRun& run);

// The gradients of the model's parameters released (set to none).
void release_gradients(PartwiseModel& model);

}  // namespace memfit
