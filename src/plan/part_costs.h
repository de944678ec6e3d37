// part_costs.h — what a partwise model's runs measured (part_measure.h) in the planner's terms
// (schedule.h's BlockCost). Private to src/plan/: the profile (profile.cpp) calls it.
//
// The schedule model's peaks are above the bytes it counts at that moment: the step's fixed
// bytes, what earlier parts keep, the gradients of later parts, the gradient arriving for the
// part's output. So each absolute peak measured is taken above exactly those bytes, as they were
// in the run it was measured on: the model then reproduces that run, and what it predicts for
// other schedules and sizes follows from the same terms. Each call reads the tracker's events of
// the run it is given, so it must come before the next run is recorded.
#pragma once

#include <cstdint>
#include <vector>

#include "memfit/measure/memory_tracker.h"
#include "memfit/plan/profile.h"
#include "plan/part_measure.h"

namespace memfit {

// The live bytes a part's forward and backward peaks are taken above, in the plain run.
struct PartOffsets {
  int64_t forward = 0, backward = 0;
};

// The parts' costs from a plain run (a step's first micro-batch), their peaks' moments, and
// each part's offsets; their seconds come from add_accumulating.
struct PartCosts {
  std::vector<BlockCost> costs;
  std::vector<BlockMoments> moments;
  std::vector<PartOffsets> offsets;
  std::vector<int64_t> block_output_saved_bytes;  // the plain run's: its block's output, where its graph saved it
};
PartCosts part_costs(const PartwiseModel& model, const MemoryTracker& tracker, MemoryDevice device,
                     const PartsMeasured& plain);

// Each part's backward with every gradient there before, added into (a step's later
// micro-batches), in the plain run's terms less the gradients of later parts (alive from the
// start of this run); and what is live beyond those terms at its first read of a saved tensor
// (where a non-reentrant checkpoint recomputes the segment it ends). Each part's seconds are
// this run's: it runs after the plain run, which paid for the size's first use (kernels built),
// and adds into gradients as the timed steps do (time_parts).
void add_accumulating(PartCosts& parts, const MemoryTracker& tracker, MemoryDevice device, const PartsMeasured& plain,
                      const PartsMeasured& accumulating);

// Each part's backward with each gradient leaving once made (the optimizer offloaded), above the
// plain run's offsets less the gradients of later parts (gone).
void add_streamed(PartCosts& parts, const PartsMeasured& plain, const PartsMeasured& streamed);

// The forward without grad's peaks, each above its part's start (its input alive: the schedule
// counts the input, and what earlier parts left, beside it), and their moments; what each part
// keeps to the end of that forward (BlockCost::segment_kept_bytes, segment_output_kept).
void add_nograd(PartCosts& parts, const MemoryTracker& tracker, MemoryDevice device, const PartsMeasured& nograd);

}  // namespace memfit
