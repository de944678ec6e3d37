#include "plan_output.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <cmath>

namespace memfit::cli {

std::string bytes_cell(int64_t b) { return fmt::format("{:>10}  {:>12} B", format_bytes(b), b); }

namespace {

void print_configuration(const Plan& plan, const std::vector<std::string>& block_names) {
  const StepConfig& c = plan.config;
  std::vector<std::string> names;
  for (int b : c.checkpoint.recomputed_blocks()) names.push_back(block_names.at(static_cast<size_t>(b)));
  fmt::print("  {:<28}{} x {}\n", "micro-batch x accumulation", c.micro_batch_size(), c.accumulation());
  fmt::print("  {:<28}{}\n", "precision", precision_name(c.precision));
  fmt::print("  {:<28}{}{}{}\n", "blocks recomputed", c.checkpoint.describe(),
             names.empty() ? "" : " (" + fmt::format("{}", fmt::join(names, " ")) + ")",
             plan.checkpoint_pinned ? " (pinned)" : "");
  fmt::print("  {:<28}{}\n", "optimizer", c.optimizer.describe());
  if (c.offload.any()) fmt::print("  {:<28}{}\n", "offloaded to the host", c.offload.describe());
  if (c.prefetch_depth > 0) {
    fmt::print("  {:<28}{} block{} ahead, gradients reduced during the next block's backward\n", "gathered (ZeRO 3)",
               c.prefetch_depth, c.prefetch_depth == 1 ? "" : "s");
  }
}

// The verified steps on a CUDA device: reserved bytes predicted by the allocator model and, on
// CUDA, measured by the allocator under the budget's fraction.
void print_cuda_verification(const Verification& v) {
  if (v.cuda.valid) {
    fmt::print("  {:<28}{}  (LibTorch {} caching allocator{})\n", "reserved on CUDA, predicted",
               bytes_cell(v.cuda.peak_reserved), cuda_allocator_rules_name(v.cuda.rules),
               v.cuda.conf_text.empty() ? "" : ", " + v.cuda.conf_text);
  }
  if (v.on_cuda) {
    fmt::print("  {:<28}{}  (max_memory_reserved; {} retries, {} out of memory)\n", "reserved on CUDA, measured",
               bytes_cell(v.cuda_measured.peak_reserved), v.cuda_measured.num_alloc_retries, v.cuda_measured.num_ooms);
  }
}

void print_predictions(const Plan& plan, const Verification* v) {
  const double plain = std::max(1e-12, plan.plain_predicted_seconds);
  fmt::print("  {:<28}{}\n", "predicted peak", bytes_cell(plan.predicted_peak));
  if (plan.reserved.checked()) {
    const ReservedCheck& r = plan.reserved;
    fmt::print("  {:<28}{}  (its {} steps replayed on the caching allocator: cap {}, margin {}, {} retries)\n",
               "reserved on CUDA, checked", bytes_cell(r.peak_reserved), r.steps, format_bytes(r.cap_bytes),
               format_bytes(r.margin_bytes), r.num_alloc_retries);
  }
  if (plan.config.offload.any()) fmt::print("  {:<28}{}\n", "predicted host peak", bytes_cell(plan.predicted_host_peak));
  if (v == nullptr) {
    fmt::print("  {:<28}{:.2f}x predicted\n", "step time vs plain step", plan.predicted_seconds / plain);
    return;
  }
  fmt::print("  {:<28}{}  ({:+.1f}% vs predicted)\n", "measured peak", bytes_cell(v->measured_peak),
             100.0 * static_cast<double>(plan.predicted_peak - v->measured_peak) /
                 static_cast<double>(std::max<int64_t>(1, v->measured_peak)));
  fmt::print("  {:<28}{:.2f}x predicted, {:.2f}x measured\n", "step time vs plain step", plan.predicted_seconds / plain,
             v->measured_seconds / std::max(1e-12, v->plain_seconds));
  print_cuda_verification(*v);
}

}  // namespace

void print_plan(const Plan& plan, const std::vector<std::string>& block_names, const Verification* verified,
                const std::string& planning) {
  fmt::print("Plan for a budget of {} ({} bytes; {:g}% kept free), batch {}:\n", format_bytes(plan.budget_bytes),
             plan.budget_bytes, std::round(plan.margin * 1000) / 10, plan.config.batch);
  if (plan.feasible) {
    print_configuration(plan, block_names);
    print_predictions(plan, verified);
  }
  fmt::print("  {:<28}{}\n", "plain step, predicted peak", bytes_cell(plan.plain_predicted_peak));
  fmt::print("  {:<28}{}\n", "smallest budget (floor)", bytes_cell(plan.floor_bytes));
  if (!planning.empty()) fmt::print("  {}\n", planning);
  for (const auto& n : plan.notes) fmt::print("  note: {}\n", in_flag_terms(n));
  if (verified != nullptr) {
    for (const auto& n : verified->notes) fmt::print("  note: {}\n", in_flag_terms(n));
  }
}

}  // namespace memfit::cli
