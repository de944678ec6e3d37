#include "memfit/plan/job.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>

#include "memfit/measure/cuda_budget.h"
#include "memfit/measure/memory_space.h"
#include "memfit/measure/size.h"
#include "memfit/plan/plan_steps.h"
#include "memfit/plan/profile.h"
#include "memfit/techniques/cache.h"
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
  MeasuredCosts costs = measure_costs(workload_, batch_(), options_.precisions, options_.request.step.optimizer,
                                      options_.optimized, tracker_, options_.cache, source_, profile_options());
  PlanRequest request = options_.request;
  request.optimizer = costs.optimizer.front();
  request.optimizer_alternatives.assign(costs.optimizer.begin() + 1, costs.optimizer.end());
  if (complete) complete(request, costs);
  lengths_ = std::move(costs.lengths);
  planner_.emplace(std::move(costs.profile), std::move(request));
}

MeasuredCosts PlanJob::measured_costs() const {
  MeasuredCosts costs = planner_->measured_costs();
  costs.lengths = lengths_;
  return costs;
}

std::optional<ReservedFitOptions> reserved_fit_for(const c10::Device& device) {
  if (!device.is_cuda()) return std::nullopt;
  ReservedFitOptions o;
  o.allocator = cuda_prediction_options_from_env();
  return o;
}

Plan PlanJob::plan(int64_t budget_bytes) {
  int timed = 0;
  const auto replan = [&](int64_t budget) {
    int more = 0;
    Plan p = plan_timing_as_needed(*planner_, budget, timer(), &more);
    timed += more;
    return p;
  };
  Plan plan = replan(budget_bytes);
  if (options_.reserved_fit && plan.feasible) {
    const MemoryDevice device = memory_device_of(options_.request.step.device);
    const StepRecorder record = [this](const StepConfig& config, int steps) { return record_steps(config, steps); };
    plan = fit_reserved(*planner_, std::move(plan), device, record, *options_.reserved_fit, replan);
  }
  if (timed > 0) store_costs(source_, measured_costs());  // the cache keeps the sizes timed
  return plan;
}

RecordedSteps PlanJob::record_steps(const StepConfig& config, int steps) {
  RecordedSteps r;
  ModelStateGuard keep(workload_);
  const Batch batch = batch_();
  if (config.device.is_cuda()) {
    empty_cache();  // as the steps under the budget start (verify.h, the Trainer)
    const CudaAllocatorCounters now = cuda_allocator_counters(config.device.has_index() ? config.device.index() : 0);
    r.reserved_at_start = now.reserved;
    r.allocated_at_start = now.allocated;
  }
  tracker_.start_recording();
  try {
    run_plan_steps(workload_, batch, config, tracker_, steps);
  } catch (const c10::OutOfMemoryError&) {
    r.out_of_memory = true;  // the device's real memory ran out, uncapped
  }
  tracker_.stop_recording();
  r.trace = recorded_trace(tracker_);
  return r;
}

ChainTimer PlanJob::timer() {
  if (!options_.time_micro_batches) return {};
  return [this](Precision precision, const std::vector<int64_t>& sizes, const TimingReference& reference) {
    ChainParts parts(workload_, batch_());
    return time_step_sizes(parts, precision, sizes, reference);
  };
}

ProfileOptions PlanJob::profile_options() const {
  ProfileOptions o;
  const auto& placements = options_.request.optimizer_offload;
  o.streamed = std::find(placements.begin(), placements.end(), true) != placements.end();
  return o;
}

bool PlanJob::add_precision_if_missing(Precision precision) {
  if (planner_->profiled(precision)) return false;
  ChainParts parts(workload_, batch_());
  planner_->add_precision(profile_precision(parts, precision, tracker_, profile_options()));
  return true;
}

ShapePlanner PlanJob::shape_planner(const Plan& plan) {
  const Batch batch = batch_();
  const int64_t length = batch.length();
  const Precision precision = plan.config.precision;
  std::vector<LengthProfile> shorter;
  bool measured = false;
  for (int64_t l : lengths_to_profile(length)) {
    const auto kept = std::find_if(lengths_.begin(), lengths_.end(), [&](const LengthProfile& p) {
      return p.length == l && p.profile.precision == precision;
    });
    if (kept != lengths_.end()) {
      shorter.push_back(*kept);
      continue;
    }
    ChainParts parts(workload_, batch.cut(l));
    shorter.push_back({l, profile_precision(parts, precision, tracker_, profile_options())});
    lengths_.push_back(shorter.back());
    measured = true;
  }
  if (measured) store_costs(source_, measured_costs());
  return ShapePlanner(*planner_, plan, length, std::move(shorter));
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
