#include "memfit/report/document.h"

namespace memfit {
namespace {

nlohmann::json timeline_json(const StepAnalysis& a) {
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
  return timeline;
}

void add_step(nlohmann::json& d, const StepAnalysis& a) {
  d["peak_bytes"] = a.peak_bytes;
  d["peak_time_us"] = a.peak_t_ns / 1000;
  // Buffers get a band only where the model has some (BatchNorm's statistics), not a 0 B legend.
  const bool has_buffers = a.at_start.buffers > 0 || a.at_peak.buffers > 0;
  d["categories"] = has_buffers ? nlohmann::json{"weights", "buffers", "gradients", "optimizer_state", "activations", "other"}
                                : nlohmann::json{"weights", "gradients", "optimizer_state", "activations", "other"};
  d["at_peak"] = categories_json(a.at_peak);
  d["timeline"] = timeline_json(a);
  nlohmann::json phases = nlohmann::json::array();
  for (const auto& s : a.phases) {
    phases.push_back({{"name", phase_name(s.phase)}, {"start_us", s.start_ns / 1000},
                      {"end_us", s.end_ns / 1000}, {"peak_bytes", s.peak_bytes}});
  }
  d["phases"] = phases;
}

nlohmann::json blocks_json(const ReportDocument& r) {
  nlohmann::json blocks = nlohmann::json::array();
  for (size_t i = 0; i < r.block_names.size(); ++i) {
    blocks.push_back({{"name", r.block_names[i]},
                      {"activation_bytes", r.step->block_activation_bytes.at(i)},
                      {"recomputed", static_cast<bool>(r.block_recomputed.at(i))}});
  }
  return blocks;
}

// Each timeline point's predicted reserved bytes ("cuda_reserved") and the series' legend
// ("reserved_series": {key, label, peak_bytes}); nothing where the series does not line up.
void add_reserved_series(nlohmann::json& d, const CudaReservedPrediction& p) {
  nlohmann::json& timeline = d["timeline"];
  if (!p.valid || p.reserved_series.size() != timeline.size()) return;
  for (size_t i = 0; i < timeline.size(); ++i) timeline[i]["cuda_reserved"] = p.reserved_series[i];
  d["reserved_series"] = {{"key", "cuda_reserved"},
                          {"label", std::string("CUDA reserved (predicted, LibTorch ") + cuda_allocator_rules_name(p.rules) +
                                        " rules)"},
                          {"peak_bytes", p.peak_reserved}};
}

nlohmann::json steps_json(const std::vector<StepPoint>& steps) {
  nlohmann::json out = nlohmann::json::array();
  for (const auto& p : steps) {
    nlohmann::json j{{"step", p.step}, {"loss", p.loss}, {"live_bytes", p.live_bytes}, {"peak_bytes", p.peak_bytes}};
    if (p.eval_loss) j["eval_loss"] = *p.eval_loss;
    out.push_back(j);
  }
  return out;
}

}  // namespace

nlohmann::json ReportDocument::to_json() const {
  nlohmann::json d;
  d["title"] = title;
  d["device"] = device;
  d["budget_bytes"] = budget_bytes ? nlohmann::json(*budget_bytes) : nlohmann::json(nullptr);
  if (step) {
    add_step(d, *step);
    d["blocks"] = blocks_json(*this);
    add_reserved_series(d, cuda_reserved);
  }
  if (!plan_rows.empty()) {
    nlohmann::json rows = nlohmann::json::array();
    for (const auto& [label, value] : plan_rows) rows.push_back({label, value});
    d["plan"] = {{"rows", rows}};
    if (plan_config) d["plan"]["config"] = step_config_json(*plan_config);
  }
  if (ranks.size() > 1) {
    d["ranks"] = ranks_json(ranks);
    d["zero_stage"] = zero_stage;
    if (largest_gathered_block_bytes > 0) d["largest_gathered_block_bytes"] = largest_gathered_block_bytes;
  }
  if (!steps.empty()) d["steps"] = steps_json(steps);
  return d;
}

}  // namespace memfit
