#include "memfit/plan/plan.h"

#include <stdexcept>

#include "runtime/json_fields.h"

namespace memfit {

nlohmann::json plan_json(const Plan& p) {
  const double plain = p.plain_predicted_seconds > 0 ? p.plain_predicted_seconds : 1;
  nlohmann::json j = {{"budget_bytes", p.budget_bytes},
          {"margin", p.margin},
          {"feasible", p.feasible},
          {"floor_bytes", p.floor_bytes},
          {"config", p.feasible ? step_config_json(p.config) : nlohmann::json(nullptr)},
          {"checkpoint_pinned", p.checkpoint_pinned},
          {"predicted", {{"peak_bytes", p.predicted_peak}, {"host_peak_bytes", p.predicted_host_peak},
                         {"seconds", p.predicted_seconds},
                         {"step_time_ratio", p.predicted_seconds / plain}}},
          {"plain", {{"precision", precision_name(p.baseline_precision)},
                     {"predicted_peak_bytes", p.plain_predicted_peak},
                     {"predicted_seconds", p.plain_predicted_seconds}}},
          {"notes", p.notes}};
  if (p.reserved.checked()) j["reserved"] = reserved_check_json(p.reserved);
  return j;
}

Plan plan_from_json(const nlohmann::json& j, int blocks) {
  namespace jf = json_fields;
  Plan p;
  p.budget_bytes = jf::integer(j, "budget_bytes");
  p.margin = jf::number(j, "margin");
  p.feasible = jf::boolean(j, "feasible");
  p.floor_bytes = jf::integer(j, "floor_bytes");
  if (p.feasible) p.config = step_config_from_json(jf::field(j, "config"), blocks);
  p.checkpoint_pinned = jf::boolean(j, "checkpoint_pinned");
  const auto& predicted = jf::field(j, "predicted");
  p.predicted_peak = jf::integer(predicted, "peak_bytes");
  // Absent in what earlier versions wrote: nothing was offloaded.
  if (predicted.contains("host_peak_bytes")) p.predicted_host_peak = jf::integer(predicted, "host_peak_bytes");
  p.predicted_seconds = jf::number(predicted, "seconds");
  const auto& plain = jf::field(j, "plain");
  p.baseline_precision = parse_precision(jf::text(plain, "precision"));
  p.plain_predicted_peak = jf::integer(plain, "predicted_peak_bytes");
  p.plain_predicted_seconds = jf::number(plain, "predicted_seconds");
  if (j.contains("reserved")) p.reserved = reserved_check_from_json(j.at("reserved"));
  for (const auto& note : jf::array(j, "notes")) {
    if (!note.is_string()) jf::refuse("notes", note, "expected strings");
    p.notes.push_back(note.get<std::string>());
  }
  return p;
}

}  // namespace memfit
