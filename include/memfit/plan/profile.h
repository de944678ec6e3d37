// profile.h — what a model's step costs, measured: the input of the planner (planner.h), kept
// apart from it so that the search can run on costs written by hand (tests) or loaded. One
// profiler for every model memfit can run part by part (partwise.h): the C++ Chain, a
// TorchScript file, the Python package's runner of the user's nn.Module.
//
// Bytes. At each of a few micro-batch sizes (a half and a quarter of the batch, and one and two
// samples where the quarter is more), the model's whole step runs as a step runs it, each part measured
// in place (part_measure.h): a plain forward + backward (a step's first micro-batch), the same
// with every gradient there before (its later micro-batches), a forward without grad (inside a
// checkpointed segment) and, where the optimizer may be offloaded, a backward with each gradient
// leaving once made. The absolute peaks are put in the schedule model's terms (schedule.h), so
// that the model reproduces each run it was measured on (src/plan/part_costs.h). Bytes at other
// sizes are fitted through the measured sizes (cost_fit.h).
//
// Time: the plain step's forward + backward is measured at half the batch and at the quarter,
// three runs of each as in a step (adding into gradients, as a step's later micro-batches do;
// more, up to nine, while a size's runs add up to under a quarter second), alternating, each
// point the median of its runs (timing_rounds.h). Elsewhere the line through them is only a
// first guess: below the quarter fixed per-call costs make small micro-batches slower than any
// line says, and above it caches make larger ones slower or faster per sample, by machine and
// model. So every size that a plan, or a rival predicted close to it, would run and that is not
// measured is timed before the plan is taken (plan_timing_as_needed in job.h, time_step_sizes
// here), beside the quarter, whose earlier time sets the scale. Those points are the time model;
// the parts' seconds only divide a point's time among parts.
//
// Only the precision whose parts ran fastest at half the batch is timed in the profile: the
// search needs another precision's times only where that precision's plans come close. Until
// then such a precision's step is guessed as the timed one's, scaled by the two precisions' part
// seconds at half the batch; the planner times it when a plan or a close rival runs it.
//
// A mixed precision is first probed on the fewest samples the baseline trained on (one, or two
// where BatchNorm meets a 1x1 map): forwards at the baseline and at it, then, where their ratio
// is not clearly over or under 3x, whole steps; the best of up to three alternating runs each,
// a slow first run counted as one. One that runs over 3x slower is not profiled, with a note:
// bf16 on a CPU without bf16 instructions runs many times slower, and profiling it would take
// most of planning for a precision no plan would choose. One the model cannot run is dropped
// with a note too.
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "memfit/measure/memory_tracker.h"
#include "memfit/plan/optimizer_costs.h"
#include "memfit/plan/partwise.h"
#include "memfit/plan/peak_moments.h"
#include "memfit/plan/schedule.h"
#include "memfit/runtime/workload.h"
#include "memfit/techniques/autocast.h"

namespace memfit {

// The moments of a part's measured peaks (peak_moments.h). The held peaks are whole (the
// backward's peak with what is held on top), not the excess over it that BlockCost keeps.
struct BlockMoments {
  PeakMoments forward, forward_nograd, backward, backward_accumulating;
  PeakMoments backward_input_held, backward_segment_end, backward_all;
};

// Per-part costs measured at one micro-batch size.
struct ChainProfile {
  int64_t micro_batch = 0;
  std::vector<BlockCost> blocks;
  std::vector<BlockMoments> moments;  // by part; empty where not recorded (costs written by hand)
  double forward_nograd_seconds = 0;  // the recomputable parts' forward without grad (what recomputing adds)
};

// Seconds of the plain step's forward + backward on one micro-batch of `micro_batch` samples.
struct ChainSeconds {
  int64_t micro_batch = 0;
  double seconds = 0;
};

// A point timed before, at one precision, that later timings run beside and are scaled to.
struct TimingReference {
  Precision precision = Precision::kFP32;
  ChainSeconds point;
};

// What one precision costs: the parts at two or three sizes, and the whole plain step's time.
struct PrecisionProfile {
  Precision precision = Precision::kFP32;
  ChainProfile small, large;
  // The parts at the sizes under small, ascending (one sample, and two where small is more):
  // bytes only. A size the model cannot train on is left out (BatchNorm on a 1x1 map at one
  // sample): plans of that size then fail when run, as the model would.
  std::vector<ChainProfile> below;
  // The fewest samples the model trained on here (2 where one sample failed, as BatchNorm on one
  // value per channel): the planner searches no smaller micro-batch.
  int64_t fewest_samples = 1;
  double calibration = 1.0;            // measured / modelled bytes (1: measured in the model's terms)
  // By micro-batch, ascending; empty: not timed yet (guessed from the parts, see above). At
  // least one precision of a profile is timed.
  std::vector<ChainSeconds> chain_seconds;
};

// One precision's costs measured on the batch cut to `length` (its samples unchanged): what
// batch_shape.h fits the costs of other lengths through.
struct LengthProfile {
  int64_t length = 0;
  PrecisionProfile profile;
};

struct WorkloadProfile {
  int64_t batch = 0;                   // samples per step the profile is for
  int64_t weight_bytes = 0;            // all parameters
  int64_t batch_bytes = 0;             // one batch's tensors
  int64_t segment_overhead_bytes = 0;  // what each checkpointed segment keeps besides its input (RNG state)
  std::vector<PrecisionProfile> precisions;  // the first is the baseline
  std::vector<std::string> notes;      // precisions dropped, and why
  bool non_reentrant_checkpoint = false;  // ChainCosts::non_reentrant (the Python package's)
};

struct ProfileOptions {
  // The optimizer may be offloaded: each part's backward with gradients streamed is measured too.
  bool streamed = false;
  // Told as the work goes: done of total steps of it, and what the last one was.
  std::function<void(int done, int total, const std::string& what)> progress;
};

// The model's costs at each precision (the step timed at the precision whose parts ran
// fastest); a mixed precision the model cannot run, or runs over 3x slower than the first, is
// dropped with a note (the first, the baseline, must run). `tracker` must be installed on this
// thread and not recording. The caller's random stream and gradients are left as they were.
WorkloadProfile profile_parts(PartwiseModel& model, const std::vector<Precision>& precisions, MemoryTracker& tracker,
                              const ProfileOptions& options = {});

// One precision's parts at a quarter and a half of the batch, and one and two samples (its step not
// timed): what profile_parts does per precision, for a precision added later (a rank whose
// probe dropped a precision that rank 0's plan runs).
PrecisionProfile profile_precision(PartwiseModel& model, Precision precision, MemoryTracker& tracker,
                                   const ProfileOptions& options = {});

// The parts' costs at one micro-batch size (every run of it above).
ChainProfile profile_parts_at(PartwiseModel& model, int64_t micro_batch, Precision precision, MemoryTracker& tracker,
                              const ProfileOptions& options = {});

// Seconds of the plain step's forward + backward on the first m samples at `precision`, for
// each m of `sizes`: each size's median of three or more runs as in a step (a size the model has
// not run first runs once, paying for first use, itself one of them where it took a quarter
// second or more), the runs
// alternating with a `reference` point timed before (at its own precision), and each median
// scaled by the reference's seconds over its median now. So a size timed later is put beside the
// earlier ones by a ratio measured seconds apart (a shared machine's speed can drift by half over
// minutes). Where the plain step runs out of memory (a device's real memory), every block is
// recomputed in all these runs: the ratio then stands in for the plain one.
std::vector<double> time_step_sizes(PartwiseModel& model, Precision precision, const std::vector<int64_t>& sizes,
                                    const TimingReference& reference);

// The same for a Workload's chain on `batch` (ChainParts).
WorkloadProfile profile_workload(Workload& workload, const Batch& batch, const std::vector<Precision>& precisions,
                                 MemoryTracker& tracker, const ProfileOptions& options = {});

// The one JSON form of the measurements (the profile cache's files): numbers round-trip
// exactly, so a plan made from a read profile equals the plan made from the measured one.
// The reader throws std::invalid_argument naming the first bad field.
nlohmann::json profile_json(const WorkloadProfile& profile);
WorkloadProfile profile_from_json(const nlohmann::json& j);
nlohmann::json length_profile_json(const LengthProfile& profile);
LengthProfile length_profile_from_json(const nlohmann::json& j, size_t blocks);

}  // namespace memfit
