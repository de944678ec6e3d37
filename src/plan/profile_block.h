// One block of a profiled chain measured alone (profile_block.cpp): what profile_chain and the
// precision probe run.
#pragma once

#include <ATen/ATen.h>

#include <chrono>

#include "memfit/plan/profile.h"

namespace memfit {

using ProfileClock = std::chrono::steady_clock;
inline double seconds_since(ProfileClock::time_point t0) {
  return std::chrono::duration<double>(ProfileClock::now() - t0).count();
}

// One block of a profiled chain: what it costs, the next block's input, and whether this
// block kept its own input for backward (then the previous block's output stays alive).
struct BlockRun {
  BlockCost cost;
  BlockMoments moments;
  double forward_nograd_seconds = 0;
  at::Tensor next_input;
  bool kept_input = false;
  // An output on the input's storage (an in-place first op, a view): the previous block's output
  // handed on, counted once, as this block's.
  bool output_is_input = false;
};

// Block i alone on input x (detached): its forward without grad (as inside a checkpointed
// segment), then forward + backward with grad, its gradients made, then added into.
BlockRun run_block(Workload& w, int i, const at::Tensor& x, const at::Tensor& target, Precision precision,
                   MemoryTracker& tracker);

}  // namespace memfit
