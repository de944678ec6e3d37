#include "memfit/plan/plan_ask.h"

#include <algorithm>

#include "memfit/errors.h"
#include "memfit/measure/size.h"
#include "memfit/plan/job.h"

namespace memfit {
namespace {

std::string joined(const std::vector<std::string>& items, const char* separator) {
  std::string out;
  for (const auto& item : items) out += (out.empty() ? "" : separator) + item;
  return out;
}

// The precisions asked for that this device runs, each once, the first named first; the others
// left out with a note.
std::vector<Precision> runnable_precisions(const PlanAsk& ask, std::vector<std::string>& notes) {
  const c10::DeviceType device = ask.step.device.type();
  std::vector<Precision> out;
  const auto add = [&out](Precision p) {
    if (std::find(out.begin(), out.end(), p) == out.end()) out.push_back(p);
  };
  for (const std::string& name : ask.precisions) {
    if (name == "auto") {
      for (Precision p : precision_candidates("auto", device)) add(p);
      continue;
    }
    const Precision p = parse_precision(name);  // an OptionError naming it, where it is none
    std::string why;
    if (precision_supported(p, device, &why)) {
      add(p);
    } else {
      notes.push_back(name + " not considered: " + why);
    }
  }
  return out;
}

// fp16's loss scaler unscales the gradients on the device: where the optimizer may be offloaded
// they are on the host, so fp16 is left out.
void leave_out_fp16_if_offloaded(const PlanRequest& request, std::vector<Precision>& precisions,
                                 std::vector<std::string>& notes) {
  const bool offloaded = std::find(request.optimizer_offload.begin(), request.optimizer_offload.end(), true) !=
                         request.optimizer_offload.end();
  const auto fp16 = std::find(precisions.begin(), precisions.end(), Precision::kFP16);
  if (!offloaded || fp16 == precisions.end()) return;
  precisions.erase(fp16);
  notes.push_back("fp16 not considered: its loss scaler needs the gradients on the device, `offload` puts them on the host");
}

void check_ask(const PlanAsk& ask) {
  check_option(ask.budget_bytes >= 0, "budget", ask.budget_bytes, "expected a positive number of bytes");
  check_option(ask.margin >= 0 && ask.margin <= 0.5, "margin", number_text(ask.margin),
               "expected a fraction of the budget from 0 to 0.5");
  check_option(ask.host_budget_bytes >= 0, "host_budget", ask.host_budget_bytes, "expected bytes >= 0 (0: unlimited)");
  check_option(ask.step.micro_batch >= 0 && ask.step.micro_batch <= ask.step.batch, "micro_batch", ask.step.micro_batch,
               "expected 0 (planned) or 1 to the batch's " + std::to_string(ask.step.batch) + " samples");
  check_option(!ask.precisions.empty(), "precision", "(none)", "expected fp32, bf16, fp16 or auto");
}

// What may go to the host: `offload` as asked, where the front's autograd can move activations.
void place_offload(const PlanAsk& ask, PlanRequest& request) {
  const OffloadMode mode = parse_offload_mode(ask.offload);
  if (!ask.activations_movable) {
    check_option(mode == OffloadMode::kNone || mode == OffloadMode::kOptimizer || mode == OffloadMode::kAuto, "offload",
                 "'" + ask.offload + "'", "expected none, optimizer or auto (saved activations stay on the device here)");
  }
  request_offload(request, mode, ask.host_budget_bytes);
  if (!ask.activations_movable) request.activation_offload = false;
}

}  // namespace

PlanSetup set_up_plan(const PlanAsk& ask) {
  check_ask(ask);
  PlanSetup setup;
  PlanRequest& r = setup.request;
  r.budget_bytes = ask.budget_bytes;
  r.step = ask.step;
  r.checkpoint = ask.checkpoint;
  r.margin = ask.margin;
  r.resident_bytes = ask.resident_bytes;
  r.outside_bytes = ask.outside_bytes;
  place_offload(ask, r);
  setup.precisions = runnable_precisions(ask, setup.notes);
  leave_out_fp16_if_offloaded(r, setup.precisions, setup.notes);
  check_option(!setup.precisions.empty(), "precision", joined(ask.precisions, ","),
               "none of them runs here (" + joined(setup.notes, "; ") + ")");
  return setup;
}

std::string below_floor_text(const Planner& planner, int64_t budget_bytes) {
  const auto bytes = [](int64_t n) { return format_bytes(n) + " (" + std::to_string(n) + " bytes)"; };
  const int64_t floor = planner.floor_bytes();
  std::string text = "budget " + bytes(budget_bytes) + " is below what any plan needs: the smallest budget that works is " +
                     bytes(floor);
  const auto& placements = planner.request().optimizer_offload;
  if (std::find(placements.begin(), placements.end(), true) == placements.end()) {
    PlanRequest offloaded = planner.request();
    offloaded.optimizer_offload = {true};
    const int64_t lower = Planner(planner.profile(), offloaded).floor_bytes();
    if (lower < floor) text += "; with `offload` optimizer, " + bytes(lower);
  }
  return text;
}

}  // namespace memfit
