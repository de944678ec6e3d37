// cost_fit.h — a block's costs at a micro-batch the profile did not run, from those it did
// (profile.h's PrecisionProfile): bytes on the line through two measured sizes, a peak the
// highest of its moments' lines (peak_moments.h), seconds on their line. Pure arithmetic, apart
// from measuring, so that costs written by hand or read from the cache fit the same way.
#pragma once

#include <cstdint>

#include "memfit/plan/profile.h"
#include "memfit/plan/schedule.h"

namespace memfit {

// The blocks' costs at micro-batch m: bytes fitted linearly between the two profiled sizes
// around m (below the smaller: one sample and it, where measured) and calibrated, seconds
// fitted (not below the smaller size's); no fixed bytes, seconds not yet scaled to the whole
// chain's (the planner does both).
ChainCosts block_costs_at(const PrecisionProfile& profile, int64_t m);

// The blocks' forward + backward seconds, summed.
double block_seconds(const ChainProfile& profile);

// The value at m of the line through (m1, v1) and (m2, v2), never below zero; bytes rounded.
double fit_line(int64_t m1, double v1, int64_t m2, double v2, int64_t m);
int64_t fit_bytes(int64_t m1, int64_t v1, int64_t m2, int64_t v2, int64_t m);
int64_t calibrated(int64_t bytes, double calibration);

}  // namespace memfit
