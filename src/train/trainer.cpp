// The Trainer: setting up, resuming, the step loop, evaluating, saving and the summary. Planning
// is trainer_plan.cpp; what the run records and writes, run_record.cpp.
#include "memfit/train/trainer.h"

#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <filesystem>

#include "memfit/errors.h"
#include "memfit/measure/breakdown.h"
#include "memfit/measure/memory_space.h"
#include "memfit/measure/size.h"
#include "memfit/techniques/activation_offload.h"
#include "memfit/techniques/grads.h"
#include "memfit/techniques/optimizer_8bit.h"
#include "memfit/techniques/rng.h"
#include "memfit/train/stop_signal.h"
#include "memfit/train/strategy_registry.h"
#include "trainer_impl.h"

namespace memfit {

void check_train_options(const TrainOptions& o, const Workload& w) {
  check_workload(w);
  StepConfig step = o.step;
  step.micro_batch = 0;  // checked against this rank's share below
  check_step_config(step, w.chain->size());
  check_option(o.steps >= 1, "steps", o.steps, "expected a positive integer");
  check_option(o.budget_bytes >= 0, "budget", o.budget_bytes, "expected a positive size (0: the default)");
  check_option(o.save_every >= 1, "save_every", o.save_every, "expected >= 1");
  check_option(o.eval_every >= 0, "eval_every", o.eval_every, "expected >= 0 (0: never)");
  check_option(o.eval_batches >= 1, "eval_batches", o.eval_batches, "expected >= 1");
  for (int64_t s : o.inject_oom) {
    check_option(s >= 1 && s <= o.steps, "inject_oom", s, "expected steps from 1 to steps (" + std::to_string(o.steps) + ")");
  }
  const int world = o.distributed.world_size;
  validate(o.distributed);
  check_option(o.step.batch >= world, "batch", o.step.batch,
               "each of the " + std::to_string(world) + " ranks needs at least one sample");
  const BatchSlice local = rank_slice(o.step.batch, o.distributed.rank, world);
  check_option(o.step.micro_batch >= 0 && o.step.micro_batch <= local.length, "micro_batch", o.step.micro_batch,
               world == 1 ? "expected 1 to batch (" + std::to_string(o.step.batch) + ")"
                          : "expected 1 to this rank's share of batch (" + std::to_string(local.length) + " of " +
                                std::to_string(o.step.batch) + " over " + std::to_string(world) + " ranks)");
  const StateUse state{!o.save_dir.empty(), !o.resume_dir.empty()};
  check_strategy_options({o.distributed, o.step, o.pin_precision, o.pin_checkpoint, state, o.offload, w.chain->size()});
  check_option(o.budget_bytes > 0 || (o.step.micro_batch == 0 && !o.pin_checkpoint), "budget", "(none)",
               "a budget is required when the micro-batch or the checkpoint schedule is pinned");
  check_option(o.offload == OffloadMode::kNone || o.offload == OffloadMode::kOptimizer || activation_offload_available(),
               "offload", offload_mode_name(o.offload),
               "activations cannot be offloaded in this process (its autograd engine is Python's: use "
               "torch.autograd.graph.saved_tensors_hooks there)");
  check_option(o.host_budget_bytes >= 0, "host_budget", o.host_budget_bytes, "expected a positive size (0: unlimited)");
}

// --- the parts --------------------------------------------------------------------------------

TrainingMemory::TrainingMemory(c10::Device device)
    : device(device), allocator(BudgetAllocator::install()), tracker(std::make_shared<MemoryTracker>()), scope(tracker) {
  if (device.is_cuda()) outside = measure_outside_memory(cuda_index());
}

void TrainingMemory::enforce(int64_t bytes) {
  if (device.is_cuda()) {
    cuda_cap.emplace(bytes - outside.total(), cuda_index());
    reset_cuda_allocator_counters(cuda_index());  // the summary's peaks are the steps' under the cap
  } else {
    budget.emplace(bytes);
  }
}

void TrainOptimizer::build(const OptimizerSpec& asked, StatePrecision state, const std::vector<at::Tensor>& params) {
  optimizer.reset();  // the old state is released first
  spec = asked.with_state(state);
  optimizer = make_optimizer(spec, params);
}

int64_t TrainOptimizer::skipped_updates() const {
  const auto* adam8bit = dynamic_cast<const Adam8bit*>(optimizer.get());
  return adam8bit != nullptr ? adam8bit->skipped_updates() : 0;
}

Trainer::Impl::Impl(Workload& w, TrainOptions o) : workload(w), options(std::move(o)) {
  // Each rank on CUDA takes its own GPU, and its group carries the step's tensors.
  if (options.distributed.enabled()) options.step.device = rank_device(options.step.device, options.distributed.rank);
  options.distributed.device = options.step.device;
}

Batch Trainer::Impl::local_batch(int64_t index) const {
  return workload.data->train_batch(index, options.step.batch, workload.seed)
      .slice(local.start, local.length)
      .to(options.step.device);
}

Batch Trainer::Impl::local_plan_batch(int64_t index) const {
  return workload.data->plan_batch(index, options.step.batch, workload.seed)
      .slice(local.start, local.length)
      .to(options.step.device);
}

StepConfig Trainer::Impl::config_for(const Batch& batch) {
  if (!plan.shapes || plan.after_oom) return plan.plan.config;
  const Plan& chosen = plan.shapes->choose(batch.size(), batch.length());
  if (!chosen.feasible) return plan.plan.config;  // the recovery does what it can
  StepConfig c = plan.plan.config;
  c.micro_batch = chosen.config.micro_batch_size();
  c.checkpoint = chosen.config.checkpoint;
  c.offload.activation_blocks = chosen.config.offload.activation_blocks;
  return c;
}

StepOptions Trainer::Impl::step_options(const StepConfig& config) const {
  StepOptions so{config};
  so.scaler = recovery.scaler.get();
  so.recovery = recovery.split.get();
  if (OptimizerOffload* offload = strategy->optimizer_offload()) offload->attach(so);
  return so;
}

StartEvent Trainer::Impl::start_event() const {
  StartEvent e;
  e.description = workload.description;
  e.parameters = parameter_count;
  e.parameter_bytes = parameter_bytes;
  e.batch = options.step.batch;
  e.local_start = local.start;
  e.local_length = local.length;
  e.optimizer = options.step.optimizer.describe();
  e.threads = at::get_num_threads();
  e.device = options.step.device.str();
  e.strategy = strategy->describe();
  e.notes = workload.notes;
  e.primary = strategy->primary();
  e.steps = options.steps;
  return e;
}

// --- Trainer ----------------------------------------------------------------------------------

Trainer::Trainer(Workload& workload, TrainOptions options)
    : impl_(std::make_unique<Impl>(workload, std::move(options))) {}
Trainer::~Trainer() = default;

void Trainer::add_observer(TrainObserver& observer) { impl_->observers.add(observer); }
int64_t Trainer::start_step() const { return impl_->record.start_step; }
torch::optim::Optimizer& Trainer::optimizer() { return *impl_->optimizer.optimizer; }
void Trainer::dump_weights_at_summary(std::string path) { impl_->dump_weights = std::move(path); }

void Trainer::Impl::require(Stage needed, const char* part) const {
  static const char* const kFirst[] = {"", "set_up()", "set_up() and plan()"};
  const auto at = static_cast<int>(stage), need = static_cast<int>(needed);
  TORCH_CHECK(at >= need, "memfit::Trainer: call ", kFirst[need], " before ", part);
  TORCH_CHECK(at <= need, "memfit::Trainer: ", part, " runs once, before ", at == 1 ? "plan()" : "the steps");
}

void Trainer::set_up() {
  Impl& t = *impl_;
  t.require(Impl::Stage::kCreated, "set_up()");
  check_train_options(t.options, t.workload);
  make_8bit_maps_if_used(t.options.step.optimizer, t.options.step.device);  // before the tracker: resident, not tracked
  t.memory = std::make_unique<TrainingMemory>(t.options.step.device);  // (before the model moves there)
  Chain& chain = *t.workload.chain;
  chain.to(t.options.step.device);
  t.parameter_count = memfit::parameter_count(chain);
  t.parameter_bytes = memfit::parameter_bytes(chain);
  adopt_tensors(*t.memory->tracker, chain.parameters());  // the caller built them before this tracker existed
  adopt_tensors(*t.memory->tracker, chain.buffers());
  // What else the budget counts from the start (the caller's data tensors, say, the 8-bit maps;
  // on CUDA also the cuBLAS workspace of this thread): the plan reserves it, and reported peaks include it.
  t.memory->resident_bytes = untracked_bytes(*t.memory->tracker, t.options.step.device);
  t.strategy = make_strategy(t.options.distributed, chain);
  t.local = t.strategy->local_slice(t.options.step.batch);
  const OptimizerSpec& spec = t.options.step.optimizer;
  t.strategy->group().check_same_on_all_ranks(
      {{"batch", t.options.step.batch}, {"steps", t.options.steps}, {"seed", static_cast<int64_t>(t.workload.seed)},
       {"optimizer", static_cast<int64_t>(spec.family)}, {"optimizer state", static_cast<int64_t>(spec.state)},
       {"save (given or not)", t.options.save_dir.empty() ? 0 : 1}, {"save_every", t.options.save_every},
       {"resume (given or not)", t.options.resume_dir.empty() ? 0 : 1}});
  if (!t.strategy->primary()) {  // ranks hold equal weights: rank 0 alone writes
    t.options.json_log.clear();
    t.options.report_html.clear();
  }
  if (!t.options.json_log.empty()) {
    t.json_log = std::make_unique<JsonLog>(t.options.json_log);
    t.observers.add(*t.json_log);
  }
  // State auto: fp32 until the plan (or the saved state resumed) says otherwise.
  t.optimizer.build(spec, spec.state == StatePrecision::kAuto ? StatePrecision::kFP32 : spec.state,
                    t.strategy->optimized_parameters());
  t.observers.on_start(t.start_event());
  if (!t.options.resume_dir.empty()) t.resume();
  t.stage = Impl::Stage::kSetUp;
}

void Trainer::Impl::resume() {
  if (strategy->primary()) remove_stale_state_files(options.resume_dir);  // what an interrupted save left
  SavedState saved = SavedState::open(options.resume_dir);
  const std::string where = saved.file().string();
  SavedMeta meta;
  try {
    meta = SavedMeta::from_json(saved.meta());
  } catch (const std::invalid_argument& e) {
    throw std::runtime_error("cannot resume: " + where + ": " + e.what());
  }
  if (meta.model != workload.description) {
    throw std::runtime_error("cannot resume: " + where + " holds '" + meta.model + "', not '" + workload.description +
                             "' (the same model is needed)");
  }
  check_option(meta.batch == options.step.batch, "batch", options.step.batch,
               where + " was trained with batch " + std::to_string(meta.batch) + ": expected " + std::to_string(meta.batch));
  const OptimizerSpec& asked = options.step.optimizer;
  check_option(meta.optimizer == asked.family, "optimizer", optimizer_family_name(asked.family),
               where + " was trained with " + optimizer_family_name(meta.optimizer) + ": expected " +
                   optimizer_family_name(meta.optimizer));
  check_option(asked.state == StatePrecision::kAuto || asked.state == meta.optimizer_state, "optimizer.state",
               state_precision_name(asked.state),
               where + " was trained with " + state_precision_name(meta.optimizer_state) + " optimizer state: expected " +
                   state_precision_name(meta.optimizer_state) + " or auto");
  if (meta.optimizer_state != optimizer.spec.state) {
    optimizer.build(asked, meta.optimizer_state, strategy->optimized_parameters());
  }
  strategy->resume(saved, *optimizer.optimizer, optimizer.spec, options.step.device);
  record.start_step = meta.step;
  record.resumed = std::move(meta);
  observers.on_note("resumed from " + options.resume_dir + " at step " + std::to_string(record.start_step));
}

// --- the step ---------------------------------------------------------------------------------

StepResult Trainer::Impl::accumulate(int64_t step, const Batch& batch) {
  BudgetAllocator& alloc = memory->allocator;
  const StepConfig config = config_for(batch);
  plan.last_step = config;
  plan.last_step_length = batch.length();
  const int64_t m = std::min(config.micro_batch_size(), batch.size());
  recovery.split->begin_step(step, config.checkpoint, format_bytes(plan.budget));
  const auto& inject = options.inject_oom;
  if (std::find(inject.begin(), inject.end(), step) != inject.end()) alloc.fail_allocation_after(8);  // a few allocations into the forward
  StepResult r = accumulate_gradients(workload, batch, recovery.split->split(m), step_options(config));
  alloc.fail_allocation_after(0);
  strategy->reduce_gradients();
  r.loss = strategy->group().sum(r.loss, "summing the loss");  // the global batch's mean loss
  return r;
}

void Trainer::Impl::update(bool last) {
  StepOptions so = step_options();
  KnownStorage known, known_host;
  MemoryTracker& tracker = *memory->tracker;
  so.after_optimizer = [&] {  // this rank's state bytes, while gradients and optimizer state are all present
    if (tracker.recording()) tracker.stop_recording();
    known = known_storage(strategy->held_parameters(), optimizer_state_tensors(*optimizer.optimizer),
                          workload.chain->buffers());
    const Categories live = classify_live(tracker, known, memory->counted());
    record.own_state = {live.weights, live.gradients, live.optimizer_state};
    if (OptimizerOffload* offload = strategy->optimizer_offload()) {
      known_host = known_storage(offload->host_parameters(), optimizer_state_tensors(*optimizer.optimizer));
    }
  };
  try {
    if (strategy->optimizer_step(*optimizer.optimizer, so)) ++record.summary.skipped_steps;
  } catch (const c10::OutOfMemoryError&) {
    throw std::runtime_error("out of memory in the optimizer step: budget " + format_bytes(plan.budget) +
                             " cannot hold weights, gradients and the state of " + optimizer.spec.describe() +
                             " plus its temporaries");
  }
  if (last && !options.report_html.empty()) {
    record.last_step = analyze_step(tracker, known, workload.chain->size(), memory->counted());
    if (plan.plan.config.offload.any()) {
      const MemoryDevice host = host_memory_device_of(options.step.device);
      record.last_host_step = analyze_step(tracker, known_host, workload.chain->size(), host);
    }
  }
}

// A real out-of-memory error is likely to repeat: the following steps run what worked.
void Trainer::Impl::replan_after_oom(int64_t smallest_ok) {
  StepConfig& config = plan.plan.config;
  plan.after_oom = true;
  const int blocks = workload.chain->size();
  const bool recomputes_all = config.checkpoint.recomputed_blocks().size() >= static_cast<size_t>(blocks);
  const SplitRecovery::NextSteps next = recovery.split->next_steps(config.micro_batch_size(), smallest_ok, recomputes_all);
  if (next.micro_batch != config.micro_batch_size()) config.micro_batch = next.micro_batch;
  if (next.recompute_all) config.checkpoint = CheckpointPlan::all(blocks);
}

double Trainer::step(int64_t step) {
  Impl& t = *impl_;
  t.require(Impl::Stage::kPlanned, "step()");
  check_option(step > t.record.start_step && step <= t.options.steps, "step", step,
               "expected " + std::to_string(t.record.start_step + 1) + " to steps (" + std::to_string(t.options.steps) + ")");
  MemoryTracker& tracker = *t.memory->tracker;
  if (auto leak = t.record.leaks.observe(step, tracker.current(t.memory->counted()))) {
    t.observers.on_note("warning: " + leak->message());
  }
  const bool last = step == t.options.steps;
  tracker.reset_peak();
  if (last && !t.options.report_html.empty()) tracker.start_recording();
  const auto t0 = TrainClock::now();
  const RngState rng_at_start = capture_rng(t.options.step.device);
  Batch batch;
  {
    PhaseGuard data(Phase::kData);
    batch = t.local_batch(step - 1);
  }
  const StepResult r = t.accumulate(step, batch);
  batch = Batch{};
  if (!std::isfinite(r.loss) && !t.recovery.scaler) t.stop_on_nonfinite_loss(step, r.loss, rng_at_start);
  t.update(last);
  if (t.recovery.split->real_oom_in_step()) t.replan_after_oom(r.smallest_micro_batch);
  t.record_step(step, r.loss, std::chrono::duration<double>(TrainClock::now() - t0).count());
  if (!t.options.save_dir.empty() && (step % t.options.save_every == 0 || last)) t.save(step);
  return r.loss;
}

void Trainer::Impl::record_step(int64_t step, double loss, double seconds) {
  TrainSummary& s = record.summary;
  StepEvent e;
  e.step = step;
  e.first_step = record.start_step + 1;
  e.last_step = options.steps;
  e.loss = loss;
  e.samples = options.step.batch;
  e.tokens_per_sample = plan.last_step_length > 0 ? plan.last_step_length : workload.sample_tokens;
  e.micro_batch = plan.last_step.micro_batch_size();
  e.recomputed_blocks = static_cast<int64_t>(plan.last_step.checkpoint.recomputed_blocks().size());
  e.seconds = seconds;
  e.live_bytes = memory->tracker->current(memory->counted());
  e.peak_bytes = memory->step_peak();
  e.host_peak_bytes = memory->tracker->peak(host_memory_device_of(options.step.device));
  e.budget_bytes = plan.budget;
  s.peak_bytes = std::max(s.peak_bytes, e.peak_bytes);
  s.host_peak_bytes = std::max(s.host_peak_bytes, e.host_peak_bytes);
  s.samples += options.step.batch;
  s.losses.push_back(loss);
  s.final_loss = loss;
  s.steps = step;
  if (options.eval_every > 0 && (step % options.eval_every == 0 || step == options.steps)) {
    e.eval_loss = s.eval_loss = evaluate();
    s.evaluated = true;
    observers.on_eval({step, *e.eval_loss});
  }
  s.oom_recoveries = e.oom_recoveries = recovery.split->recoveries() + recovery.eval_recoveries;
  record.history.add({step, loss, e.live_bytes, e.peak_bytes, e.eval_loss});
  observers.on_step(e);
}

// Held-out batches run as micro-batches of the plan's size under the budget, through the one
// micro-batch loop with the one recovery rule (oom_recovery.h): a micro-batch that runs out of
// memory is split in two, and after a real out-of-memory error later evaluations run what worked.
double Trainer::evaluate() {
  impl_->require(Impl::Stage::kPlanned, "evaluate()");
  return impl_->evaluate();
}

double Trainer::Impl::evaluate() {
  const int64_t batch_size = options.step.batch;
  const int64_t count = std::min(options.eval_batches, workload.data->eval_batch_count(batch_size));
  double total = 0;
  for (int64_t i = 0; i < count; ++i) total += evaluate_batch(workload.data->eval_batch(i, batch_size).to(options.step.device));
  return count > 0 ? total / static_cast<double>(count) : 0.0;
}

double Trainer::Impl::evaluate_batch(const Batch& batch) {
  SplitRecovery split(batch.size(), batch.size(), workload.chain->size(), [this](const std::string& note) { observers.on_note(note); });
  split.begin_evaluation(format_bytes(plan.budget));
  MicroBatchLoop loop;
  loop.device = options.step.device;
  loop.recovery = &split;
  const int64_t m = std::min(recovery.eval_micro_batch, batch.size());
  const Precision precision = plan.plan.config.precision;
  const StepResult r = accumulate_micro_batches(
      split.split(m),
      [&](const PendingMicroBatch& p) {
        return eval_loss(workload, batch.slice(p.part.start, p.part.length), precision) * p.part.weight;
      },
      loop);
  recovery.eval_recoveries += split.recoveries();
  if (split.real_oom_in_step()) recovery.eval_micro_batch = split.next_steps(m, r.smallest_micro_batch, true).micro_batch;
  return r.loss;  // the batch's mean loss: each part weighted by its share
}

// --- saving -----------------------------------------------------------------------------------

void Trainer::save(int64_t step) {
  impl_->require(Impl::Stage::kPlanned, "save()");
  impl_->save(step);
}

void Trainer::Impl::save(int64_t step) {
  Impl& t = *this;
  SavedMeta meta;
  meta.step = step;
  meta.batch = t.options.step.batch;
  meta.seed = t.workload.seed;
  meta.model = t.workload.description;
  meta.parameters = t.parameter_count;
  meta.optimizer = t.options.step.optimizer.family;
  meta.optimizer_state = t.optimizer.spec.state;
  meta.plan = plan_json(t.plan.plan);
  const nlohmann::json meta_json = meta.to_json();
  t.record.last_saved_step = step;
  {
    std::optional<OptimizerOffload::DeviceKeys> keys;  // saved state names the model's parameters
    if (OptimizerOffload* offload = t.strategy->optimizer_offload()) keys.emplace(*offload, *t.optimizer.optimizer);
    t.strategy->save({t.options.save_dir, *t.optimizer.optimizer, t.optimizer.spec, meta_json, t.options.step.device});
  }
  SaveEvent e{step, t.options.save_dir, false};
  if (t.strategy->primary() && t.workload.save_model && t.strategy->holds_whole_model()) {
    // The trained model in its own format (TorchScript for a model that came as a file), for
    // the user: written after the state, atomically, and not needed to resume.
    const std::string path = t.options.save_dir + "/model.pt";
    t.workload.save_model(path + ".tmp");
    std::filesystem::rename(path + ".tmp", path);
    e.model_file = true;
  } else if (t.strategy->primary() && t.workload.save_model && !t.record.model_file_note) {
    t.record.model_file_note = true;
    t.observers.on_note("model.pt is not written: no process holds the whole model (the saved state holds the trained weights)");
  }
  t.observers.on_save(e);
}

// --- the run ----------------------------------------------------------------------------------

TrainSummary Trainer::summarize() {
  Impl& t = *impl_;
  t.require(Impl::Stage::kPlanned, "summarize()");
  TrainSummary& s = t.record.summary;
  s.seconds = std::chrono::duration<double>(TrainClock::now() - t.record.run_start).count();
  s.weights_sha256 = t.strategy->weights_sha256(t.strategy->primary() ? t.dump_weights : "");
  s.world_size = t.strategy->world_size();
  s.zero_stage = t.options.distributed.zero_stage;
  s.budget_bytes = t.plan.budget;
  s.plan = t.plan.plan;
  const RankStateBytes& own = t.record.own_state;
  const auto all = t.strategy->group().all_gather(
      {own.weights, own.gradients, own.optimizer_state, t.optimizer.skipped_updates()}, "gathering state bytes");
  s.ranks.clear();
  s.skipped_updates = 0;
  for (const auto& v : all) {
    s.ranks.push_back({v[0], v[1], v[2]});
    s.skipped_updates += v[3];
  }
  if (t.options.step.device.is_cuda()) {
    s.cuda = cuda_allocator_counters(t.memory->cuda_index());
    s.cuda_outside_bytes = t.memory->outside.total();
  }
  const MemoryTracker& tracker = *t.memory->tracker;
  for (Phase p : {Phase::kData, Phase::kForward, Phase::kBackward, Phase::kRecompute, Phase::kOptimizer, Phase::kEval}) {
    s.phase_seconds[phase_name(p)] = static_cast<double>(tracker.phase_time_ns(p)) / 1e9;
  }
  t.write_report();
  t.observers.on_summary(s);
  return s;
}

TrainSummary Trainer::run() {
  set_up();
  plan();
  Impl& t = *impl_;
  for (int64_t s = t.record.start_step + 1; s <= t.options.steps; ++s) {
    step(s);
    // Every rank must leave the loop after the same step, or the others wait in a collective.
    if (s < t.options.steps && t.strategy->group().any(stop_requested(), "agreeing on a stop request")) {
      t.record.summary.interrupted = true;
      if (!t.options.save_dir.empty() && t.record.last_saved_step != s) t.save(s);
      t.observers.on_note("stopped after step " + std::to_string(s) + " on request" +
                          (t.options.save_dir.empty() ? "" : "; the state is saved in " + t.options.save_dir));
      break;
    }
  }
  return summarize();
}

// The weights are still those after the previous step: save them as they are (with the random
// stream as the step found it), and stop.
void Trainer::Impl::stop_on_nonfinite_loss(int64_t step, double loss, const RngState& rng_at_start) {
  zero_grad(strategy->held_parameters(), true);
  restore_rng(rng_at_start);
  std::string saved;
  if (!options.save_dir.empty() && step > 1) {
    save(step - 1);
    saved = "; the state after step " + std::to_string(step - 1) + " is saved in " + options.save_dir;
  }
  throw std::runtime_error(std::string("the loss is ") + (std::isnan(loss) ? "nan" : "infinite") + " at step " +
                           std::to_string(step) + ": training diverged (a smaller learning rate may help)" + saved);
}

TrainSummary train(Workload& workload, const TrainOptions& options, TrainObserver& observer) {
  Trainer trainer(workload, options);
  trainer.add_observer(observer);
  return trainer.run();
}

}  // namespace memfit
