// The Trainer's plan: measured (plan/job.h) with the whole model as one process runs it, the
// budget chosen, the plan searched (or the resumed run's taken), rank 0's adopted by every rank,
// then the budget enforced.
#include <torch/torch.h>

#include "memfit/errors.h"
#include "memfit/plan/plan_ask.h"
#include "memfit/measure/size.h"
#include "memfit/techniques/cache.h"
#include "memfit/techniques/rng.h"
#include "trainer_impl.h"

namespace memfit {

void Trainer::Impl::make_plan_job() {
  PlanAsk ask;
  ask.budget_bytes = options.budget_bytes;  // 0: the default budget, chosen once the costs are known
  ask.precisions = {options.pin_precision ? precision_name(options.step.precision) : "auto"};
  ask.offload = offload_mode_name(options.offload);
  ask.host_budget_bytes = options.host_budget_bytes;
  ask.step = options.step;
  ask.step.batch = local.length;
  ask.step.micro_batch = std::min(options.step.micro_batch, local.length);
  if (options.pin_checkpoint) ask.checkpoint = options.step.checkpoint;
  ask.resident_bytes = memory->resident_bytes;
  ask.outside_bytes = memory->outside.total();
  PlanSetup setup = set_up_plan(ask);
  plan.notes = std::move(setup.notes);
  PlanJobOptions o;
  o.precisions = std::move(setup.precisions);
  o.request = std::move(setup.request);
  o.optimized = strategy->optimized_parameters();
  o.cache = options.profile_cache;
  o.time_micro_batches = strategy->times_micro_batches_alone();
  // On CUDA one process's plan is checked by its recorded steps on the caching allocator; a
  // rank of several runs steps no single process can record for it.
  if (options.distributed.world_size == 1) o.reserved_fit = reserved_fit_for(options.step.device);
  const StateUse state{!options.save_dir.empty(), !options.resume_dir.empty()};
  auto whole = strategy->whole_model();  // measured as one process runs it (before the budget)
  plan.job.emplace(workload, [this] { return local_plan_batch(record.start_step); }, std::move(o), *memory->tracker,
                   [&](PlanRequest& request, const MeasuredCosts& costs) { strategy->add_to_plan_request(request, costs, state); });
}

void Trainer::Impl::choose_plan() {
  std::vector<std::string> notes = plan.job->source().notes;
  notes.insert(notes.end(), plan.notes.begin(), plan.notes.end());
  plan.budget = options.budget_bytes;
  if (plan.budget == 0) {
    std::string why;
    plan.budget = default_budget(plan.job->planner(), &why);
    notes.push_back(why);
  }
  if (record.resumed) {
    // A resumed run continues with the plan it saved: the same micro-batches, precision and
    // schedule, so the same stream of numbers.
    plan.plan = plan_from_json(record.resumed->plan, workload.chain->size());
    plan.plan.notes = {"resumed with the saved plan"};
  } else {
    plan.plan = plan.job->plan(plan.budget);
    const Planner& planner = plan.job->planner();
    const bool pinned = options.step.micro_batch > 0 && options.pin_checkpoint && planner.profile().precisions.size() == 1;
    if (!plan.plan.feasible && pinned) {
      // The user fixed the configuration: run it, and let out-of-memory recovery split.
      plan.plan = planner.evaluate(options.step.micro_batch, planner.profile().precisions.front().precision,
                                   options.step.checkpoint, plan.budget, std::nullopt,
                                   planner.request().prefetch_depths.back());
      plan.plan.notes.push_back("the pinned configuration is predicted to need " + format_bytes(plan.plan.predicted_peak) +
                                ", over the budget: micro-batches will be split when memory runs out");
    } else if (!plan.plan.feasible) {
      const int64_t host = planner.smallest_host_bytes();
      if (options.host_budget_bytes > 0 && host > options.host_budget_bytes && plan.plan.floor_bytes <= plan.budget) {
        throw std::runtime_error("host budget " + format_bytes(options.host_budget_bytes) + " (" +
                                 std::to_string(options.host_budget_bytes) +
                                 " bytes) is below what offloading the optimizer holds there: " + format_bytes(host) +
                                 " (" + std::to_string(host) + " bytes)");
      }
      throw std::runtime_error(below_floor_text(planner, plan.budget));
    }
  }
  plan.plan.notes.insert(plan.plan.notes.begin(), notes.begin(), notes.end());
  plan.plan.budget_bytes = plan.budget;
}

// Every rank trains with rank 0's plan: each rank timed its own profile and could choose
// differently, and equal precision and micro-batches keep ranks equal to one process.
void Trainer::Impl::adopt_rank0_plan() {
  ProcessGroup& group = strategy->group();
  const std::string mine = plan_json(plan.plan).dump();
  const std::string rank0 = group.broadcast_string(mine, 0, "agreeing on the plan");
  const Plan theirs = plan_from_json(nlohmann::json::parse(rank0), workload.chain->size());
  // A rank whose probe dropped rank 0's precision profiles it; where profiling is collective
  // (sharded weights), every rank enters the whole-model scope when any profiles.
  const bool missing = !plan.job->planner().profiled(theirs.config.precision);
  if (group.any(missing, "agreeing on the precisions profiled")) {
    auto whole = strategy->whole_model();
    plan.job->add_precision_if_missing(theirs.config.precision);
  }
  if (rank0 == mine) return;
  const int64_t m = std::min(theirs.config.micro_batch_size(), local.length);
  std::vector<std::string> notes = plan.plan.notes;
  plan.plan = plan.job->planner().evaluate(m, theirs.config.precision, theirs.config.checkpoint, plan.budget,
                                           theirs.config.optimizer.state, theirs.config.prefetch_depth, theirs.config.offload);
  plan.plan.notes = notes;
  plan.plan.notes.push_back("using rank 0's plan (this rank's own choice differed)");
}

// Batches of other lengths are planned before they run, where one process trains (ranks of
// several would each have to make the same choice; they run the plan, recovering as needed).
void Trainer::Impl::make_shape_planner() {
  if (options.distributed.world_size > 1 || !plan.plan.feasible || !workload.data->lengths_vary()) return;
  plan.shapes.emplace(plan.job->shape_planner(plan.plan));
}

// What the steps need once the plan is known, and the budget from now on.
void Trainer::Impl::prepare_steps() {
  const StepConfig& config = plan.plan.config;
  // State auto: the plan chose the optimizer's state precision (nothing is stepped yet).
  if (config.optimizer.state != optimizer.spec.state) {
    optimizer.build(options.step.optimizer, config.optimizer.state, strategy->optimized_parameters());
  }
  strategy->check_plan(plan.plan);
  strategy->use_config(config);
  if (config.offload.optimizer) strategy->offload_optimizer(*optimizer.optimizer);  // a resumed run's state moves too
  if (config.precision == Precision::kFP16) {
    recovery.scaler = std::make_unique<GradScaler>(GradScalerOptions{65536.0, 2.0, 0.5, 2000, true});
  }
  recovery.split = std::make_unique<SplitRecovery>(local.length, options.step.batch, workload.chain->size(),
                                                   [this](const std::string& note) { observers.on_note(note); });
  recovery.eval_micro_batch = config.micro_batch_size();
  if (options.step.device.is_cuda()) empty_cache();  // the steps start from what the plan's check replayed
  memory->enforce(plan.budget);
  record.summary.first_step = record.start_step + 1;
  record.summary.budget_bytes = plan.budget;
  record.summary.losses.reserve(static_cast<size_t>(options.steps - record.start_step));  // no growth during training
}

const Plan& Trainer::plan() {
  Impl& t = *impl_;
  t.require(Impl::Stage::kSetUp, "plan()");
  const auto planning_start = TrainClock::now();
  t.make_plan_job();
  t.choose_plan();
  // Training's random stream starts from the seed (a resumed run's was restored with its state).
  if (t.record.start_step == 0) torch::manual_seed(t.workload.seed);
  t.plan.seconds = std::chrono::duration<double>(TrainClock::now() - planning_start).count();
  if (!t.record.resumed) t.adopt_rank0_plan();
  t.make_shape_planner();
  t.prepare_steps();
  TrainSummary& s = t.record.summary;
  s.planning_seconds = t.plan.seconds;
  s.profile_cached = t.plan.job->source().cached;
  const std::vector<std::string> names = t.workload.chain->block_names();
  t.observers.on_plan({t.plan.plan, names, t.plan.seconds, s.profile_cached, !t.plan.job->source().path.empty()});
  t.memory->tracker->reset_phase_times();  // the summary's time per phase covers training only
  t.record.run_start = TrainClock::now();
  t.stage = Impl::Stage::kPlanned;
  return t.plan.plan;
}

}  // namespace memfit
