#include "commands.h"

#include <unistd.h>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <iostream>
#include <sstream>

#include "plan_output.h"
#include "train_output.h"

namespace memfit::cli {
namespace {

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

// What the run would reserve on a CUDA device, under this LibTorch's caching allocator rules.
void print_cuda_prediction(const CudaReservedPrediction& p) {
  if (!p.valid) return;
  const std::string conf = p.conf_text.empty() ? "defaults" : "PYTORCH_CUDA_ALLOC_CONF=" + p.conf_text;
  fmt::print("On a CUDA device (LibTorch {} caching allocator, {}), predicted:\n", cuda_allocator_rules_name(p.rules), conf);
  fmt::print("  {:<18}{}\n  {:<18}{}\n", "reserved peak", bytes_cell(p.peak_reserved), "allocated peak",
             bytes_cell(p.peak_allocated));
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
  print_cuda_prediction(r.cuda);
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

int64_t parse_size_flag(const std::string& flag, const std::string& text) {
  try {
    return parse_size(text);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(flag + ": " + e.what());
  }
}

int64_t parse_budget(const std::string& text) { return parse_size_flag("--budget", text); }

// The device memory outside CUDA's caching allocator (zeros on other devices), measured before
// the model is moved there.
OutsideMemory outside_memory_on(const c10::Device& device) {
  return device.is_cuda() ? measure_outside_memory(device.has_index() ? device.index() : 0) : OutsideMemory{};
}

nlohmann::json outside_json(const OutsideMemory& m) {
  return {{"device_total", m.device_total}, {"context_and_others", m.context_and_others}, {"cublas", m.cublas}};
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
  const OutsideMemory outside = outside_memory_on(o.step.device);
  w.chain->to(o.step.device);
  Report r = run_report(w, o);
  if (f.json) {
    nlohmann::json j = report_json(r);
    j["notes"] = w.notes;
    if (o.step.device.is_cuda()) j["cuda_outside_bytes"] = outside_json(outside);
    std::cout << j.dump(2) << "\n";
  } else {
    for (const auto& n : w.notes) fmt::print("note: {}\n", in_flag_terms(n));
    print_report_peak(r);
    print_report_states(r);
  }
  if (!f.html.empty()) {
    write_html_report(f.html, report_document(r).to_json());
    if (!f.json) fmt::print("\nReport: {}\n", f.html);
  }
  return 0;
}

int run_plan_command(WorkloadFlags& wf, const StepFlags& sf, const PlanFlags& f) {
  check_option(!f.budget.empty(), "budget", "(none)", "a budget is required, e.g. --budget 300MiB");
  check_option(f.verify_steps >= 2, "verify_steps", f.verify_steps, "expected 2 or more (the first step only warms up)");
  const int64_t budget = parse_budget(f.budget);
  Workload w = build_workload(wf);
  PlanAsk ask;
  ask.step = step_config(sf, w.chain->size());
  make_8bit_maps_if_used(ask.step.optimizer, ask.step.device);  // before the tracker: resident, not tracked
  auto tracker = std::make_shared<MemoryTracker>();
  TrackerScope scope(tracker);
  adopt_tensors(*tracker, w.chain->parameters());
  adopt_tensors(*tracker, w.chain->buffers());
  ask.budget_bytes = budget;
  ask.precisions = {sf.precision};
  ask.offload = f.offload;
  ask.host_budget_bytes = f.host_budget.empty() ? 0 : parse_size_flag("--host-budget", f.host_budget);
  ask.checkpoint = pinned_checkpoint(sf.checkpoint, w.chain->size());
  // What else the budget counts (the user's data tensors, 8-bit maps): planned for, and measured with.
  ask.resident_bytes = untracked_bytes(*tracker, ask.step.device);
  const OutsideMemory outside = outside_memory_on(ask.step.device);
  ask.outside_bytes = outside.total();  // on CUDA it counts against the budget too
  PlanSetup setup = set_up_plan(ask);
  PlanJobOptions o;
  o.request = std::move(setup.request);
  o.precisions = std::move(setup.precisions);
  o.cache = profile_cache_options(sf);
  o.reserved_fit = reserved_fit_for(o.request.step.device);
  w.chain->to(o.request.step.device);
  const Batch batch = w.data->train_batch(0, o.request.step.batch, w.seed).to(o.request.step.device);
  PlanJob job(w, [&batch] { return batch; }, std::move(o), *tracker);
  const auto t1 = std::chrono::steady_clock::now();
  Plan plan = job.plan();
  const double solve_s = seconds_since(t1);
  Verification v;
  const bool verified = f.verify && plan.feasible;
  if (verified) v = verify_plan(w, job.planner(), plan, *tracker, /*measure_plain=*/true, f.verify_steps, &batch);
  const CostsSource& source = job.source();
  plan.notes.insert(plan.notes.begin(), setup.notes.begin(), setup.notes.end());
  plan.notes.insert(plan.notes.begin(), source.notes.begin(), source.notes.end());
  plan.notes.insert(plan.notes.begin(), w.notes.begin(), w.notes.end());
  if (f.json) {
    nlohmann::json j = verified ? verified_plan_json(plan, v) : plan_json(plan);
    j["profile_seconds"] = source.seconds;
    j["profile_cached"] = source.cached;
    j["solve_seconds"] = solve_s;
    if (plan.config.device.is_cuda()) j["cuda_outside_bytes"] = outside_json(outside);
    std::cout << j.dump(2) << "\n";
  } else {
    fmt::print("{}\n", w.description);
    print_plan(plan, w.chain->block_names(), verified ? &v : nullptr,
               fmt::format("{} {:.2f} s, planning {:.3f} s",
                           source.cached ? "profile read from the cache (--replan measures again) in" : "profiling",
                           source.seconds, solve_s));
  }
  if (plan.feasible) return 0;
  std::fprintf(stderr, "memfit: %s\n", in_flag_terms(below_floor_text(job.planner(), plan.budget_bytes)).c_str());
  return 1;
}

int run_train_command(WorkloadFlags& wf, const StepFlags& sf, TrainFlags& f) {
  TrainOptions& o = f.options;
  if (!f.budget.empty()) o.budget_bytes = parse_budget(f.budget);
  o.offload = parse_offload_mode(f.offload);
  if (!f.host_budget.empty()) o.host_budget_bytes = parse_size_flag("--host-budget", f.host_budget);
  if (!f.inject_oom.empty()) {
    try {
      o.inject_oom = parse_step_list(f.inject_oom, o.steps);
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(std::string("--inject-oom: ") + e.what());
    }
  }
  check_option(f.progress_every >= 0, "progress_every", f.progress_every, "expected >= 0 (0: about 20 lines a run)");
  Workload w = build_workload(wf);
  o.step = step_config(sf, w.chain->size());
  o.pin_precision = sf.precision != "auto";
  o.pin_checkpoint = sf.checkpoint != "auto";
  o.profile_cache = profile_cache_options(sf);
  TrainOutput output({f.progress, f.progress_every, f.progress && isatty(fileno(stdout)) != 0});
  StopOnSignals stop_on_ctrl_c;  // the first Ctrl-C finishes the step, saves and summarizes
  Trainer trainer(w, o);
  trainer.add_observer(output);
  trainer.dump_weights_at_summary(f.dump_weights);
  const TrainSummary summary = trainer.run();
  return summary.interrupted ? 130 : 0;
}

}  // namespace memfit::cli
