#include "memfit/report/report.h"

#include <torch/torch.h>

#include "memfit/errors.h"
#include "memfit/measure/cuda_budget.h"
#include "memfit/runtime/step.h"
#include "memfit/techniques/cache.h"

namespace memfit {
namespace {

void check_report_options(const Workload& w, const ReportOptions& o) {
  check_workload(w);
  check_step_config(o.step, w.chain->size());
  check_option(o.steps >= 1, "steps", o.steps, "expected a positive integer");
  check_option(o.world_size >= 1 && o.world_size <= o.step.batch, "world_size", o.world_size,
               "expected 1 to batch (" + std::to_string(o.step.batch) + "): each rank needs at least one sample");
}

// The whole run's allocations (for the CUDA prediction) and where its last step begins.
struct RunTrace {
  AllocationTrace trace;
  size_t last_step_from = 0;
};

// One step of the report: a training step (or an evaluation pass), the last one recorded
// and analysed into `r`. The recording until then is kept in `run`.
void report_step(Workload& w, torch::optim::Optimizer& optimizer, const ReportOptions& o, MemoryTracker& tracker,
                 int64_t step, Report& r, RunTrace& run) {
  const bool last = step == o.steps;
  const MemoryDevice device = memory_device_of(o.step.device);
  const auto params = w.chain->parameters();
  Batch batch;
  {
    PhaseGuard data(Phase::kData);
    batch = (o.eval_only ? w.data->eval_batch(step - 1, o.step.batch) : w.data->train_batch(step - 1, o.step.batch, w.seed))
                .to(o.step.device);
  }
  if (last) {
    run.trace = recorded_trace(tracker);
    run.last_step_from = run.trace.events.size();
    tracker.reset_peak();
    tracker.start_recording();
  }
  if (o.eval_only) {
    r.loss = eval_loss(w, batch, o.step.precision);
    if (!last) return;
    tracker.stop_recording();
    r.analysis = analyze_step(tracker, known_storage(params, optimizer_state_tensors(optimizer), w.chain->buffers()),
                              w.chain->size(), device);
    return;
  }
  KnownStorage known;
  StepOptions so{o.step};
  so.after_optimizer = [&] {
    if (!last) return;
    tracker.stop_recording();
    known = known_storage(params, optimizer_state_tensors(optimizer), w.chain->buffers());
    r.states = classify_live(tracker, known, device);
  };
  r.loss = train_step(w, optimizer, batch, so).loss;
  if (last) r.analysis = analyze_step(tracker, known, w.chain->size(), device);
}

}  // namespace

Report run_report(Workload& w, const ReportOptions& o) {
  check_report_options(w, o);
  const CudaPredictionOptions cuda_options = cuda_prediction_options_from_env();
  const MemoryDevice device = memory_device_of(o.step.device);
  auto tracker = std::make_shared<MemoryTracker>();
  TrackerScope scope(tracker);
  adopt_tensors(*tracker, w.chain->parameters());
  adopt_tensors(*tracker, w.chain->buffers());

  Report r;
  r.options = o;
  r.model = w.name;
  r.description = w.description;
  r.parameters = parameter_count(*w.chain);
  r.parameter_bytes = parameter_bytes(*w.chain);
  r.batch = o.step.batch;
  r.block_names = w.chain->block_names();
  for (int i = 0; i < w.chain->size(); ++i) r.block_recomputed.push_back(o.step.checkpoint.recomputes(i));
  auto optimizer = make_optimizer(o.step.optimizer, w.chain->parameters());
  RunTrace run;
  CudaPredictionOptions run_cuda_options = cuda_options;
  if (o.step.device.is_cuda()) {  // what the allocator holds already (the weights, cuBLAS's workspace)
    const CudaAllocatorCounters now = cuda_allocator_counters(o.step.device.has_index() ? o.step.device.index() : 0);
    run_cuda_options.reserved_at_start = now.reserved;
    run_cuda_options.allocated_at_start = now.allocated;
  }
  tracker->start_recording();  // from the first step: a CUDA allocator's cache carries over between steps
  for (int64_t step = 1; step <= o.steps; ++step) report_step(w, *optimizer, o, *tracker, step, r, run);
  append_recording(run.trace, *tracker);
  r.cuda = predict_cuda_reserved(run.trace, device, run_cuda_options, run.last_step_from);
  r.between_steps_bytes = tracker->current(device);
  for (int p = 0; p < kNumPhases; ++p) r.phase_peak[p] = tracker->phase_peak(static_cast<Phase>(p), device);
  // Per rank: the optimizer's state measured here, per parameter byte, over each rank's share.
  const double state_per_byte = r.parameter_bytes > 0 ? static_cast<double>(r.states.optimizer_state) /
                                                            static_cast<double>(r.parameter_bytes)
                                                      : 0.0;
  const std::vector<int> block_of_parameter = w.chain->parameter_blocks();
  std::vector<std::vector<at::Tensor>> blocks;
  for (int i = 0; i < w.chain->size(); ++i) blocks.push_back(w.chain->block_parameters(i, i));
  r.ranks = predicted_rank_states(w.chain->parameters(), o.world_size, o.zero_stage, state_per_byte, block_of_parameter);
  if (o.zero_stage == 3 && o.world_size > 1) {
    for (const auto& b : gathered_block_bytes(blocks, o.world_size)) {
      r.largest_gathered_block_bytes = std::max(r.largest_gathered_block_bytes, b.full);
    }
  }
  return r;
}

nlohmann::json report_json(const Report& r) {
  nlohmann::json j;
  j["model"] = r.model;
  j["description"] = r.description;
  j["parameters"] = r.parameters;
  j["parameter_bytes"] = r.parameter_bytes;
  j["batch"] = r.batch;
  j["config"] = step_config_json(r.options.step);
  j["mode"] = r.options.eval_only ? "eval" : "train";
  j["peak_bytes"] = r.analysis.peak_bytes;
  j["peak_phase"] = phase_name(r.analysis.peak_phase);
  j["at_peak"] = categories_json(r.analysis.at_peak);
  j["at_start"] = categories_json(r.analysis.at_start);
  j["states"] = {{"weights", r.states.weights},
                 {"buffers", r.states.buffers},
                 {"gradients", r.states.gradients},
                 {"optimizer_state", r.states.optimizer_state}};
  j["between_steps_bytes"] = r.between_steps_bytes;
  // Allocated vs reserved: memfit's CPU allocator caches nothing, so on CPU they are equal;
  // CUDA's caching allocator reserves more than it hands out (empty_cache() gives it back).
  nlohmann::json devices = {{"cpu", {{"allocated_bytes", r.between_steps_bytes}, {"reserved_bytes", r.between_steps_bytes}}}};
  if (cuda_available()) {
    const CudaAllocatorCounters m = cuda_allocator_counters(0);
    devices["cuda"] = {{"allocated_bytes", m.allocated},           {"reserved_bytes", m.reserved},
                       {"peak_allocated_bytes", m.peak_allocated}, {"peak_reserved_bytes", m.peak_reserved},
                       {"num_alloc_retries", m.num_alloc_retries}, {"num_ooms", m.num_ooms}};
  }
  j["device_memory"] = devices;
  // Predicted from the recorded run (on CUDA: from the allocator's own block sizes).
  j.update(cuda_prediction_json(r.cuda));
  nlohmann::json phases = nlohmann::json::object();
  for (Phase p : {Phase::kForward, Phase::kBackward, Phase::kRecompute, Phase::kOptimizer, Phase::kEval}) {
    if (r.phase_peak[static_cast<int>(p)] > 0) phases[phase_name(p)] = {{"peak_bytes", r.phase_peak[static_cast<int>(p)]}};
  }
  j["phases"] = phases;
  nlohmann::json blocks = nlohmann::json::array();
  for (size_t i = 0; i < r.block_names.size(); ++i) {
    blocks.push_back({{"name", r.block_names[i]},
                      {"activation_bytes", r.analysis.block_activation_bytes.at(i)},
                      {"recomputed", static_cast<bool>(r.block_recomputed[i])}});
  }
  j["blocks"] = blocks;
  j["loss"] = r.loss;
  j["world_size"] = r.options.world_size;
  j["zero_stage"] = r.options.zero_stage;
  j["ranks"] = ranks_json(r.ranks);  // predicted per rank (see ReportOptions)
  if (r.largest_gathered_block_bytes > 0) j["largest_gathered_block_bytes"] = r.largest_gathered_block_bytes;
  return j;
}

ReportDocument report_document(const Report& r) {
  ReportDocument d;
  d.title = "memfit report: " + r.description;
  d.device = r.options.step.device.str();
  d.step = r.analysis;
  d.block_names = r.block_names;
  d.block_recomputed = r.block_recomputed;
  d.ranks = r.ranks;
  d.zero_stage = r.options.zero_stage;
  d.largest_gathered_block_bytes = r.largest_gathered_block_bytes;
  d.cuda_reserved = r.cuda;
  return d;
}

}  // namespace memfit
