// profile.h — what a workload costs, measured: the input of the planner (planner.h), kept
// apart from it so that the search can run on costs written by hand (tests) or loaded.
//
// For each candidate precision, the whole plain chain runs once at half the batch (its peak
// calibrates the blocks' bytes; the run warms allocator and caches), then each block alone
// (its input detached) at a half and a quarter of the batch: forward and backward seconds,
// output bytes, bytes kept for backward, transient peaks with and without grad, whether the
// next block keeps its input (from a batch of 4 the quarter is at least 2 samples and the half
// at least 3). Where the quarter is more than one sample, the blocks' bytes are measured at
// one sample too: some ops keep more at one sample than the line through the larger sizes
// says (the default GPT's attention: one [1, T, d] copy more a block).
// Bytes at other sizes are fitted piecewise linearly through the measured sizes (continued
// past the ends), a peak as the highest of its moments' lines where two sizes' runs allocate
// in the same order (peak_moments.h); the chain's bytes calibrate the blocks'.
//
// Time: the plain chain's forward + backward is measured at half the batch and at the quarter,
// three runs of each as in a step (adding into gradients, as a step's later micro-batches do;
// more, up to nine, while a size's runs add up to under a quarter second), alternating, each
// point the median of its runs (one statistic for every timed point; the alternation puts a
// burst of slowness on both sizes, not one). Above half, a CPU's time is
// first guessed by the line through them continued; on other devices the whole batch is
// estimated from one run recomputing every block (little memory), less the forward that
// recomputing adds. Elsewhere the line is only a first guess: below the quarter fixed
// per-call costs make small micro-batches slower than any line says, and above it caches make
// larger ones slower or faster per sample, by machine and model. So every size that a plan, or
// a rival predicted close to it, would run and that is not measured is timed before the plan
// is taken (plan_timing_as_needed in job.h, time_plain_chain here), beside the quarter, whose
// earlier time sets the scale. Those points are the time model; the blocks' seconds only
// divide a point's time among blocks.
//
// Only the precision whose blocks ran fastest at half the batch is timed in the profile: the
// search needs another precision's times only where that precision's plans come close, and
// timing a slow precision's chain would cost a large share of planning. Until then
// such a precision's chain is guessed as the timed one's, scaled by the two precisions' block
// seconds at half the batch; the planner times it (both profiled sizes, and the sizes a plan
// would run) when a plan or a close rival runs it.
//
// A mixed precision is first probed: the baseline's heaviest block, one sample, at both
// precisions. One that runs over 3x slower is not profiled at all, with a note: bf16 on a CPU
// without bf16 instructions runs many times slower, and profiling it would take most of
// planning for a precision no plan would choose.
//
#pragma once

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "memfit/measure/memory_tracker.h"
#include "memfit/plan/peak_moments.h"
#include "memfit/plan/schedule.h"
#include "memfit/runtime/optimizer.h"
#include "memfit/runtime/workload.h"
#include "memfit/techniques/autocast.h"

namespace memfit {

// The moments of a block's measured peaks (peak_moments.h). The held peaks are whole (the
// backward's peak with what is held on top), not the excess over it that BlockCost keeps.
struct BlockMoments {
  PeakMoments forward, forward_nograd, backward, backward_accumulating;
  PeakMoments backward_input_held, backward_segment_end, backward_all;
};

// Per-block costs measured at one micro-batch size.
struct ChainProfile {
  int64_t micro_batch = 0;
  std::vector<BlockCost> blocks;
  std::vector<BlockMoments> moments;  // by block; empty where not recorded (costs written by hand)
  double forward_nograd_seconds = 0;  // all blocks' forward without grad (what recomputing adds)
};

// Seconds of the plain chain's forward + backward on one micro-batch of `micro_batch` samples.
struct ChainSeconds {
  int64_t micro_batch = 0;
  double seconds = 0;
};

// A point timed before, at one precision, that later timings run beside and are scaled to.
struct TimingReference {
  Precision precision = Precision::kFP32;
  ChainSeconds point;
};

// What one precision costs: the blocks at two or three sizes, and the whole plain chain's time.
struct PrecisionProfile {
  Precision precision = Precision::kFP32;
  ChainProfile small, large;
  // The blocks at one sample, where small is more (micro_batch 0: not measured, or the model
  // cannot train on one sample, as BatchNorm on a 1x1 map): bytes only, below small.
  ChainProfile one_sample;
  double calibration = 1.0;            // measured / modelled bytes of the plain chain
  // By micro-batch, ascending (a GPU's whole batch estimated); empty: not timed yet (guessed
  // from the blocks, see above). At least one precision of a profile is timed.
  std::vector<ChainSeconds> chain_seconds;
};

struct WorkloadProfile {
  int64_t batch = 0;                   // samples per step the profile is for
  int64_t weight_bytes = 0;            // all parameters
  int64_t batch_bytes = 0;             // one batch's input and target
  int64_t segment_overhead_bytes = 0;  // what each checkpointed segment keeps besides its input (RNG state)
  std::vector<PrecisionProfile> precisions;  // the first is the baseline
  std::vector<std::string> notes;      // precisions dropped, and why
  bool non_reentrant_checkpoint = false;  // ChainCosts::non_reentrant (the Python package's)
};

// The workload's costs for `batch` at each precision (the chain timed at the precision whose
// blocks ran fastest); a mixed precision the model cannot run, or runs over 3x slower than the
// first, is dropped with a note (the first, the baseline, must run). `tracker` must be installed on
// this thread. The caller's random stream is left as it was.
WorkloadProfile profile_workload(Workload& workload, const Batch& batch, const std::vector<Precision>& precisions,
                                 MemoryTracker& tracker);

// One precision's blocks at a quarter and a half of `batch`, and one sample (its chain not
// timed): what profile_workload does per precision, for a precision added later (a rank whose
// probe dropped a precision that rank 0's plan runs).
PrecisionProfile profile_precision(Workload& workload, const Batch& batch, Precision precision, MemoryTracker& tracker);

ChainProfile profile_chain(Workload& workload, const Batch& batch, int64_t micro_batch, Precision precision,
                           MemoryTracker& tracker);

// Seconds of the plain chain's forward + backward on the first m samples of `batch` at
// `precision`, for each m of `sizes`: each size's median of three or more runs as in a step
// (after a first run paying for first use, itself one of them where it took a quarter second or
// more), the runs alternating with a `reference` point timed before (at its own precision), and
// each median scaled by the reference's seconds over its median now. So a size timed later is
// put beside the earlier ones by a ratio measured seconds apart (a shared machine's speed can
// drift by half over minutes). Where the plain chain runs out of memory (a device's real memory),
// every block is recomputed in all these runs: the ratio then stands in for the plain one. The
// caller's random stream is left as it was.
std::vector<double> time_plain_chain(Workload& workload, const Batch& batch, Precision precision,
                                     const std::vector<int64_t>& sizes, const TimingReference& reference,
                                     MemoryTracker& tracker);

// The blocks' costs at micro-batch m: bytes fitted linearly between the two profiled sizes
// around m (below the smaller: one sample and it, where measured) and calibrated, seconds
// fitted (not below the smaller size's); no fixed bytes, seconds not yet scaled to the whole
// chain's (the planner does both).
ChainCosts block_costs_at(const PrecisionProfile& profile, int64_t m);

// The blocks' forward + backward seconds, summed (each block timed alone).
double block_seconds(const ChainProfile& profile);

// The value at m of the line through (m1, v1) and (m2, v2), never below zero; bytes rounded.
double fit_line(int64_t m1, double v1, int64_t m2, double v2, int64_t m);
int64_t fit_bytes(int64_t m1, int64_t v1, int64_t m2, int64_t v2, int64_t m);
int64_t calibrated(int64_t bytes, double calibration);

// What the optimizer keeps and makes, on this process, with one state precision.
struct OptimizerCost {
  int64_t state_bytes = 0;  // alive between steps (AdamW: 2x the parameters' bytes; 8-bit: ~0.5x,
                            // plus its maps, made once per process: techniques/optimizer_8bit.h)
  int64_t step_bytes = 0;   // temporaries at the peak of a steady-state step, above the state
  double seconds = 0;       // one steady-state step (0: not measured)
  StatePrecision state = StatePrecision::kFP32;  // fp32 or 8bit, never auto
  // Where the planner places it (not measured, not in the cache's JSON): on the host, the state,
  // the step, fp32 masters and the gradients are host bytes (train/optimizer_offload.h).
  bool on_host = false;
};

// Three real steps of `spec` over `parameters` (zero gradients), the first making the state,
// the others in steady state (bytes; seconds: the best of the two); the parameters are put back exactly afterwards. A spec
// with state auto is measured as fp32.
OptimizerCost measure_optimizer(const OptimizerSpec& spec, const std::vector<at::Tensor>& parameters,
                                MemoryTracker& tracker);

// The one rule by which an optimizer's costs are measured, whoever steps it (the C++ optimizers
// above; the Python package's copy of the user's optimizer): `step` runs one step over
// parameters with zero gradients; the first makes the state (state_bytes: what it left alive on
// `device`), two more run in steady state (step_bytes: their temporaries above the state;
// seconds: the faster). The 8-bit state's dynamic maps are made by the first 8-bit step in a
// process and kept for its life: counted here when this first step made them, as resident bytes
// (alive before the step, like the weights) once they exist.
OptimizerCost measure_optimizer_steps(const std::function<void()>& step, StatePrecision state, MemoryTracker& tracker,
                                      MemoryDevice device);

// The costs the planner chooses among: the spec's state precision alone, or with auto fp32 and
// then (Adam, AdamW) 8-bit.
std::vector<OptimizerCost> measure_optimizer_states(const OptimizerSpec& spec, const std::vector<at::Tensor>& parameters,
                                                    MemoryTracker& tracker);

// The one JSON form of the measurements (the profile cache's files): numbers round-trip
// exactly, so a plan made from a read profile equals the plan made from the measured one.
// The readers throw std::invalid_argument naming the first bad field.
nlohmann::json profile_json(const WorkloadProfile& profile);
WorkloadProfile profile_from_json(const nlohmann::json& j);
nlohmann::json optimizer_cost_json(const OptimizerCost& cost);
OptimizerCost optimizer_cost_from_json(const nlohmann::json& j);

}  // namespace memfit
