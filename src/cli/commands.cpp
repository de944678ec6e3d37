#include "commands.h"

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <iostream>
#include <sstream>

namespace memfit::cli {
namespace {

std::string bytes_cell(int64_t b) { return fmt::format("{:>10}  {:>12} B", format_bytes(b), b); }

void print_report_peak(const Report& r) {
  const auto& a = r.analysis;
  fmt::print("{}\n", r.description);
  const StepConfig& c = r.options.step;
  fmt::print("{} parameters ({}), batch {}, micro-batch {}, precision {}, checkpoint {}, gradients {}\n",
             r.parameters, format_bytes(r.parameter_bytes), r.batch, c.micro_batch_size(), precision_name(c.precision),
             c.checkpoint.describe(), c.set_to_none ? "released after the step" : "kept (zeroed)");
  fmt::print("{}, {}\n\n", c.optimizer.describe(), c.device.str());
  fmt::print("Peak of the last {} step: {} ({} bytes), during {}\n",
             r.options.eval_only ? "eval" : "training", format_bytes(a.peak_bytes), a.peak_bytes,
             phase_name(a.peak_phase));
  const auto& p = a.at_peak;
  auto share = [&](int64_t v) { return a.peak_bytes ? 100.0 * static_cast<double>(v) / static_cast<double>(a.peak_bytes) : 0.0; };
  fmt::print("  {:<18}{}  {:5.1f}%\n", "weights", bytes_cell(p.weights), share(p.weights));
  if (p.buffers > 0) fmt::print("  {:<18}{}  {:5.1f}%\n", "buffers", bytes_cell(p.buffers), share(p.buffers));
  fmt::print("  {:<18}{}  {:5.1f}%\n", "gradients", bytes_cell(p.gradients), share(p.gradients));
  fmt::print("  {:<18}{}  {:5.1f}%\n", "optimizer state", bytes_cell(p.optimizer_state), share(p.optimizer_state));
  fmt::print("  {:<18}{}  {:5.1f}%\n", "activations", bytes_cell(p.activations), share(p.activations));
  fmt::print("  {:<18}{}  {:5.1f}%\n", "other", bytes_cell(p.other), share(p.other));
  if (p.autocast_cache > 0) fmt::print("    of which autocast weight casts {}\n", bytes_cell(p.autocast_cache));
}

void print_report_states(const Report& r) {
  const auto& a = r.analysis;
  if (!r.options.eval_only) {
    fmt::print("\nAfter backward + optimizer step:\n");
    fmt::print("  {:<18}{}\n", "weights", bytes_cell(r.states.weights));
    if (r.states.buffers > 0) fmt::print("  {:<18}{}\n", "buffers", bytes_cell(r.states.buffers));
    fmt::print("  {:<18}{}\n  {:<18}{}\n", "gradients", bytes_cell(r.states.gradients), "optimizer state",
               bytes_cell(r.states.optimizer_state));
    fmt::print("Live between steps: {}  (reserved on CPU: the same; memfit's allocator keeps no cache)\n",
               bytes_cell(r.between_steps_bytes));
    if (cuda_available()) {
      const DeviceMemory m = cuda_memory(0);
      fmt::print("CUDA: allocated {}, reserved {}\n", bytes_cell(m.allocated), bytes_cell(m.reserved));
    }
  }
  fmt::print("\nPeak per phase:\n");
  for (Phase ph : {Phase::kForward, Phase::kBackward, Phase::kRecompute, Phase::kOptimizer, Phase::kEval}) {
    const int64_t v = r.phase_peak[static_cast<int>(ph)];
    if (v > 0) fmt::print("  {:<18}{}\n", phase_name(ph), bytes_cell(v));
  }
  if (r.ranks.size() > 1) {
    fmt::print("\nState per rank, {} ranks at ZeRO stage {} (predicted from the parameter partition memfit train uses):\n",
               r.ranks.size(), r.options.zero_stage);
    for (size_t i = 0; i < r.ranks.size(); ++i) {
      const auto& s = r.ranks[i];
      fmt::print("  rank {:<3} weights {}  gradients {}  optimizer state {}\n", i, bytes_cell(s.weights),
                 bytes_cell(s.gradients), bytes_cell(s.optimizer_state));
    }
    if (r.largest_gathered_block_bytes > 0) {
      fmt::print("  + the largest block gathered in full while it runs: weights {} (and its gradients until reduced)\n",
                 bytes_cell(r.largest_gathered_block_bytes));
    }
  }
  fmt::print("\nActivations each block keeps for backward (end of forward):\n");
  for (size_t i = 0; i < r.block_names.size(); ++i) {
    fmt::print("  {:>3} {:<10}{}{}\n", i, r.block_names[i], bytes_cell(a.block_activation_bytes.at(i)),
               r.block_recomputed[i] ? "  (recomputed)" : "");
  }
}


void print_plan_table(const Workload& w, const Plan& plan, const Verification* v, const nlohmann::json& j) {
  fmt::print("{}\n", w.description);
  fmt::print("Plan for a budget of {} ({} bytes; 3% kept free), batch {}:\n", format_bytes(plan.budget_bytes),
             plan.budget_bytes, plan.config.batch);
  const double plain = std::max(1e-12, plan.plain_predicted_seconds);
  if (plan.feasible) {
    std::vector<std::string> names;
    for (int b : plan.config.checkpoint.recomputed_blocks()) names.push_back(w.chain->block(b).name);
    fmt::print("  {:<28}{} x {}\n", "micro-batch x accumulation", plan.config.micro_batch_size(), plan.config.accumulation());
    fmt::print("  {:<28}{}\n", "precision", precision_name(plan.config.precision));
    fmt::print("  {:<28}{}{}\n", "blocks recomputed", plan.config.checkpoint.describe(),
               names.empty() ? "" : " (" + fmt::format("{}", fmt::join(names, " ")) + ")");
    fmt::print("  {:<28}{}\n", "optimizer", plan.config.optimizer.describe());
    fmt::print("  {:<28}{}\n", "predicted peak", bytes_cell(plan.predicted_peak));
    if (v != nullptr) {
      fmt::print("  {:<28}{}  ({:+.1f}% vs predicted)\n", "measured peak", bytes_cell(v->measured_peak),
                 100.0 * static_cast<double>(plan.predicted_peak - v->measured_peak) /
                     static_cast<double>(std::max<int64_t>(1, v->measured_peak)));
      fmt::print("  {:<28}{:.2f}x predicted, {:.2f}x measured\n", "step time vs plain step", plan.predicted_seconds / plain,
                 v->measured_seconds / std::max(1e-12, v->plain_seconds));
    } else {
      fmt::print("  {:<28}{:.2f}x predicted\n", "step time vs plain step", plan.predicted_seconds / plain);
    }
  }
  fmt::print("  {:<28}{}\n", "plain step, predicted peak", bytes_cell(plan.plain_predicted_peak));
  fmt::print("  {:<28}{}\n", "smallest budget (floor)", bytes_cell(plan.floor_bytes));
  fmt::print("  {} {:.2f} s, planning {:.3f} s\n",
             j["profile_cached"].get<bool>() ? "profile read from the cache (--replan measures again) in" : "profiling",
             j["profile_seconds"].get<double>(), j["solve_seconds"].get<double>());
  for (const auto& n : j["notes"]) fmt::print("  note: {}\n", n.get<std::string>());
}

int64_t parse_budget(const std::string& text) {
  try {
    return parse_size(text);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(std::string("--budget: ") + e.what());
  }
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int run_report_command(WorkloadFlags& wf, const StepFlags& sf, const ReportFlags& f) {
  // A report runs one configuration: "auto" (chosen by a plan) is for plan and train.
  check_option(sf.precision != "auto", "precision", "'auto'", "report runs one precision: fp32, bf16 or fp16");
  check_option(sf.checkpoint != "auto", "checkpoint", "'auto'", "report runs one schedule: none, all, every:K or i,j,...");
  check_option(sf.optimizer_state != "auto", "optimizer.state", "'auto'", "report runs one optimizer state: fp32 or 8bit");
  Workload w = build_workload(wf);
  ReportOptions o;
  o.step = step_config(sf, w.chain->size());
  o.steps = f.steps;
  o.eval_only = f.eval;
  o.world_size = f.world_size;
  o.zero_stage = f.zero_stage;
  w.chain->to(o.step.device);
  Report r = run_report(w, o);
  if (f.json) {
    nlohmann::json j = report_json(r);
    j["notes"] = w.notes;
    std::cout << j.dump(2) << "\n";
  } else {
    for (const auto& n : w.notes) fmt::print("note: {}\n", n);
    print_report_peak(r);
    print_report_states(r);
  }
  if (!f.html.empty()) {
    write_html_report(f.html, report_chart_document(r));
    if (!f.json) fmt::print("\nReport: {}\n", f.html);
  }
  return 0;
}

int run_plan_command(WorkloadFlags& wf, const StepFlags& sf, const PlanFlags& f) {
  check_option(!f.budget.empty(), "budget", "(none)", "a budget is required, e.g. --budget 300MiB");
  PlanRequest request;
  request.budget_bytes = parse_budget(f.budget);
  Workload w = build_workload(wf);
  auto tracker = std::make_shared<MemoryTracker>();
  TrackerScope scope(tracker);
  adopt_tensors(*tracker, w.chain->parameters());
  adopt_tensors(*tracker, w.chain->buffers());
  // What else the budget counts (the user's data tensors): planned for, and measured with.
  request.resident_bytes = std::max<int64_t>(0, BudgetAllocator::install().allocated() - tracker->current());
  request.step = step_config(sf, w.chain->size());
  request.checkpoint = pinned_checkpoint(sf.checkpoint, w.chain->size());
  const auto precisions = precision_candidates(sf.precision, request.step.device.type());
  w.chain->to(request.step.device);
  const Batch batch = w.data->train_batch(0, request.step.batch, w.seed).to(request.step.device);
  CostsSource source;
  Planner planner = measure_and_plan(w, batch, precisions, request, *tracker, {}, profile_cache_options(sf), &source);
  const auto t1 = std::chrono::steady_clock::now();
  int timed = 0;
  Plan plan = plan_timing_as_needed(planner, 0, [&](Precision precision, const std::vector<int64_t>& sizes,
                                                     const TimingReference& reference) {
    return time_plain_chain(w, batch, precision, sizes, reference, *tracker);
  }, &timed);
  const double solve_s = seconds_since(t1);
  if (timed > 0) store_costs(source, planner.measured_costs());  // the cache keeps the sizes timed
  Verification v;
  const bool verified = f.verify && plan.feasible;
  if (verified) v = verify_plan(w, planner, plan, *tracker, /*measure_plain=*/true, &batch);
  nlohmann::json j = verified ? verified_plan_json(plan, v) : plan_json(plan);
  for (const auto& n : w.notes) j["notes"].push_back(n);
  j["profile_seconds"] = source.seconds;
  j["profile_cached"] = source.cached;
  j["solve_seconds"] = solve_s;
  for (const auto& n : source.notes) j["notes"].push_back(n);
  if (f.json) {
    std::cout << j.dump(2) << "\n";
  } else {
    print_plan_table(w, plan, verified ? &v : nullptr, j);
  }
  if (plan.feasible) return 0;
  std::fprintf(stderr, "memfit: budget %s is below the floor: the smallest budget any plan reaches is %s (%lld bytes)\n",
               format_bytes(plan.budget_bytes).c_str(), format_bytes(plan.floor_bytes).c_str(),
               static_cast<long long>(plan.floor_bytes));
  return 1;
}

int run_train_command(WorkloadFlags& wf, const StepFlags& sf, TrainFlags& f) {
  TrainOptions& o = f.options;
  if (!f.budget.empty()) o.budget_bytes = parse_budget(f.budget);
  if (!f.inject_oom.empty()) {
    try {
      o.inject_oom = parse_step_list(f.inject_oom, o.steps);
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(std::string("--inject-oom: ") + e.what());
    }
  }
  Workload w = build_workload(wf);
  const StepConfig fixed = step_config(sf, w.chain->size());
  o.batch = fixed.batch;
  o.micro_batch = fixed.micro_batch;
  o.keep_grads = !fixed.set_to_none;
  o.device = fixed.device;
  o.optimizer = fixed.optimizer;
  o.precision = sf.precision;
  o.checkpoint = pinned_checkpoint(sf.checkpoint, w.chain->size());
  o.profile_cache = profile_cache_options(sf);
  StopOnSignals stop_on_ctrl_c;  // the first Ctrl-C finishes the step, saves and summarizes
  const TrainSummary summary = train(w, o, std::cout);
  return summary.interrupted ? 130 : 0;
}

}  // namespace memfit::cli
