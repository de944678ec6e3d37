#include "memfit/plan/job.h"

#include <torch/torch.h>

#include <cmath>

#include "memfit/measure/memory_space.h"
#include "memfit/measure/size.h"
#include "memfit/plan/profile.h"
#include "memfit/techniques/rng.h"

namespace memfit {

Plan plan_timing_as_needed(Planner& planner, int64_t budget_bytes, const ChainTimer& time_chain, int* timed) {
  int count = 0;
  Plan plan = planner.plan(budget_bytes);
  // Each round times at least one size: the sizes a plan can run are finite.
  const auto untimed = [&] { return planner.untimed_rival_sizes(plan, kRivalSlack, kExtrapolatedRivalSlack); };
  for (auto sizes = untimed(); !sizes.empty() && time_chain; sizes = untimed()) {
    for (const auto& profile : planner.profile().precisions) {  // each precision's sizes timed together
      std::vector<int64_t> ms;
      for (const auto& [precision, m] : sizes) {
        if (precision == profile.precision) ms.push_back(m);
      }
      if (ms.empty()) continue;
      const std::vector<double> seconds = time_chain(profile.precision, ms, planner.timing_reference(profile.precision));
      for (size_t i = 0; i < ms.size(); ++i) planner.add_chain_seconds(profile.precision, ms[i], seconds[i]);
    }
    count += static_cast<int>(sizes.size());
    plan = planner.plan(budget_bytes);
  }
  if (timed != nullptr) *timed = count;
  return plan;
}

void request_offload(PlanRequest& request, OffloadMode mode, int64_t host_budget_bytes) {
  allow_offload(request, mode);
  request.host_budget_bytes = host_budget_bytes;
  if (mode != OffloadMode::kNone) request.host_copy_bytes_per_second = measure_copy_bytes_per_second(request.step.device);
}

PlanJob::PlanJob(Workload& workload, BatchSource batch, PlanJobOptions options, MemoryTracker& tracker,
                 const CompleteRequest& complete)
    : workload_(workload), batch_(std::move(batch)), options_(std::move(options)), tracker_(tracker) {
  if (options_.optimized.empty()) options_.optimized = workload_.chain->parameters();
  const RngState rng = capture_rng(options_.request.step.device);
  MeasuredCosts costs = measure_costs(workload_, batch_(), options_.precisions, options_.request.step.optimizer,
                                      options_.optimized, tracker_, options_.cache, source_);
  restore_rng(rng);
  PlanRequest request = options_.request;
  request.optimizer = costs.optimizer.front();
  request.optimizer_alternatives.assign(costs.optimizer.begin() + 1, costs.optimizer.end());
  if (complete) complete(request, costs);
  planner_.emplace(std::move(costs.profile), std::move(request));
}

Plan PlanJob::plan(int64_t budget_bytes) {
  int timed = 0;
  Plan plan = plan_timing_as_needed(*planner_, budget_bytes, timer(), &timed);
  if (timed > 0) store_costs(source_, planner_->measured_costs());  // the cache keeps the sizes timed
  return plan;
}

ChainTimer PlanJob::timer() {
  if (!options_.time_micro_batches) return {};
  return [this](Precision precision, const std::vector<int64_t>& sizes, const TimingReference& reference) {
    return time_plain_chain(workload_, batch_(), precision, sizes, reference, tracker_);
  };
}

bool PlanJob::add_precision_if_missing(Precision precision) {
  if (planner_->profiled(precision)) return false;
  const RngState rng = capture_rng(options_.request.step.device);  // profiling draws dropout masks
  planner_->add_precision(profile_precision(workload_, batch_(), precision, tracker_));
  restore_rng(rng);
  return true;
}

int64_t default_budget(const Planner& planner, std::string* why) {
  const double margin = planner.request().margin;
  const Plan plain =
      planner.evaluate(planner.request().step.batch, planner.profile().precisions.front().precision, CheckpointPlan::none());
  const int64_t floor = planner.floor_bytes();
  const auto plain_needs = static_cast<int64_t>(std::ceil(static_cast<double>(plain.predicted_peak) / (1.0 - margin)));
  const int64_t halfway = (floor + std::max(floor, plain_needs)) / 2;
  const int64_t budget = (halfway + 1023) / 1024 * 1024;  // whole KiB, rounded up: still >= the floor
  if (why != nullptr) {
    *why = "budget " + format_bytes(budget) + ": the default, halfway between the smallest plan (" + format_bytes(floor) +
           ") and what the plain step needs (" + format_bytes(plain_needs) + ")";
  }
  return budget;
}

Planner measure_and_plan(Workload& w, const Batch& batch, const std::vector<Precision>& precisions, PlanRequest request,
                         MemoryTracker& tracker, std::vector<at::Tensor> optimized, const ProfileCacheOptions& cache,
                         CostsSource* source) {
  PlanJobOptions o;
  o.precisions = precisions;
  o.request = std::move(request);
  o.optimized = std::move(optimized);
  o.cache = cache;
  PlanJob job(w, [&batch] { return batch; }, std::move(o), tracker);
  if (source != nullptr) *source = job.source();
  return std::move(job.planner());
}

}  // namespace memfit
