// job.h — one planning job, as `memfit plan` and the Trainer both run it:
//
//   1. measure the workload's costs on a batch (profile.h), or read them from the profile
//      cache (profile_cache.h): blocks, the chain's time by micro-batch, the optimizer;
//   2. a Planner over them (planner.h: the pure search);
//   3. plan, and before trusting a plan time the micro-batch sizes it (or a close rival) would
//      run that were only guessed, then plan again; the cache keeps what was timed.
//
//   memfit::PlanJobOptions o;
//   o.precisions = memfit::precision_candidates("auto", c10::kCPU);
//   o.request.step = step;  o.request.budget_bytes = 512 << 20;
//   memfit::PlanJob job(workload, batch, o, tracker);      // measures
//   memfit::Plan plan = job.plan();                         // searches, timing as needed
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "memfit/measure/memory_tracker.h"
#include "memfit/plan/batch_shape.h"
#include "memfit/plan/planner.h"
#include "memfit/plan/profile_cache.h"
#include "memfit/plan/reserved_fit.h"

namespace memfit {

// Seconds of the plain chain at a precision for each of `sizes`, on the scale of `reference`, a
// point timed before (profile.h's time_plain_chain).
using ChainTimer = std::function<std::vector<double>(Precision precision, const std::vector<int64_t>& sizes,
                                                     const TimingReference& reference)>;

// How close a rival's predicted step must be to the chosen plan's for its guessed sizes to be
// timed too: a guess can be off either way (a whole batch guessed slower than four
// micro-batches may run faster: per-call costs and cache effects bend the line).
constexpr double kRivalSlack = 0.10;
// The same for a rival whose micro-batch is above every size its precision's chain was timed
// at: there the guess is the line continued, which errs most.
constexpr double kExtrapolatedRivalSlack = 0.25;

// Plans for `budget_bytes` (0: the request's); while the plan, or a rival predicted within
// kRivalSlack of it (kExtrapolatedRivalSlack above the timed sizes), runs micro-batches that
// its precision's chain was not timed at, times them with `time_chain`, adds them to the
// planner's profile and plans again (each size timed once). Returns the plan; *timed counts the
// sizes timed. Without a timer the guesses stand.
Plan plan_timing_as_needed(Planner& planner, int64_t budget_bytes, const ChainTimer& time_chain, int* timed = nullptr);

// What `mode` lets the plan offload, with the host bytes it may use (0: unlimited) and, when
// anything may be offloaded, the copy bandwidth measured on the request's device.
void request_offload(PlanRequest& request, OffloadMode mode, int64_t host_budget_bytes);

struct PlanJobOptions {
  std::vector<Precision> precisions;    // the candidates (precision_candidates)
  // The step and what is pinned, the budget, margin, resident bytes; the job fills in the
  // optimizer's measured costs.
  PlanRequest request;
  std::vector<at::Tensor> optimized;    // the parameters this process's optimizer steps (empty: all)
  ProfileCacheOptions cache;            // dir "": measure every time
  bool time_micro_batches = true;       // time the sizes the search guessed (false: the guesses stand)
  // Set: every plan is checked by its recorded steps replayed on the CUDA caching allocator
  // under the budget's cap, and made tighter until it holds (reserved_fit.h); what
  // reserved_fit_for gives on CUDA. Unset: judged by allocated bytes (the CPU's budget).
  std::optional<ReservedFitOptions> reserved_fit;
};

// The reserved check a plan for `device` needs: on CUDA the allocator's rules and
// PYTORCH_CUDA_ALLOC_CONF (the recorded steps hold cuBLAS's workspaces already); none elsewhere.
std::optional<ReservedFitOptions> reserved_fit_for(const c10::Device& device);

class PlanJob {
 public:
  // The batch measured and timed (one rank's), made when needed and let go after: a batch held
  // between uses would count against the budget of the steps that follow.
  using BatchSource = std::function<Batch()>;
  // Adds to the request what depends on the measured costs (a strategy's per-rank bytes).
  using CompleteRequest = std::function<void(PlanRequest& request, const MeasuredCosts& costs)>;
  // Measures the costs of `workload` on `batch()` or reads them from the cache, and builds the
  // Planner. `tracker` must be installed on this thread; the random stream is left as it was
  // (measuring draws dropout masks).
  PlanJob(Workload& workload, BatchSource batch, PlanJobOptions options, MemoryTracker& tracker,
          const CompleteRequest& complete = {});

  // The plan for `budget_bytes` (0: the request's), its micro-batches timed as needed and,
  // with options.reserved_fit, checked on the caching allocator (tightened until it holds);
  // the profile cache then keeps the sizes timed.
  Plan plan(int64_t budget_bytes = 0);
  // Profiles `precision` if the profile lacks it (a mixed precision this process's probe
  // dropped but another rank's plan runs). Returns whether it profiled.
  bool add_precision_if_missing(Precision precision);

  // The rule that plans each batch by its shape after `plan` (batch_shape.h): where the job's
  // batch has a length, the plan's precision profiled again on it cut to shorter lengths (or
  // read from the profile cache, which keeps them: a resumed run chooses as the run it continues).
  ShapePlanner shape_planner(const Plan& plan);

  // `steps` steps of `config` on the job's batch, recorded for the reserved check
  // (reserved_fit.h); the model, its gradients and the random state put back after.
  RecordedSteps record_steps(const StepConfig& config, int steps);

  Planner& planner() { return *planner_; }
  const Planner& planner() const { return *planner_; }
  const CostsSource& source() const { return source_; }

 private:
  ChainTimer timer();
  // What the profile cache keeps: the planner's costs (grown by sizes timed) and lengths_.
  MeasuredCosts measured_costs() const;
  // What the profile measures besides the plain runs (a streamed backward where the optimizer may
  // be offloaded).
  ProfileOptions profile_options() const;

  Workload& workload_;
  BatchSource batch_;
  PlanJobOptions options_;
  MemoryTracker& tracker_;
  CostsSource source_;
  std::optional<Planner> planner_;
  std::vector<LengthProfile> lengths_;  // the batch cut shorter, as shape_planner measured or read them
};

// The default budget: halfway between the smallest plan and what the plain step needs (both
// with the margin), so that the plan matters, never below the smallest plan; whole KiB.
// `why`, if given, says so in a sentence.
int64_t default_budget(const Planner& planner, std::string* why = nullptr);

// Profiles the workload for `batch` at each precision and measures the optimizer of
// request.step over `optimized` (this process's parameters; empty: all), then returns the
// Planner over those measurements: PlanJob's first half, for callers that plan by hand.
Planner measure_and_plan(Workload& workload, const Batch& batch, const std::vector<Precision>& precisions,
                         PlanRequest request, MemoryTracker& tracker, std::vector<at::Tensor> optimized = {},
                         const ProfileCacheOptions& cache = {}, CostsSource* source = nullptr);

}  // namespace memfit
