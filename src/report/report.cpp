#include "memfit/report/report.h"

#include <torch/torch.h>

#include "memfit/errors.h"
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

// One step of the report: a training step (or an evaluation pass), the last one recorded
// and analysed into `r`.
void report_step(Workload& w, torch::optim::Optimizer& optimizer, const ReportOptions& o, MemoryTracker& tracker,
                 int64_t step, Report& r) {
  const bool last = step == o.steps;
  const auto params = w.chain->parameters();
  Batch batch;
  {
    PhaseGuard data(Phase::kData);
    batch = (o.eval_only ? w.data->eval_batch(step - 1, o.step.batch) : w.data->train_batch(step - 1, o.step.batch, w.seed))
                .to(o.step.device);
  }
  if (last) {
    tracker.reset_peak();
    tracker.start_recording();
  }
  if (o.eval_only) {
    r.loss = eval_loss(w, batch, o.step.precision);
    if (!last) return;
    tracker.stop_recording();
    r.analysis = analyze_step(tracker, known_storage(params, optimizer_state_tensors(optimizer), w.chain->buffers()), w.chain->size());
    return;
  }
  KnownStorage known;
  StepOptions so{o.step};
  so.after_optimizer = [&] {
    if (!last) return;
    tracker.stop_recording();
    known = known_storage(params, optimizer_state_tensors(optimizer), w.chain->buffers());
    r.states = classify_live(tracker, known);
  };
  r.loss = train_step(w, optimizer, batch, so).loss;
  if (last) r.analysis = analyze_step(tracker, known, w.chain->size());
}

}  // namespace

Report run_report(Workload& w, const ReportOptions& o) {
  check_report_options(w, o);
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
  for (int i = 0; i < w.chain->size(); ++i) {
    r.block_names.push_back(w.chain->block(i).name);
    r.block_recomputed.push_back(o.step.checkpoint.recomputes(i));
  }
  auto optimizer = make_optimizer(o.step.optimizer, w.chain->parameters());
  for (int64_t step = 1; step <= o.steps; ++step) report_step(w, *optimizer, o, *tracker, step, r);
  r.between_steps_bytes = tracker->current();
  for (int p = 0; p < kNumPhases; ++p) r.phase_peak[p] = tracker->phase_peak(static_cast<Phase>(p));
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

namespace {

nlohmann::json categories_json(const Categories& c) {
  return {{"weights", c.weights},         {"buffers", c.buffers},             {"gradients", c.gradients},
          {"optimizer_state", c.optimizer_state}, {"activations", c.activations},
          {"other", c.other},             {"autocast_cache", c.autocast_cache}};
}

}  // namespace

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
    const DeviceMemory m = cuda_memory(0);
    devices["cuda"] = {{"allocated_bytes", m.allocated}, {"reserved_bytes", m.reserved}, {"peak_allocated_bytes", m.peak_allocated}};
  }
  j["device_memory"] = devices;
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

nlohmann::json ranks_json(const std::vector<RankStateBytes>& ranks) {
  nlohmann::json a = nlohmann::json::array();
  for (size_t r = 0; r < ranks.size(); ++r) {
    a.push_back({{"rank", static_cast<int>(r)}, {"weights", ranks[r].weights}, {"gradients", ranks[r].gradients},
                 {"optimizer_state", ranks[r].optimizer_state}});
  }
  return a;
}

nlohmann::json step_chart_document(const std::string& title, const std::string& device, const StepAnalysis& a,
                                   const std::vector<std::string>& block_names, const std::vector<bool>& recomputed) {
  nlohmann::json d;
  d["title"] = title;
  d["device"] = device;
  d["budget_bytes"] = nullptr;
  d["peak_bytes"] = a.peak_bytes;
  d["peak_time_us"] = a.peak_t_ns / 1000;
  // Buffers get a band only where the model has some (BatchNorm's statistics), not a 0 B legend.
  const bool has_buffers = a.at_start.buffers > 0 || a.at_peak.buffers > 0;
  d["categories"] = has_buffers ? nlohmann::json{"weights", "buffers", "gradients", "optimizer_state", "activations", "other"}
                                : nlohmann::json{"weights", "gradients", "optimizer_state", "activations", "other"};
  d["at_peak"] = categories_json(a.at_peak);
  nlohmann::json timeline = nlohmann::json::array();
  for (const auto& p : a.timeline) {
    timeline.push_back({{"t_us", p.t_ns / 1000},
                        {"phase", phase_name(p.phase)},
                        {"weights", p.live.weights},
                        {"buffers", p.live.buffers},
                        {"gradients", p.live.gradients},
                        {"optimizer_state", p.live.optimizer_state},
                        {"activations", p.live.activations},
                        {"other", p.live.other}});
  }
  d["timeline"] = timeline;
  nlohmann::json phases = nlohmann::json::array();
  for (const auto& s : a.phases) {
    phases.push_back({{"name", phase_name(s.phase)}, {"start_us", s.start_ns / 1000},
                      {"end_us", s.end_ns / 1000}, {"peak_bytes", s.peak_bytes}});
  }
  d["phases"] = phases;
  nlohmann::json blocks = nlohmann::json::array();
  for (size_t i = 0; i < block_names.size(); ++i) {
    blocks.push_back({{"name", block_names[i]},
                      {"activation_bytes", a.block_activation_bytes.at(i)},
                      {"recomputed", static_cast<bool>(recomputed.at(i))}});
  }
  d["blocks"] = blocks;
  return d;
}

nlohmann::json report_chart_document(const Report& r) {
  nlohmann::json d = step_chart_document("memfit report: " + r.description, r.options.step.device.str(), r.analysis, r.block_names, r.block_recomputed);
  if (r.ranks.size() > 1) {
    d["ranks"] = ranks_json(r.ranks);
    d["zero_stage"] = r.options.zero_stage;
    if (r.largest_gathered_block_bytes > 0) d["largest_gathered_block_bytes"] = r.largest_gathered_block_bytes;
  }
  return d;
}

}  // namespace memfit
