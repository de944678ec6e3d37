// Costs written by hand for the planner's tests (test_plan_search.cpp, test_plan_costs.cpp): a
// profile of four blocks at a batch of 8 and an AdamW-like optimizer cost, so that every
// expectation follows from the numbers below.
#pragma once

#include "memfit/memfit.h"

namespace memfit::test {

// A block whose bytes grow linearly with the micro-batch m: `act` bytes kept per sample.
inline BlockCost block_at(int64_t m, int64_t act, double seconds_per_sample, int64_t params) {
  BlockCost c;
  c.forward_seconds = seconds_per_sample * static_cast<double>(m);
  c.backward_seconds = 2 * c.forward_seconds;
  c.output_bytes = 1000 * m;
  c.output_kept = true;
  c.kept_bytes = act * m + c.output_bytes;
  c.forward_peak = act * m + c.output_bytes;
  c.forward_nograd_peak = 2 * c.output_bytes;
  c.backward_peak = act * m + params + c.output_bytes;  // (the output's gradient arrives first)
  c.backward_peak_accumulating = act * m + c.output_bytes;
  c.param_bytes = params;
  return c;
}

// Four blocks, the second heavy in activations; profiled at m = 2 and 4 of a batch of 8.
inline PrecisionProfile hand_profile(Precision precision, double time_scale) {
  PrecisionProfile p;
  p.precision = precision;
  const int64_t acts[] = {20000, 200000, 50000, 10000};
  for (int64_t m : {2, 4}) {
    ChainProfile& cp = m == 2 ? p.small : p.large;
    cp.micro_batch = m;
    for (int64_t a : acts) cp.blocks.push_back(block_at(m, a, 0.001 * time_scale, 40000));
  }
  // 3 x forward (fwd + 2 x bwd) x 4 blocks x m samples, with a fixed cost per micro-batch
  p.chain_seconds = {{1, 0.02 * time_scale}, {2, 0.03 * time_scale}, {4, 0.05 * time_scale}, {8, 0.09 * time_scale}};
  return p;
}

inline WorkloadProfile hand_workload() {
  WorkloadProfile w;
  w.batch = 8;
  w.weight_bytes = 4 * 40000;
  w.batch_bytes = 8 * 100;
  w.segment_overhead_bytes = 5056;
  w.precisions.push_back(hand_profile(Precision::kFP32, 1.0));
  return w;
}

inline PlanRequest hand_request() {
  PlanRequest r;
  r.step.batch = 8;
  r.optimizer.state_bytes = 2 * 4 * 40000;  // as AdamW would keep
  r.optimizer.step_bytes = 2 * 40000;
  return r;
}

}  // namespace memfit::test
