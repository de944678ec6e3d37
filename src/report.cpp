#include "memfit/report.h"

#include <torch/torch.h>

#include "memfit/cache.h"
#include "memfit/evaluation.h"
#include "memfit/grads.h"

namespace memfit {

Report run_report(const ReportOptions& o) {
  auto tracker = std::make_shared<MemoryTracker>();
  TrackerScope scope(tracker);

  Report r;
  r.options = o;
  Workload w = make_workload(o.model);
  r.model = w.model_name;
  r.description = w.description;
  r.parameters = parameter_count(*w.chain);
  for (const auto& p : w.chain->parameters()) r.parameter_bytes += p.storage().nbytes();
  r.batch = o.batch;
  for (int i = 0; i < w.chain->size(); ++i) {
    r.block_names.push_back(w.chain->block(i).name);
    r.block_recomputed.push_back(o.step.checkpoint.recomputes(i));
  }
  if (o.batch < 1) throw std::invalid_argument("invalid --batch " + std::to_string(o.batch) + ": expected >= 1");
  if (o.world_size > o.batch) {
    throw std::invalid_argument("invalid --world-size " + std::to_string(o.world_size) + ": each rank needs at least one of the " +
                                std::to_string(o.batch) + " samples of --batch");
  }
  r.ranks = predicted_rank_states(w.chain->parameters(), o.world_size, o.zero_stage);  // checks both
  if (o.steps < 1) throw std::invalid_argument("invalid --steps " + std::to_string(o.steps) + ": expected >= 1");
  if (o.step.micro_batch > o.batch) {
    throw std::invalid_argument("invalid --micro-batch " + std::to_string(o.step.micro_batch) +
                                ": larger than --batch " + std::to_string(o.batch));
  }

  torch::optim::AdamW optimizer(w.chain->parameters(), torch::optim::AdamWOptions(o.learning_rate));
  for (int64_t step = 1; step <= o.steps; ++step) {
    const bool last = step == o.steps;
    Batch batch;
    {
      PhaseGuard data(Phase::kData);
      batch = o.eval_only ? w.data->eval_batch(step - 1, o.batch) : w.data->train_batch(step - 1, o.batch, o.model.seed);
    }
    if (last) {
      tracker->reset_peak();
      tracker->start_recording();
    }
    if (o.eval_only) {
      r.loss = eval_loss(w, batch, o.step.precision);
      if (last) {
        tracker->stop_recording();
        r.analysis = analyze_step(*tracker, known_storage(w.chain->parameters(), &optimizer), w.chain->size());
      }
    } else {
      KnownStorage known;
      StepOptions so = o.step;
      so.after_optimizer = [&] {
        if (!last) return;
        tracker->stop_recording();
        known = known_storage(w.chain->parameters(), &optimizer);
        r.states = classify_live(*tracker, known);
      };
      r.loss = train_step(w, optimizer, batch, so).loss;
      if (last) r.analysis = analyze_step(*tracker, known, w.chain->size());
    }
    batch = Batch{};
    if (last) {
      r.between_steps_bytes = tracker->current();
      for (int p = 0; p < kNumPhases; ++p) r.phase_peak[p] = tracker->phase_peak(static_cast<Phase>(p));
    }
  }
  return r;
}

namespace {

nlohmann::json categories_json(const Categories& c) {
  return {{"weights", c.weights},         {"gradients", c.gradients},
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
  j["micro_batch"] = r.options.step.micro_batch > 0 ? r.options.step.micro_batch : r.batch;
  j["precision"] = precision_name(r.options.step.precision);
  j["checkpoint"] = r.options.step.checkpoint.recomputed_blocks();
  j["set_to_none"] = r.options.step.set_to_none;
  j["mode"] = r.options.eval_only ? "eval" : "train";
  j["peak_bytes"] = r.analysis.peak_bytes;
  j["peak_phase"] = phase_name(r.analysis.peak_phase);
  j["at_peak"] = categories_json(r.analysis.at_peak);
  j["at_start"] = categories_json(r.analysis.at_start);
  j["states"] = {{"weights", r.states.weights},
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

nlohmann::json step_chart_document(const std::string& title, const StepAnalysis& a,
                                   const std::vector<std::string>& block_names, const std::vector<bool>& recomputed) {
  nlohmann::json d;
  d["title"] = title;
  d["device"] = "cpu";
  d["budget_bytes"] = nullptr;
  d["peak_bytes"] = a.peak_bytes;
  d["peak_time_us"] = a.peak_t_ns / 1000;
  d["categories"] = {"weights", "gradients", "optimizer_state", "activations", "other"};
  d["at_peak"] = categories_json(a.at_peak);
  nlohmann::json timeline = nlohmann::json::array();
  for (const auto& p : a.timeline) {
    timeline.push_back({{"t_us", p.t_ns / 1000},
                        {"phase", phase_name(p.phase)},
                        {"weights", p.live.weights},
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
  nlohmann::json d = step_chart_document("memfit report: " + r.description, r.analysis, r.block_names, r.block_recomputed);
  if (r.ranks.size() > 1) {
    d["ranks"] = ranks_json(r.ranks);
    d["zero_stage"] = r.options.zero_stage;
  }
  return d;
}

}  // namespace memfit
