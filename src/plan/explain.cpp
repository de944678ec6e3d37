#include "plan/explain.h"

#include <cstdio>
#include <string>

#include "memfit/measure/size.h"

namespace memfit {

void explain_choice(Plan& p, const std::vector<Plan>& best_of, const WorkloadProfile& profile) {
  // Say plainly why this precision, when there was a choice.
  const char* chosen = precision_name(p.config.precision);
  char buf[224];
  for (const auto& b : best_of) {
    if (b.config.precision == p.config.precision) continue;
    const char* name = precision_name(b.config.precision);
    if (!b.feasible) {
      std::snprintf(buf, sizeof buf, "%s considered: no %s plan fits", name, name);
    } else {
      const bool guessed = precision_profile(profile, b.config.precision).chain_seconds.empty();
      std::snprintf(buf, sizeof buf, "%s: its best plan is predicted %.2fx the time of the %s plan chosen%s", name,
                    b.predicted_seconds / p.predicted_seconds, chosen,
                    guessed ? " (guessed from its blocks: not close enough to be timed)" : "");
    }
    p.notes.push_back(buf);
  }
  if (best_of.size() > 1 && p.config.precision != p.baseline_precision) {
    p.notes.push_back(std::string("precision ") + chosen +
                      " chosen: mixed precision measured faster on this device (`precision` fp32 forbids it)");
  }
}

void explain_state_choice(Plan& p, const std::vector<Plan>& best_with, int64_t budget, const StepCosts& costs) {
  const auto candidates = costs.optimizer_candidates(p.config.offload.optimizer);
  if (candidates.size() < 2) return;
  const OptimizerCost& chosen = costs.optimizer_cost(p.config.optimizer.state, p.config.offload.optimizer);
  const OptimizerCost& base = *candidates.front();
  const std::string state = state_precision_name(chosen.state), base_name = state_precision_name(base.state);
  const std::string bytes = " (state " + format_bytes(chosen.state_bytes) + " vs " + format_bytes(base.state_bytes) + ")";
  if (&chosen == &base) {
    for (size_t i = 1; i < candidates.size(); ++i) {
      const Plan& b = best_with[i];
      const std::string name = state_precision_name(candidates[i]->state);
      char buf[200];
      std::snprintf(buf, sizeof buf, "optimizer state %s kept: %s state's best plan is predicted %.2fx the time", state.c_str(),
                    name.c_str(), b.predicted_seconds / p.predicted_seconds);
      p.notes.push_back(b.feasible ? buf : "optimizer state " + state + " kept: no " + name + " plan fits either");
    }
    return;
  }
  if (!best_with.front().feasible) {
    p.notes.push_back("optimizer state " + state + " chosen: no plan with " + base_name + " state fits " + format_bytes(budget) + bytes);
    return;
  }
  char buf[200];
  std::snprintf(buf, sizeof buf, "optimizer state %s chosen: its best plan is predicted %.2fx the time of %s state's, optimizer step included",
                state.c_str(), p.predicted_seconds / best_with.front().predicted_seconds, base_name.c_str());
  p.notes.push_back(buf + bytes + " (`optimizer.state` fp32 forbids it)");
}

void explain_placement(Plan& p, const std::vector<Plan>& best_placed, const PlanRequest& request) {
  if (best_placed.size() < 2) return;
  const Plan& other = best_placed[p.config.offload.optimizer == request.optimizer_offload.front() ? 1 : 0];
  const std::string host = format_bytes(p.predicted_host_peak) + " on the host";
  if (!p.config.offload.optimizer) {
    char buf[160];
    std::snprintf(buf, sizeof buf, "optimizer kept on the device: offloaded, its best plan is predicted %.2fx the time",
                  other.predicted_seconds / p.predicted_seconds);
    p.notes.push_back(other.feasible ? buf : "optimizer kept on the device: no plan offloading it fits either");
    return;
  }
  const bool copies = request.host_copy_bytes_per_second > 0;
  std::string why = other.feasible ? "its best plan is predicted faster" : "no plan with it on the device fits";
  p.notes.push_back("optimizer offloaded to the host (" + host + "): " + why +
                    (copies ? "" : "; copy time not counted"));
}

void explain_offload_and_prefetch(Plan& p, const PlanRequest& request) {
  if (!p.config.offload.activation_blocks.empty()) {
    char buf[200];
    std::snprintf(buf, sizeof buf, "; copies modelled at %.2f GB/s each way", request.host_copy_bytes_per_second / 1e9);
    p.notes.push_back("activations of " + std::to_string(p.config.offload.activation_blocks.size()) +
                      " blocks offloaded to the host: copying them there and back is predicted faster than recomputing"
                      " them or a smaller micro-batch" + (request.host_copy_bytes_per_second > 0 ? buf : ""));
  }
  if (request.prefetch_depths.size() > 1 && p.config.prefetch_depth != request.prefetch_depths.front()) {
    p.notes.push_back("prefetch depth " + std::to_string(p.config.prefetch_depth) + ": deeper does not fit at micro-batch " +
                      std::to_string(p.config.micro_batch_size()));
  }
}

void explain_nothing_fits(Plan& p, int64_t budget, const PlanRequest& request, const StepCosts& costs) {
  p.notes.push_back("no plan fits " + format_bytes(budget) + ": the smallest budget that works is " +
                    format_bytes(p.floor_bytes) + " (" + std::to_string(p.floor_bytes) + " bytes)");
  if (request.host_budget_bytes > 0 && costs.smallest_host_bytes() > request.host_budget_bytes) {
    p.notes.push_back("the host budget " + format_bytes(request.host_budget_bytes) +
                      " is below what offloading the optimizer needs there: " + format_bytes(costs.smallest_host_bytes()) +
                      " (" + std::to_string(costs.smallest_host_bytes()) + " bytes)");
  }
}

}  // namespace memfit
