// batch_shape.h — a plan for every batch a DataLoader gives: its samples and its length (a
// sequence's tokens, dynamic padding) chosen for before it runs, by one rule for both fronts.
//
// Costs along the length. The profile (profile.h) runs batches of one length L0. The plan's
// precision is profiled again on the same batch cut to shorter lengths (L0/2 and L0/4, at the
// same micro-batch sizes), and a cost at length L is the quadratic through the three lengths,
// field by field (`profile_at_length`): a term per token (activations), one per token squared
// (attention's L x L scores), and one per sample whatever its length.
//
// A plan per shape. `ShapePlanner::choose` plans a batch of (samples, length) with what a step
// cannot change between batches kept from the plan (precision, optimizer state and placement,
// a pinned micro-batch or schedule): the Planner (planner.h) searches micro-batch x accumulation
// and the recomputed blocks again on the costs at that length, so a longer batch is split or
// recomputed before it runs rather than after an out-of-memory error, and a shorter one runs in
// fewer micro-batches. Each shape is planned once (milliseconds), then read back.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <utility>
#include <vector>

#include "memfit/plan/plan.h"
#include "memfit/plan/planner.h"
#include "memfit/plan/profile.h"

namespace memfit {

// The lengths worth profiling beside L0: L0/2 and L0/4 where they differ from each other and
// L0 (none for L0 < 4: only the samples vary then).
std::vector<int64_t> lengths_to_profile(int64_t length);

// Costs at `length` from those measured at several lengths (one: those; two: the line; three
// or more: the quadratic through the nearest three), each byte and second field on its own
// curve, never below zero; flags and parameters from the nearest length; moments fitted where
// every length's run has the same order of allocations (else left unused). The profiles must
// share their micro-batch sizes (profile_precision on one batch cut along its length does).
PrecisionProfile profile_at_length(const std::vector<LengthProfile>& measured, int64_t length);

class ShapePlanner {
 public:
  // `planner` made `plan` from costs measured at `length` (L0; 0: the batch has no length,
  // only its samples vary); `shorter` holds the plan's precision at other lengths.
  ShapePlanner(const Planner& planner, const Plan& plan, int64_t length, std::vector<LengthProfile> shorter);

  // The plan for a batch of `samples` x `length` (length ignored where L0 is 0): the plan itself
  // for the planned shape; not feasible when nothing fits (the caller runs the plan's config
  // and recovers).
  const Plan& choose(int64_t samples, int64_t length);
  // The prediction for one configuration of that batch (the plan's precision and optimizer),
  // fitting or not: Planner::evaluate on the costs at that length.
  Plan evaluate(int64_t samples, int64_t length, int64_t micro_batch, const CheckpointPlan& checkpoint) const;
  // The longest length a batch of `samples` fits at, and the most samples a batch of `length`
  // fits with: 0 where none does, -1 where every size searched does (up to 64 x L0, and 64 x
  // the plan's batch: micro-batches of a few samples make a batch of any size fit).
  int64_t longest(int64_t samples);
  int64_t largest(int64_t length);
  int64_t planned_length() const { return length_; }
  int64_t planned_samples() const { return batch_; }

 private:
  Planner planner_for(int64_t samples, int64_t length) const;
  Plan plan_shape(int64_t samples, int64_t length) const { return planner_for(samples, length).plan(budget_); }
  int64_t highest_fitting(int64_t lo, int64_t cap, const std::function<bool(int64_t)>& fits) const;

  Plan plan_;                // what the planned shape runs
  WorkloadProfile profile_;  // the planner's, with only the plan's precision
  PlanRequest request_;      // the planner's, with the plan's state and placement pinned
  int64_t budget_ = 0;
  int64_t length_ = 0, batch_ = 0;
  std::vector<LengthProfile> lengths_;  // the plan's precision at L0 and the shorter lengths
  std::map<std::pair<int64_t, int64_t>, Plan> chosen_;
};

}  // namespace memfit
