#include "memfit/train/trainer.h"

#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <iostream>
#include <optional>

#include "memfit/errors.h"
#include "memfit/measure/breakdown.h"
#include "memfit/measure/size.h"
#include "memfit/plan/profile.h"
#include "memfit/techniques/grads.h"
#include "memfit/techniques/optimizer_8bit.h"
#include "memfit/techniques/rng.h"
#include "memfit/train/saved_state.h"
#include "memfit/train/stop_signal.h"
#include "trainer_impl.h"

namespace memfit {
namespace {

constexpr double kMargin = 0.03;  // the plan keeps 3% of the budget free for what it cannot see

// Every parameter as raw float32, in order: for comparing runs within a tolerance.
void write_floats(std::ofstream& f, const at::Tensor& p) {
  const at::Tensor c = p.detach().to(c10::kCPU, at::kFloat).contiguous();
  f.write(static_cast<const char*>(c.data_ptr()), static_cast<std::streamsize>(c.numel() * 4));
}

std::ofstream open_dump(const std::string& path) {
  std::ofstream f(path, std::ios::binary);
  check_option(static_cast<bool>(f), "dump_weights", "'" + path + "'", "cannot create it");
  return f;
}

void dump_weights(const std::string& path, const std::vector<at::Tensor>& params) {
  std::ofstream f = open_dump(path);
  for (const auto& p : params) write_floats(f, p);
}

// ZeRO 3 (every rank calls it): the weights' hash, and their dump where `dump_path` is given,
// gathering one block at a time. The same bytes, in the same order, as a single process's.
std::string gathered_weights_sha256(ShardedDataParallel& sdp, const std::string& dump_path) {
  std::ofstream f;
  if (!dump_path.empty()) f = open_dump(dump_path);
  return weights_sha256([&](const ParameterVisitor& visit) {
    sdp.for_each_gathered_block([&](const std::vector<at::Tensor>& params) {
      for (const auto& p : params) {
        visit(p);
        if (f.is_open()) write_floats(f, p);
      }
    });
  });
}

}  // namespace

void check_train_options(const TrainOptions& o, const Workload& w) {
  check_workload(w);
  check_option(o.batch >= 1, "batch", o.batch, "expected a positive integer");
  check_option(o.steps >= 1, "steps", o.steps, "expected a positive integer");
  check_option(o.budget_bytes >= 0, "budget", o.budget_bytes, "expected a positive size (0: the default)");
  check_option(o.micro_batch >= 0 && o.micro_batch <= o.batch, "micro_batch", o.micro_batch,
               "expected 1 to batch (" + std::to_string(o.batch) + ")");
  check_option(o.save_every >= 1, "save_every", o.save_every, "expected >= 1");
  check_option(o.eval_every >= 0, "eval_every", o.eval_every, "expected >= 0 (0: never)");
  check_option(o.progress_every >= 0, "progress_every", o.progress_every, "expected >= 0 (0: about 20 lines a run)");
  check_option(o.eval_batches >= 1, "eval_batches", o.eval_batches, "expected >= 1");
  for (int64_t s : o.inject_oom) {
    check_option(s >= 1 && s <= o.steps, "inject_oom", s, "expected steps from 1 to steps (" + std::to_string(o.steps) + ")");
  }
  if (o.checkpoint) {
    StepConfig pinned;
    pinned.checkpoint = *o.checkpoint;
    check_step_config(pinned, w.chain->size());
  }
  check_optimizer_spec(o.optimizer);
  precision_candidates(o.precision, o.device.type());  // throws for a precision the device cannot run
  validate(o.distributed);
  const int world = o.distributed.world_size;
  check_option(o.batch >= world, "batch", o.batch, "each of the " + std::to_string(world) + " ranks needs at least one sample");
  const BatchSlice local = rank_slice(o.batch, o.distributed.rank, world);
  check_option(o.micro_batch <= local.length, "micro_batch", o.micro_batch,
               "expected 1 to this rank's share of batch (" + std::to_string(local.length) + " of " +
                   std::to_string(o.batch) + " over " + std::to_string(world) + " ranks)");
  check_option(!(world > 1 && o.distributed.zero_stage > 0 && o.precision == "fp16"), "precision", o.precision,
               "fp16 with ZeRO 1 or 2 is not supported: the loss scaler's overflow check would see one shard only");
  const bool zero3 = world > 1 && o.distributed.zero_stage == 3;
  check_option(!(zero3 && (!o.save_dir.empty() || !o.resume_dir.empty()) && o.optimizer.state == StatePrecision::k8Bit),
               "optimizer.state", "8bit", "saving and resuming at ZeRO 3 need fp32 state (8-bit blocks would straddle parameters)");
  check_option(!(zero3 && o.checkpoint && o.checkpoint->recomputed_blocks().size() != static_cast<size_t>(w.chain->size())),
               "checkpoint", o.checkpoint ? o.checkpoint->describe() : "", "ZeRO 3 recomputes every block: expected all");
  check_option(o.budget_bytes > 0 || (o.micro_batch == 0 && !o.checkpoint), "budget", "(none)",
               "a budget is required when the micro-batch or the checkpoint schedule is pinned");
}

TrainerState::TrainerState(Workload& workload, TrainOptions options, std::ostream& out_stream)
    : w(workload), o(std::move(options)), out(out_stream) {
  primary = o.distributed.rank == 0;
  if (!primary) {  // ranks hold equal weights: rank 0 alone writes
    o.json_log.clear();
    o.report_html.clear();
    o.dump_weights.clear();
  }
  tty = o.progress && isatty(fileno(stdout));
}

StepOptions TrainerState::step_options() {
  StepOptions so{plan.config};
  so.scaler = scaler.get();
  so.recovery = recovery.get();
  return so;
}

Trainer::Trainer(Workload& workload, TrainOptions options, std::ostream& out)
    : impl_(std::make_unique<TrainerState>(workload, std::move(options), out)) {}
Trainer::~Trainer() = default;

int64_t Trainer::start_step() const { return impl_->start_step; }
torch::optim::Optimizer& Trainer::optimizer() { return *impl_->optimizer; }

void Trainer::set_up() {
  TrainerState& t = *impl_;
  check_train_options(t.o, t.w);
  t.local = rank_slice(t.o.batch, t.o.distributed.rank, t.o.distributed.world_size);
  t.alloc = &BudgetAllocator::install();
  t.tracker = std::make_shared<MemoryTracker>();
  t.scope = std::make_unique<TrackerScope>(t.tracker);
  t.w.chain->to(t.o.device);
  t.params = t.w.chain->parameters();
  t.parameter_count = parameter_count(*t.w.chain);
  t.parameter_bytes = parameter_bytes(*t.w.chain);
  adopt_tensors(*t.tracker, t.params);  // the caller built them before this tracker existed
  adopt_tensors(*t.tracker, t.w.chain->buffers());
  // What else the budget counts from the start (the caller's data tensors, say): the plan
  // reserves it, and reported peaks include it.
  t.resident_bytes = std::max<int64_t>(0, t.alloc->allocated() - t.tracker->current());
  if (t.o.distributed.enabled()) {  // first: a bad --master fails before any work
    t.context = std::make_unique<DistributedContext>(t.o.distributed);
    // At stage 3 the chain's parameters lose their storage here: this rank keeps its shards.
    t.sdp = std::make_unique<ShardedDataParallel>(*t.context, *t.w.chain, t.o.distributed.zero_stage);
    t.context->check_same_on_all_ranks(
        {{"batch", t.o.batch}, {"steps", t.o.steps}, {"seed", static_cast<int64_t>(t.w.seed)},
         {"optimizer", static_cast<int64_t>(t.o.optimizer.family)},
         {"optimizer state", static_cast<int64_t>(t.o.optimizer.state)}, {"save (given or not)", t.o.save_dir.empty() ? 0 : 1},
         {"save_every", t.o.save_every}, {"resume (given or not)", t.o.resume_dir.empty() ? 0 : 1}});
  }
  // State auto: fp32 until the plan (or the saved state resumed) says otherwise.
  build_optimizer(t.o.optimizer.state == StatePrecision::kAuto ? StatePrecision::kFP32 : t.o.optimizer.state);
  print_header(t);
  if (!t.o.resume_dir.empty()) resume();
}

void Trainer::build_optimizer(StatePrecision state) {
  TrainerState& t = *impl_;
  t.optimizer.reset();  // the old state is released first
  t.optimizer_spec = t.o.optimizer.with_state(state);
  t.optimizer = make_optimizer(t.optimizer_spec, t.sdp ? t.sdp->optimized_parameters() : t.params);
}

// The saved run's optimizer state precision: adopted under auto, else it must be the one asked for.
void Trainer::resume_state_precision(const nlohmann::json& meta, const std::string& where) {
  TrainerState& t = *impl_;
  const StatePrecision saved = parse_state_precision(meta.value("optimizer_state", "fp32"));
  if (t.o.optimizer.state != StatePrecision::kAuto && t.o.optimizer.state != saved) {
    throw std::runtime_error("cannot resume: " + where + " was trained with " + state_precision_name(saved) +
                             " optimizer state, not " + state_precision_name(t.o.optimizer.state) +
                             " (pass --optimizer-state " + state_precision_name(saved) + " or auto)");
  }
  if (saved != t.optimizer_spec.state) build_optimizer(saved);
}

void Trainer::resume() {
  TrainerState& t = *impl_;
  if (t.primary) remove_stale_state_files(t.o.resume_dir);  // what an interrupted save left
  SavedState saved = SavedState::open(t.o.resume_dir);
  const nlohmann::json& meta = saved.meta();
  const std::string where = saved.file().string();
  if (meta.value("model", "") != t.w.description) {
    throw std::runtime_error("cannot resume: " + where + " holds '" + meta.value("model", "?") + "', not '" +
                             t.w.description + "' (the same model is needed)");
  }
  if (meta.value("batch", int64_t{0}) != t.o.batch) {
    throw std::runtime_error("cannot resume: " + where + " was trained with batch " +
                             std::to_string(meta.value("batch", int64_t{0})) + ", not " + std::to_string(t.o.batch));
  }
  const std::string family = meta.value("optimizer", "?");
  if (family != optimizer_family_name(t.o.optimizer.family)) {
    throw std::runtime_error("cannot resume: " + where + " was trained with " + family + ", not " +
                             optimizer_family_name(t.o.optimizer.family));
  }
  resume_state_precision(meta, where);
  if (t.sharded_weights()) {
    resume_gathered(saved);
  } else if (t.sharded_optimizer()) {
    // The files hold the whole state (the single-process format): keep this rank's share.
    auto full = make_optimizer(t.optimizer_spec, t.params);
    saved.load_into(*t.w.chain, *full, t.optimizer_spec, t.o.device);
    t.sdp->keep_owned_state(*full, *t.optimizer);
  } else {
    saved.load_into(*t.w.chain, *t.optimizer, t.optimizer_spec, t.o.device);
  }
  t.resumed_meta = meta;
  t.start_step = meta.at("step").get<int64_t>();
  t.out << "  resumed from " << t.o.resume_dir << " at step " << t.start_step << "\n";
}

namespace {

// The first batch this rank trains on, on its device: what profiles and timings run.
Batch first_local_batch(const TrainerState& t) {
  return t.w.data->train_batch(t.start_step, t.o.batch, t.w.seed).slice(t.local.start, t.local.length).to(t.o.device);
}

// Profiles `precision` on the ranks whose profile lacks it: each rank's probe times its own
// runs, and one may drop a mixed precision that rank 0's plan runs. With sharded weights the
// profile gathers them, a collective: every rank joins when any rank profiles.
void profile_where_missing(TrainerState& t, Precision precision) {
  const bool missing = !t.planner->profiled(precision);
  bool any = missing;
  if (t.sharded_weights()) {
    const auto flags = t.context->all_gather({missing ? 1 : 0}, "agreeing on the precisions profiled");
    any = std::any_of(flags.begin(), flags.end(), [](const std::vector<int64_t>& f) { return f.at(0) != 0; });
  }
  if (!any) return;
  const RngState rng = capture_rng(t.o.device);  // profiling draws dropout masks
  std::optional<ShardedDataParallel::FullWeights> full;
  if (t.sharded_weights()) full.emplace(*t.sdp);
  if (missing) t.planner->add_precision(profile_precision(t.w, first_local_batch(t), precision, *t.tracker));
  full.reset();
  restore_rng(rng);
}

}  // namespace

// --- plan --------------------------------------------------------------------------------------

void Trainer::make_planner() {
  TrainerState& t = *impl_;
  const std::vector<Precision> precisions = precision_candidates(t.o.precision, t.o.device.type());
  const Batch first = first_local_batch(t);
  const RngState rng = capture_rng(t.o.device);  // measuring draws dropout masks: training must not notice
  const auto optimized = t.sdp ? t.sdp->optimized_parameters() : t.params;
  std::optional<ShardedDataParallel::FullWeights> full;  // ZeRO 3: profiled as one process runs it (before the budget)
  if (t.sharded_weights()) full.emplace(*t.sdp);
  MeasuredCosts costs = measure_costs(t.w, first, precisions, t.o.optimizer, optimized, *t.tracker, t.o.profile_cache,
                                      t.costs_source);
  full.reset();
  t.plan.notes.insert(t.plan.notes.end(), t.costs_source.notes.begin(), t.costs_source.notes.end());
  PlanRequest request;
  request.step.device = t.o.device;
  request.step.batch = t.local.length;
  request.step.micro_batch = t.o.micro_batch;
  request.step.set_to_none = !t.o.keep_grads;
  request.step.optimizer = t.o.optimizer;
  request.checkpoint = t.o.checkpoint;
  request.margin = kMargin;
  request.resident_bytes = t.resident_bytes;
  request.optimizer = costs.optimizer.front();
  request.optimizer_alternatives.assign(costs.optimizer.begin() + 1, costs.optimizer.end());
  const bool saves = !t.o.save_dir.empty() || !t.o.resume_dir.empty();
  if (t.sharded_weights() && saves) request.optimizer_alternatives.clear();  // fp32 state: saving splits it by parameter
  // Per rank: the gradients kept through the optimizer step (only this rank's share at ZeRO
  // stage 2), and, on rank 0 of a sharded run that saves, the whole state gathered to save.
  if (t.sharded_weights()) {
    request.gathered_blocks = t.sdp->block_bytes();
    request.gradient_bytes = t.sdp->owned_bytes();
    request.checkpoint = CheckpointPlan::all(t.w.chain->size());  // what gathering does anyway
  } else {
    request.gradient_bytes = predicted_rank_states(t.params, t.o.distributed.world_size, t.o.distributed.zero_stage, 0)
                                 .at(static_cast<size_t>(t.o.distributed.rank)).gradients;
  }
  if (t.sharded_weights() && t.primary && !t.o.save_dir.empty()) {
    // Saving at stage 3: rank 0 holds the largest block's whole weights and state beside its shards.
    const double per_byte = static_cast<double>(costs.optimizer.front().state_bytes) / static_cast<double>(std::max<int64_t>(1, t.sdp->owned_bytes()));
    int64_t largest = 0;
    for (const auto& b : t.sdp->block_bytes()) largest = std::max(largest, b.full);
    request.extra_bytes = largest + std::llround(per_byte * static_cast<double>(largest));
  } else if (t.sharded_optimizer() && t.primary && !t.o.save_dir.empty()) {
    int64_t owned = 0;
    for (const auto& p : optimized) owned += static_cast<int64_t>(p.nbytes());
    // (With state auto, the larger of the candidate states: a safe bound for either.)
    int64_t state_bytes = 0;
    for (const auto& c : costs.optimizer) state_bytes = std::max(state_bytes, c.state_bytes);
    const double per_byte = owned > 0 ? static_cast<double>(state_bytes) / static_cast<double>(owned) : 0.0;
    request.extra_bytes = std::llround(per_byte * static_cast<double>(costs.profile.weight_bytes)) - state_bytes;
  }
  t.planner.emplace(std::move(costs.profile), std::move(request));
  restore_rng(rng);
  if (t.start_step == 0) torch::manual_seed(t.w.seed);  // training's random stream starts from the seed
}

void Trainer::choose_budget() {
  TrainerState& t = *impl_;
  t.budget = t.o.budget_bytes;
  if (t.budget > 0) return;
  // The default lies halfway between the smallest plan and what the plain step needs (both
  // with the margin), so that the plan matters, and never below the smallest plan.
  const Plan plain = t.planner->evaluate(t.local.length, t.planner->profile().precisions.front().precision,
                                         CheckpointPlan::none());
  const int64_t floor = t.planner->floor_bytes();
  const auto plain_needs = static_cast<int64_t>(std::ceil(static_cast<double>(plain.predicted_peak) / (1.0 - kMargin)));
  const int64_t halfway = (floor + std::max(floor, plain_needs)) / 2;
  t.budget = (halfway + 1023) / 1024 * 1024;  // whole KiB, rounded up: still >= the floor
  t.plan.notes.push_back("budget " + format_bytes(t.budget) + ": the default, halfway between the smallest plan (" +
                         format_bytes(floor) + ") and what the plain step needs (" + format_bytes(plain_needs) + ")");
}

void Trainer::choose_plan() {
  TrainerState& t = *impl_;
  std::vector<std::string> notes = std::move(t.plan.notes);
  if (!t.resumed_meta.is_null()) {
    // A resumed run continues with the plan it saved: the same micro-batches, precision and
    // schedule, so the same stream of numbers.
    t.plan = plan_from_json(t.resumed_meta.at("plan"), t.w.chain->size());
    t.plan.notes = {"resumed with the saved plan"};
  } else {
    int timed = 0;
    t.plan = plan_timing_as_needed(*t.planner, t.budget, chain_timer(), &timed);
    if (timed > 0) store_costs(t.costs_source, t.planner->measured_costs());  // the cache keeps the sizes timed
    const bool pinned = t.o.micro_batch > 0 && t.o.checkpoint && t.planner->profile().precisions.size() == 1;
    if (!t.plan.feasible && pinned) {
      // The user fixed the configuration: run it, and let out-of-memory recovery split.
      t.plan = t.planner->evaluate(t.o.micro_batch, t.planner->profile().precisions.front().precision, *t.o.checkpoint, t.budget);
      t.plan.notes.push_back("the pinned configuration is predicted to need " + format_bytes(t.plan.predicted_peak) +
                             ", over the budget: micro-batches will be split when memory runs out");
    } else if (!t.plan.feasible) {
      throw std::runtime_error("budget " + format_bytes(t.budget) + " (" + std::to_string(t.budget) +
                               " bytes) is below what any plan needs: the smallest budget that works is " +
                               format_bytes(t.plan.floor_bytes) + " (" + std::to_string(t.plan.floor_bytes) + " bytes)");
    }
  }
  t.plan.notes.insert(t.plan.notes.begin(), notes.begin(), notes.end());
  t.plan.budget_bytes = t.budget;
}

ChainTimer Trainer::chain_timer() {
  // Micro-batches not profiled are timed when the search picks one; not at ZeRO 3,
  // where timing gathers the whole model (a collective the other ranks would not join).
  TrainerState& t = *impl_;
  if (t.sharded_weights()) return {};
  return [this](Precision precision, const std::vector<int64_t>& sizes, const TimingReference& reference) {
    TrainerState& t = *impl_;
    return time_plain_chain(t.w, first_local_batch(t), precision, sizes, reference, *t.tracker);
  };
}

void Trainer::adopt_rank0_plan() {
  // Every rank trains with rank 0's plan: each rank timed its own profile and could choose
  // differently, and equal precision and micro-batches keep ranks equal to one process.
  TrainerState& t = *impl_;
  const std::string mine = plan_json(t.plan).dump();
  const std::string rank0 = t.context->broadcast_string(mine, 0, "agreeing on the plan");
  const Plan theirs = plan_from_json(nlohmann::json::parse(rank0), t.w.chain->size());
  profile_where_missing(t, theirs.config.precision);
  if (rank0 == mine) return;
  const int64_t m = std::min(theirs.config.micro_batch_size(), t.local.length);
  std::vector<std::string> notes = t.plan.notes;
  t.plan = t.planner->evaluate(m, theirs.config.precision, theirs.config.checkpoint, t.budget, theirs.config.optimizer.state);
  t.plan.notes = notes;
  t.plan.notes.push_back("using rank 0's plan (this rank's own choice differed)");
}

const Plan& Trainer::plan() {
  TrainerState& t = *impl_;
  TORCH_CHECK(t.tracker != nullptr, "memfit::Trainer: call set_up() before plan()");
  const auto planning_start = TrainClock::now();
  make_planner();
  choose_budget();
  choose_plan();
  t.summary.planning_seconds = std::chrono::duration<double>(TrainClock::now() - planning_start).count();
  t.summary.profile_cached = t.costs_source.cached;
  if (t.context && t.resumed_meta.is_null()) adopt_rank0_plan();
  // State auto: the plan chose the optimizer's state precision (nothing is stepped yet).
  if (t.plan.config.optimizer.state != t.optimizer_spec.state) build_optimizer(t.plan.config.optimizer.state);
  const bool fp16 = t.plan.config.precision == Precision::kFP16;
  check_option(!(fp16 && t.sharded_optimizer()), "precision", "fp16",
               "fp16 with ZeRO 1 or 2 is not supported: the loss scaler's overflow check would see one shard only");
  t.scaler = std::make_unique<GradScaler>(GradScalerOptions{65536.0, 2.0, 0.5, 2000, fp16});
  if (!fp16) t.scaler.reset();
  t.recovery = std::make_unique<SplitRecovery>(t.local.length, t.o.batch, t.w.chain->size(), t.out, t.tty);
  t.eval_micro_batch = t.plan.config.micro_batch_size();
  t.budget_guard = std::make_unique<BudgetGuard>(t.budget);  // until the Trainer is destroyed
  print_plan(t);
  t.log = std::make_unique<JsonLog>(t.o.json_log);
  nlohmann::json line = plan_json(t.plan);
  line["type"] = "plan";
  t.log->write(line);
  t.summary.budget_bytes = t.budget;
  t.summary.losses.reserve(static_cast<size_t>(t.o.steps - t.start_step));  // no growth during training
  t.tracker->reset_phase_times();  // the summary's time per phase covers training only
  t.run_start = TrainClock::now();
  return t.plan;
}

// --- step --------------------------------------------------------------------------------------

StepResult Trainer::accumulate(int64_t step, const Batch& batch) {
  TrainerState& t = *impl_;
  t.recovery->begin_step(step, t.plan.config.checkpoint, format_bytes(t.budget));
  const bool inject = std::find(t.o.inject_oom.begin(), t.o.inject_oom.end(), step) != t.o.inject_oom.end();
  if (inject) t.alloc->fail_allocation_after(8);  // fails a few allocations into the forward
  StepResult r = accumulate_gradients(t.w, batch, t.recovery->split(t.plan.config.micro_batch_size()), t.step_options());
  t.alloc->fail_allocation_after(0);
  if (t.sdp) {
    t.sdp->reduce_gradients();
    const at::Tensor total = at::tensor({r.loss}, at::kDouble);
    t.context->all_reduce_sum(total, "summing the loss");
    r.loss = total.item<double>();  // the global batch's mean loss
  }
  return r;
}

void Trainer::update(bool last) {
  TrainerState& t = *impl_;
  StepOptions so = t.step_options();
  KnownStorage known;
  so.after_optimizer = [&] {  // this rank's state bytes, while gradients and optimizer state are all present
    if (t.tracker->recording()) t.tracker->stop_recording();
    known = known_storage(t.held_parameters(), optimizer_state_tensors(*t.optimizer), t.w.chain->buffers());
    const Categories live = classify_live(*t.tracker, known);
    t.own_state = {live.weights, live.gradients, live.optimizer_state};
  };
  try {
    if (optimizer_step(*t.optimizer, so)) ++t.summary.skipped_steps;
  } catch (const c10::OutOfMemoryError&) {
    throw std::runtime_error("out of memory in the optimizer step: budget " + format_bytes(t.budget) +
                             " cannot hold weights, gradients and the state of " + t.optimizer_spec.describe() +
                             " plus its temporaries");
  }
  if (t.sdp) t.sdp->finish_step(t.plan.config.set_to_none);  // owners broadcast the updated parameters
  if (last && !t.o.report_html.empty()) t.last_step_doc = step_document(t, known);
}

void Trainer::replan_after_oom(int64_t smallest_ok) {
  // A real out-of-memory error is likely to repeat: the following steps use what worked.
  TrainerState& t = *impl_;
  const char* nl = t.tty ? "\n" : "";
  if (smallest_ok < t.plan.config.micro_batch_size()) {
    t.out << nl << "re-plan: micro-batch " << t.plan.config.micro_batch_size() << " -> " << smallest_ok
          << " after a real out-of-memory error\n";
    t.plan.config.micro_batch = smallest_ok;
  } else if (t.plan.config.checkpoint.recomputed_blocks().size() < static_cast<size_t>(t.w.chain->size())) {
    t.out << nl << "re-plan: recompute every block after a real out-of-memory error\n";
    t.plan.config.checkpoint = CheckpointPlan::all(t.w.chain->size());
  }
}

double Trainer::step(int64_t step) {
  TrainerState& t = *impl_;
  TORCH_CHECK(t.log != nullptr, "memfit::Trainer: call set_up() and plan() before step()");
  check_option(step > t.start_step && step <= t.o.steps, "step", step,
               "expected " + std::to_string(t.start_step + 1) + " to steps (" + std::to_string(t.o.steps) + ")");
  if (auto leak = t.leaks.observe(step, t.tracker->current())) {
    t.out << (t.tty ? "\n" : "") << "warning: " << leak->message() << "\n";
    t.log->write({{"type", "warning"}, {"leak_bytes_per_step", leak->bytes_per_step}});
  }
  const bool last = step == t.o.steps;
  t.tracker->reset_peak();
  if (last && !t.o.report_html.empty()) t.tracker->start_recording();
  const auto t0 = TrainClock::now();
  const RngState rng_at_start = capture_rng(t.o.device);
  Batch batch;
  {
    PhaseGuard data(Phase::kData);
    batch = t.w.data->train_batch(step - 1, t.o.batch, t.w.seed).slice(t.local.start, t.local.length).to(t.o.device);
  }
  const StepResult r = accumulate(step, batch);
  batch = Batch{};
  if (!std::isfinite(r.loss) && !t.scaler) stop_on_nonfinite_loss(step, r.loss, rng_at_start);
  update(last);
  if (t.recovery->real_oom_in_step()) replan_after_oom(r.smallest_micro_batch);
  record(step, r.loss, std::chrono::duration<double>(TrainClock::now() - t0).count());
  if (!t.o.save_dir.empty() && (step % t.o.save_every == 0 || last)) save(step);
  return r.loss;
}

void Trainer::record(int64_t step, double loss, double seconds) {
  TrainerState& t = *impl_;
  const int64_t peak = t.tracker->peak() + t.resident_bytes;
  TrainSummary& s = t.summary;
  s.peak_bytes = std::max(s.peak_bytes, peak);
  s.samples += t.o.batch;
  s.losses.push_back(loss);
  s.final_loss = loss;
  s.steps = step;
  s.oom_recoveries = t.recovery->recoveries() + t.eval_recoveries;
  nlohmann::json line{{"type", "step"},     {"step", step},       {"loss", loss},
                      {"samples", t.o.batch}, {"seconds", seconds}, {"live_bytes", t.tracker->current()},
                      {"peak_bytes", peak},  {"oom_recoveries", s.oom_recoveries}};
  if (t.o.eval_every > 0 && (step % t.o.eval_every == 0 || step == t.o.steps)) {
    s.eval_loss = evaluate();
    line["eval_loss"] = s.eval_loss;
  }
  t.log->write(line);
  StepPoint point{step, loss, t.tracker->current(), peak};
  if (line.contains("eval_loss")) point.eval_loss = s.eval_loss;
  t.history.add(point);
  print_progress(t, step, line);
}

double Trainer::evaluate() {
  // Held-out batches run as micro-batches of the plan's size under the budget; one that runs
  // out of memory is halved and redone (inference keeps no graph, so that always converges).
  TrainerState& t = *impl_;
  const int64_t count = std::min(t.o.eval_batches, t.w.data->eval_batch_count(t.o.batch));
  double total = 0;
  for (int64_t i = 0; i < count; ++i) {
    const Batch batch = t.w.data->eval_batch(i, t.o.batch).to(t.o.device);
    double sum = 0;  // of each micro-batch's mean loss times its samples
    for (int64_t start = 0; start < batch.size();) {
      const int64_t length = std::min(t.eval_micro_batch, batch.size() - start);
      try {
        sum += eval_loss(t.w, batch.slice(start, length), t.plan.config.precision) * static_cast<double>(length);
        start += length;
      } catch (const c10::OutOfMemoryError&) {
        if (length == 1) throw std::runtime_error("out of memory in evaluation even with 1 sample: budget " + format_bytes(t.budget));
        t.eval_micro_batch = length / 2;
        ++t.eval_recoveries;
        t.out << (t.tty ? "\n" : "") << "out of memory in evaluation: micro-batch " << length << " -> " << length / 2 << "\n";
      }
    }
    total += sum / static_cast<double>(batch.size());
  }
  return count > 0 ? total / static_cast<double>(count) : 0.0;
}

void Trainer::save(int64_t step) {
  TrainerState& t = *impl_;
  const nlohmann::json meta{{"version", 2},
                            {"step", step},
                            {"batch", t.o.batch},
                            {"seed", t.w.seed},
                            {"model", t.w.description},
                            {"parameters", t.parameter_count},
                            {"optimizer", optimizer_family_name(t.o.optimizer.family)},
                            {"optimizer_state", state_precision_name(t.optimizer_spec.state)},
                            {"plan", plan_json(t.plan)}};
  t.last_saved_step = step;
  if (t.sharded_weights()) {
    save_gathered(meta);
    return;
  }
  if (t.sharded_optimizer()) {
    // Rank 0 saves the whole state, gathered from its owners: the single-process format.
    auto full = t.sdp->gather_optimizer_state(*t.optimizer, t.optimizer_spec);
    if (t.primary) save_state(t.o.save_dir, *t.w.chain, *full, t.optimizer_spec, meta, t.o.device);
  } else if (t.primary) {
    save_state(t.o.save_dir, *t.w.chain, *t.optimizer, t.optimizer_spec, meta, t.o.device);
  }
  if (t.primary && t.w.save_model) {
    // The trained model in its own format (TorchScript for a model that came as a file), for
    // the user: written after the state, atomically, and not needed to resume.
    const std::string path = t.o.save_dir + "/model.pt";
    t.w.save_model(path + ".tmp");
    std::filesystem::rename(path + ".tmp", path);
  }
}

void Trainer::save_gathered(const nlohmann::json& meta) {
  // ZeRO 3, block by block: rank 0 gathers one block's weights and state, writes its part of
  // the single-process format and lets it go.
  TrainerState& t = *impl_;
  std::vector<StatePart> parts = state_parts(*t.w.chain);
  std::optional<StateWriter> writer;
  if (t.primary) writer.emplace(t.o.save_dir, meta.at("step").get<int64_t>());
  t.sdp->for_each_gathered_block_state(*t.optimizer, t.optimizer_spec, [&](int block, const auto& state) {
    StatePart& part = parts.at(static_cast<size_t>(block));
    put_parameter_state(part, t.w.chain->block_parameters(block, block), state);
    writer->write_part(part);
    put_parameter_state(part, {}, {});  // let the gathered state go
  });
  if (!t.primary) return;
  writer->commit(meta, t.optimizer_spec, t.o.device);
  if (t.w.save_model && !t.model_file_note) {
    t.model_file_note = true;
    t.out << "  note: model.pt is not written at ZeRO 3 (a model file needs the whole model in one process); "
             "the saved state holds the trained weights\n";
  }
}

void Trainer::resume_gathered(const SavedState& saved) {
  // ZeRO 3, block by block: every rank reads block k's part, keeps its shards of it.
  TrainerState& t = *impl_;
  const std::vector<StatePart> live = state_parts(*t.w.chain);
  if (saved.parts() != static_cast<int>(live.size())) {
    throw std::runtime_error("cannot resume: " + saved.file().string() + " holds " + std::to_string(saved.parts()) +
                             " parts, this model has " + std::to_string(live.size()) + " blocks");
  }
  t.sdp->load_block_states(
      [&](int block) {
        const StatePart part = saved.read_part(block);
        const StatePart& mine = live.at(static_cast<size_t>(block));
        check_part_fits(part, mine, t.optimizer_spec, saved.file().string() + " (block " + std::to_string(block) + ")");
        copy_part_tensors(part, mine);
        StatePart saved_on_mine = mine;  // the saved state, found by this model's tensors
        saved_on_mine.parameter_state = part.parameter_state;
        return parameter_state_of(saved_on_mine, t.w.chain->block_parameters(block, block));
      },
      *t.optimizer, t.optimizer_spec);
  saved.restore_generators(t.o.device);
}

// --- summary -------------------------------------------------------------------------------------

TrainSummary Trainer::summarize() {
  TrainerState& t = *impl_;
  TORCH_CHECK(t.log != nullptr, "memfit::Trainer: call set_up() and plan() before summarize()");
  TrainSummary& s = t.summary;
  s.seconds = std::chrono::duration<double>(TrainClock::now() - t.run_start).count();
  if (t.sharded_weights()) {
    s.weights_sha256 = gathered_weights_sha256(*t.sdp, t.o.dump_weights);
  } else {
    s.weights_sha256 = weights_sha256(*t.w.chain);
    if (!t.o.dump_weights.empty()) dump_weights(t.o.dump_weights, t.params);
  }
  s.world_size = t.o.distributed.world_size;
  s.zero_stage = t.o.distributed.zero_stage;
  s.budget_bytes = t.budget;
  s.plan = t.plan;
  s.ranks.clear();
  const auto* adam8bit = dynamic_cast<const Adam8bit*>(t.optimizer.get());
  const int64_t own_skipped = adam8bit != nullptr ? adam8bit->skipped_updates() : 0;
  s.skipped_updates = own_skipped;
  if (t.context) {
    const auto all = t.context->all_gather(
        {t.own_state.weights, t.own_state.gradients, t.own_state.optimizer_state, own_skipped}, "gathering state bytes");
    s.skipped_updates = 0;
    for (int r = 0; r < s.world_size; ++r) {
      const auto& v = all[static_cast<size_t>(r)];
      s.ranks.push_back({r, {v[0], v[1], v[2]}});
      s.skipped_updates += v[3];
    }
  } else {
    s.ranks.push_back({0, t.own_state});
  }
  print_summary(t);
  write_report(t);
  t.log->write(s.json());
  t.log->commit();
  return s;
}

TrainSummary Trainer::run() {
  set_up();
  plan();
  TrainerState& t = *impl_;
  for (int64_t s = t.start_step + 1; s <= t.o.steps; ++s) {
    step(s);
    if (s < t.o.steps && stop_agreed()) {
      t.summary.interrupted = true;
      if (!t.o.save_dir.empty() && t.last_saved_step != s) save(s);
      t.out << (t.tty ? "\n" : "") << "stopped after step " << s << " on request"
            << (t.o.save_dir.empty() ? "" : "; the state is saved in " + t.o.save_dir) << "\n";
      break;
    }
  }
  if (t.tty) t.out << "\n";
  return summarize();
}

bool Trainer::stop_agreed() {
  // Every rank must leave the loop after the same step, or the others wait in a collective.
  TrainerState& t = *impl_;
  if (!t.context) return stop_requested();
  const at::Tensor flag = at::tensor({stop_requested() ? int64_t{1} : int64_t{0}}, at::kLong);
  t.context->all_reduce_sum(flag, "agreeing on a stop request");
  return flag.item<int64_t>() > 0;
}

void Trainer::stop_on_nonfinite_loss(int64_t step, double loss, const RngState& rng_at_start) {
  // The weights are still those after the previous step: save them as they are (with the
  // random stream as the step found it), and stop.
  TrainerState& t = *impl_;
  zero_grad(t.held_parameters(), true);
  restore_rng(rng_at_start);
  std::string saved;
  if (!t.o.save_dir.empty() && step > 1) {
    save(step - 1);
    saved = "; the state after step " + std::to_string(step - 1) + " is saved in " + t.o.save_dir;
  }
  throw std::runtime_error(std::string("the loss is ") + (std::isnan(loss) ? "nan" : "infinite") + " at step " +
                           std::to_string(step) + ": training diverged (a smaller --lr may help)" + saved);
}

TrainSummary train(Workload& workload, const TrainOptions& options, std::ostream& out) {
  return Trainer(workload, options, out).run();
}

nlohmann::json TrainSummary::json() const {
  nlohmann::json rank_lines = nlohmann::json::array();
  for (const auto& r : ranks) {
    rank_lines.push_back({{"rank", r.rank}, {"weights", r.bytes.weights}, {"gradients", r.bytes.gradients},
                          {"optimizer_state", r.bytes.optimizer_state}});
  }
  return {{"type", "summary"},          {"steps", steps},
          {"samples", samples},         {"final_loss", final_loss},
          {"eval_loss", eval_loss},     {"peak_bytes", peak_bytes},
          {"budget_bytes", budget_bytes}, {"oom_recoveries", oom_recoveries},
          {"skipped_steps", skipped_steps}, {"skipped_updates", skipped_updates},
          {"planning_seconds", planning_seconds}, {"profile_cached", profile_cached},
          {"weights_sha256", weights_sha256},
          {"world_size", world_size},   {"zero_stage", zero_stage},
          {"seconds", seconds},         {"interrupted", interrupted},
          {"ranks", rank_lines},
          {"plan", plan_json(plan)}};
}

}  // namespace memfit
