// memfit — the command-line tool: a thin layer over the library. Each subcommand parses its
// flags, validates them (one clear line and exit 2 on bad input), calls the library, prints.
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <fmt/ranges.h>
#include <torch/torch.h>

#include <malloc.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <limits>
#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <thread>

#include "launch.h"
#include "memfit/memfit.h"

namespace {

using namespace memfit;

// Flags shared by subcommands that build a workload.
struct CommonFlags {
  ModelOptions model;
  int64_t batch = 16;
  int threads = 0;
  int64_t layers = 0;  // gpt: transformer layers; mlp: hidden layers (0 = the model's default)
  int64_t micro_batch = 0;
  std::string precision = "fp32";
  std::string checkpoint = "none";
  bool keep_grads = false;
};

void add_model_flags(CLI::App& app, CommonFlags& f) {
  app.add_option("--model", f.model.model, "gpt | cnn | mlp")->capture_default_str();
  app.add_option("--layers", f.layers, "gpt: transformer layers (8); mlp: hidden layers (4)");
  app.add_option("--d-model", f.model.gpt.d_model, "gpt: model width")->capture_default_str();
  app.add_option("--heads", f.model.gpt.heads, "gpt: attention heads (must divide --d-model)")->capture_default_str();
  app.add_option("--dropout", f.model.gpt.dropout, "gpt: dropout probability")->capture_default_str();
  app.add_option("--seq", f.model.gpt.seq, "gpt: sequence length in characters")->capture_default_str();
  app.add_option("--data", f.model.data_file, "gpt: a text file to train on instead of the Bible");
  app.add_option("--blocks", f.model.cnn.blocks, "cnn: residual blocks")->capture_default_str();
  app.add_option("--channels", f.model.cnn.channels, "cnn: channels")->capture_default_str();
  app.add_option("--width", f.model.mlp.width, "mlp: hidden width")->capture_default_str();
  app.add_option("--batch", f.batch, "samples per optimizer step")->capture_default_str();
  app.add_option("--seed", f.model.seed, "seed for weights, batches and dropout")->capture_default_str();
  app.add_option("--threads", f.threads, "LibTorch threads (default: all cores)");
}

void add_technique_flags(CLI::App& app, CommonFlags& f) {
  app.add_option("--micro-batch", f.micro_batch, "samples per micro-batch (gradient accumulation)");
  app.add_option("--precision", f.precision, "fp32 | bf16 | fp16 (autocast)")->capture_default_str();
  app.add_option("--checkpoint", f.checkpoint, "none | all | every:K | i,j,... (blocks recomputed in backward)")
      ->capture_default_str();
  app.add_flag("--keep-grads", f.keep_grads, "zero gradients instead of releasing them (set_to_none off)");
}

// Validation the library cannot do alone (it needs to know the whole command line).
void apply_common(CommonFlags& f) {
  if (f.layers != 0) f.model.gpt.layers = f.model.mlp.layers = f.layers;
  if (f.batch < 1) throw std::invalid_argument(fmt::format("invalid --batch {}: expected a positive integer", f.batch));
  if (f.micro_batch < 0 || f.micro_batch > f.batch) {
    throw std::invalid_argument(fmt::format("invalid --micro-batch {}: expected 1 to --batch ({})", f.micro_batch, f.batch));
  }
  if (f.threads < 0) throw std::invalid_argument(fmt::format("invalid --threads {}: expected >= 1", f.threads));
  const int threads = f.threads > 0 ? f.threads : static_cast<int>(std::max(1u, std::thread::hardware_concurrency()));
  at::set_num_threads(threads);
}

StepOptions step_options(const CommonFlags& f, int blocks) {
  StepOptions s;
  s.micro_batch = f.micro_batch;
  s.precision = parse_precision(f.precision);
  std::string why;
  if (!precision_supported(s.precision, c10::kCPU, &why)) {
    throw std::invalid_argument("invalid --precision " + f.precision + ": " + why);
  }
  s.checkpoint = CheckpointPlan::parse(f.checkpoint, blocks);
  s.set_to_none = !f.keep_grads;
  return s;
}

int chain_size(const ModelOptions& m) {
  if (m.model == "gpt") return static_cast<int>(2 * m.gpt.layers + 2);
  if (m.model == "cnn") return static_cast<int>(m.cnn.blocks + 2);
  if (m.model == "mlp") return static_cast<int>(m.mlp.layers + 1);
  throw std::invalid_argument("unknown model '" + m.model + "': expected gpt, cnn or mlp");
}

std::string bytes_cell(int64_t b) { return fmt::format("{:>10}  {:>12} B", format_bytes(b), b); }

void print_report_table(const Report& r) {
  const auto& a = r.analysis;
  fmt::print("{}\n", r.description);
  fmt::print("{} parameters ({}), batch {}, micro-batch {}, precision {}, checkpoint {}, gradients {}\n\n",
             r.parameters, format_bytes(r.parameter_bytes), r.batch,
             r.options.step.micro_batch > 0 ? r.options.step.micro_batch : r.batch,
             precision_name(r.options.step.precision), r.options.step.checkpoint.describe(),
             r.options.step.set_to_none ? "released after the step" : "kept (zeroed)");
  fmt::print("Peak of the last {} step: {} ({} bytes), during {}\n",
             r.options.eval_only ? "eval" : "training", format_bytes(a.peak_bytes), a.peak_bytes,
             phase_name(a.peak_phase));
  const auto& p = a.at_peak;
  auto share = [&](int64_t v) { return a.peak_bytes ? 100.0 * static_cast<double>(v) / static_cast<double>(a.peak_bytes) : 0.0; };
  fmt::print("  {:<18}{}  {:5.1f}%\n", "weights", bytes_cell(p.weights), share(p.weights));
  fmt::print("  {:<18}{}  {:5.1f}%\n", "gradients", bytes_cell(p.gradients), share(p.gradients));
  fmt::print("  {:<18}{}  {:5.1f}%\n", "optimizer state", bytes_cell(p.optimizer_state), share(p.optimizer_state));
  fmt::print("  {:<18}{}  {:5.1f}%\n", "activations", bytes_cell(p.activations), share(p.activations));
  fmt::print("  {:<18}{}  {:5.1f}%\n", "other", bytes_cell(p.other), share(p.other));
  if (p.autocast_cache > 0) fmt::print("    of which autocast weight casts {}\n", bytes_cell(p.autocast_cache));
  if (!r.options.eval_only) {
    fmt::print("\nAfter backward + optimizer step:\n");
    fmt::print("  {:<18}{}\n  {:<18}{}\n  {:<18}{}\n", "weights", bytes_cell(r.states.weights), "gradients",
               bytes_cell(r.states.gradients), "optimizer state", bytes_cell(r.states.optimizer_state));
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
  }
  fmt::print("\nActivations each block keeps for backward (end of forward):\n");
  for (size_t i = 0; i < r.block_names.size(); ++i) {
    fmt::print("  {:>3} {:<10}{}{}\n", i, r.block_names[i], bytes_cell(a.block_activation_bytes.at(i)),
               r.block_recomputed[i] ? "  (recomputed)" : "");
  }
}

int run_report_command(CommonFlags& f, int64_t steps, bool eval_only, bool json, const std::string& html,
                       int world_size, int zero_stage) {
  apply_common(f);
  ReportOptions o;
  o.world_size = world_size;
  o.zero_stage = zero_stage;
  o.model = f.model;
  o.batch = f.batch;
  o.steps = steps;
  o.eval_only = eval_only;
  o.step = step_options(f, chain_size(f.model));
  if (steps < 1) throw std::invalid_argument(fmt::format("invalid --steps {}: expected a positive integer", steps));
  Report r = run_report(o);
  if (json) {
    std::cout << report_json(r).dump(2) << "\n";
  } else {
    print_report_table(r);
  }
  if (!html.empty()) {
    write_html_report(html, report_chart_document(r));
    if (!json) fmt::print("\nReport: {}\n", html);
  }
  return 0;
}

int run_plan_command(CommonFlags& f, const std::string& budget_text, bool json, bool verify) {
  apply_common(f);
  if (budget_text.empty()) throw std::invalid_argument("--budget is required: e.g. --budget 300MiB");
  PlanRequest request;
  try {
    request.budget_bytes = parse_size(budget_text);
  } catch (const std::invalid_argument& e) {
    throw std::invalid_argument(std::string("--budget: ") + e.what());
  }
  request.batch = f.batch;
  request.micro_batch = f.micro_batch;
  request.keep_grads = f.keep_grads;
  request.precisions = precision_candidates(f.precision, c10::kCPU);
  if (f.checkpoint != "auto") request.checkpoint = CheckpointPlan::parse(f.checkpoint, chain_size(f.model));
  auto tracker = std::make_shared<MemoryTracker>();
  TrackerScope scope(tracker);
  Workload w = make_workload(f.model);
  const Batch batch = w.data->train_batch(0, f.batch, f.model.seed);
  const auto t0 = std::chrono::steady_clock::now();
  Planner planner(w, batch, request, *tracker);
  const double profile_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const auto t1 = std::chrono::steady_clock::now();
  Plan plan = planner.plan();
  const double solve_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t1).count();
  Verification v;
  const bool verified = verify && plan.feasible;
  if (verified) v = verify_plan(w, planner, plan, *tracker, f.batch, /*measure_plain=*/true);
  auto j = plan_json(plan, verified ? &v : nullptr);
  j["profile_seconds"] = profile_s;
  j["solve_seconds"] = solve_s;
  if (json) {
    std::cout << j.dump(2) << "\n";
  } else {
    fmt::print("{}\n", w.description);
    fmt::print("Plan for a budget of {} ({} bytes; {:.0f}% kept free), batch {}:\n", format_bytes(plan.budget_bytes),
               plan.budget_bytes, request.margin * 100, f.batch);
    if (plan.feasible) {
      std::vector<std::string> names;
      for (int b : plan.checkpoint.recomputed_blocks()) names.push_back(w.chain->block(b).name);
      fmt::print("  {:<28}{} x {}\n", "micro-batch x accumulation", plan.micro_batch, plan.accumulation);
      fmt::print("  {:<28}{}\n", "precision", precision_name(plan.precision));
      fmt::print("  {:<28}{}{}\n", "blocks recomputed", plan.checkpoint.describe(),
                 names.empty() ? "" : " (" + fmt::format("{}", fmt::join(names, " ")) + ")");
      fmt::print("  {:<28}{:>10}  {:>12} B\n", "predicted peak", format_bytes(plan.predicted_peak), plan.predicted_peak);
      if (verified) {
        fmt::print("  {:<28}{:>10}  {:>12} B  ({:+.1f}% vs predicted)\n", "measured peak", format_bytes(v.measured_peak),
                   v.measured_peak, 100.0 * static_cast<double>(plan.predicted_peak - v.measured_peak) / static_cast<double>(std::max<int64_t>(1, v.measured_peak)));
        fmt::print("  {:<28}{:.2f}x predicted, {:.2f}x measured\n", "step time vs plain step",
                   plan.predicted_seconds / std::max(1e-12, plan.plain_predicted_seconds),
                   v.measured_seconds / std::max(1e-12, v.plain_seconds));
      } else {
        fmt::print("  {:<28}{:.2f}x predicted\n", "step time vs plain step",
                   plan.predicted_seconds / std::max(1e-12, plan.plain_predicted_seconds));
      }
    }
    fmt::print("  {:<28}{:>10}  {:>12} B\n", "plain step, predicted peak", format_bytes(plan.plain_predicted_peak), plan.plain_predicted_peak);
    fmt::print("  {:<28}{:>10}  {:>12} B\n", "smallest budget (floor)", format_bytes(plan.floor_bytes), plan.floor_bytes);
    fmt::print("  profiling {:.2f} s, planning {:.3f} s\n", profile_s, solve_s);
    for (const auto& n : j["notes"]) fmt::print("  note: {}\n", n.get<std::string>());
  }
  if (!plan.feasible) {
    std::fprintf(stderr, "memfit: budget %s is below the floor: the smallest budget any plan reaches is %s (%lld bytes)\n",
                 format_bytes(plan.budget_bytes).c_str(), format_bytes(plan.floor_bytes).c_str(),
                 static_cast<long long>(plan.floor_bytes));
    return 1;
  }
  return 0;
}

int run_train_command(CommonFlags& f, TrainOptions& t, const std::string& budget, const std::string& inject) {
  apply_common(f);
  t.model = f.model;
  t.batch = f.batch;
  t.micro_batch = f.micro_batch;
  t.keep_grads = f.keep_grads;
  if (!budget.empty()) {
    try {
      t.budget_bytes = parse_size(budget);
    } catch (const std::invalid_argument& e) {
      throw std::invalid_argument(std::string("--budget: ") + e.what());
    }
  }
  if (!inject.empty()) {
    std::stringstream in(inject);
    std::string item;
    while (std::getline(in, item, ',')) {
      size_t used = 0;
      long long v = -1;
      try {
        v = std::stoll(item, &used);
      } catch (const std::exception&) {
        used = 0;
      }
      if (item.empty() || used != item.size() || v < 1) {
        throw std::invalid_argument("invalid --inject-oom '" + inject + "': expected step numbers from 1, like 3,7");
      }
      t.inject_oom.push_back(v);
    }
  }
  if (t.checkpoint != "auto") CheckpointPlan::parse(t.checkpoint, chain_size(f.model));  // validates
  train(t, std::cout);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // OpenMP threads that spin while they wait take the cores the work needs on small machines,
  // and make every time the planner measures noisy (on 2 cores a plan's predicted step time was
  // 0.39x and measured 1.66x; with passive waiting 1.35x and 1.34x). libgomp reads the policy
  // only when it is loaded, so memfit restarts itself once with it set, unless the user chose.
  if (std::getenv("OMP_WAIT_POLICY") == nullptr && setenv("OMP_WAIT_POLICY", "PASSIVE", 1) == 0) {
    execv("/proc/self/exe", argv);  // returns only on failure: then run on as we are
  }
  // Freed tensor memory stays in this process (as a GPU caching allocator keeps it) instead of
  // going back to the kernel and being page-faulted in again on the next step: on 2 cores that
  // took up to a third of a step as system time. Allocated bytes, which memfit counts and
  // budgets, are unchanged. (bench/quiet_env.sh sets the same for both sides of benchmarks.)
  mallopt(M_MMAP_THRESHOLD, 1 << 30);
  mallopt(M_TRIM_THRESHOLD, std::numeric_limits<int>::max());
  // First thing: every tensor from here on goes through memfit's allocator (no budget yet),
  // which reports each allocation to the memory tracker.
  BudgetAllocator::install();

  CLI::App app{"memfit: make deep-learning training fit in the memory you have"};
  app.require_subcommand(1);

  CommonFlags report_flags;
  int64_t report_steps = 3;
  bool report_json_flag = false, report_eval = false;
  std::string report_html;
  CLI::App* report = app.add_subcommand("report", "run real training steps and show where the memory goes");
  add_model_flags(*report, report_flags);
  add_technique_flags(*report, report_flags);
  report->add_option("--steps", report_steps, "training steps; the last is analysed")->capture_default_str();
  report->add_flag("--eval", report_eval, "inference only (InferenceMode)");
  report->add_flag("--json", report_json_flag, "exact JSON (bytes as integers) instead of a table");
  report->add_option("--html", report_html, "also write a self-contained HTML report to this file");
  int report_world = 1, report_zero = 0;
  report->add_option("--world-size", report_world, "also show state bytes per rank for this many data-parallel ranks")
      ->capture_default_str();
  report->add_option("--zero", report_zero, "ZeRO stage for --world-size: 0, 1 or 2")->capture_default_str();

  CommonFlags plan_flags;
  plan_flags.precision = "auto";
  plan_flags.checkpoint = "auto";
  std::string plan_budget;
  bool plan_json_flag = false, plan_no_verify = false;
  CLI::App* plan_cmd = app.add_subcommand("plan", "choose micro-batch, precision and recomputed blocks for a budget");
  add_model_flags(*plan_cmd, plan_flags);
  plan_cmd->add_option("--budget", plan_budget, "memory budget: 512MiB, 1.5GiB, 800MB, 1e9 or bytes")->required();
  plan_cmd->add_option("--precision", plan_flags.precision, "auto | fp32 | bf16 | fp16")->capture_default_str();
  plan_cmd->add_option("--micro-batch", plan_flags.micro_batch, "pin the micro-batch size");
  plan_cmd->add_option("--checkpoint", plan_flags.checkpoint, "auto (solved) | none | all | every:K | i,j,... (pinned)")
      ->capture_default_str();
  plan_cmd->add_flag("--keep-grads", plan_flags.keep_grads, "gradients kept between steps");
  plan_cmd->add_flag("--json", plan_json_flag, "JSON output");
  plan_cmd->add_flag("--no-verify", plan_no_verify, "predict only; do not run real steps");

  CommonFlags train_flags;
  TrainOptions train_options;
  train_options.report_html = "memfit-report.html";
  std::string train_budget, train_inject;
  CLI::App* train_cmd = app.add_subcommand("train", "train under a hard memory budget with an automatic plan");
  add_model_flags(*train_cmd, train_flags);
  train_cmd->add_option("--budget", train_budget, "memory budget: 512MiB, 1.5GiB, 800MB, 1e9 or bytes (default: 60% of the plain step)");
  train_cmd->add_option("--steps", train_options.steps, "train until this step (counted from the start, resumes included)")->capture_default_str();
  train_cmd->add_option("--precision", train_options.precision, "auto | fp32 | bf16 | fp16")->capture_default_str();
  train_cmd->add_option("--micro-batch", train_flags.micro_batch, "pin the micro-batch size (default: planned)");
  train_cmd->add_option("--checkpoint", train_options.checkpoint, "auto | none | all | every:K | i,j,...")->capture_default_str();
  train_cmd->add_flag("--keep-grads", train_flags.keep_grads, "zero gradients instead of releasing them");
  train_cmd->add_option("--lr", train_options.learning_rate, "AdamW learning rate")->capture_default_str();
  train_cmd->add_option("--save", train_options.save_dir, "save state into this directory (atomically)");
  train_cmd->add_option("--save-every", train_options.save_every, "save every K steps")->capture_default_str();
  train_cmd->add_option("--resume", train_options.resume_dir, "resume from the state saved in this directory");
  train_cmd->add_option("--eval-every", train_options.eval_every, "held-out evaluation every K steps (0: never)")->capture_default_str();
  train_cmd->add_option("--eval-batches", train_options.eval_batches, "held-out batches per evaluation")->capture_default_str();
  train_cmd->add_option("--inject-oom", train_inject, "steps (from 1) whose first micro-batch fails once, e.g. 3,7");
  train_cmd->add_option("--json-log", train_options.json_log, "write JSON lines (plan, steps, summary) to this file");
  train_cmd->add_option("--report", train_options.report_html, "HTML report of the last step")->capture_default_str();
  train_cmd->add_flag("!--no-progress", train_options.progress, "no progress lines");
  train_cmd->add_option("--world-size", train_options.distributed.world_size, "data-parallel ranks (memfit launch sets it)")->capture_default_str();
  train_cmd->add_option("--rank", train_options.distributed.rank, "this process's rank: 0 to --world-size - 1")->capture_default_str();
  train_cmd->add_option("--master", train_options.distributed.master, "HOST:PORT of the rendezvous rank 0 opens")->capture_default_str();
  train_cmd->add_option("--zero", train_options.distributed.zero_stage, "0: data parallel; 1: optimizer state sharded; 2: gradients too")->capture_default_str();
  train_cmd->add_option("--dist-timeout", train_options.distributed.timeout_seconds, "seconds to wait for other ranks (rendezvous, each collective)")->capture_default_str();
  train_cmd->add_option("--dump-weights", train_options.dump_weights, "write all parameters as raw float32 (tests)")->group("");

  cli::LaunchOptions launch_options;
  CLI::App* launch_cmd = app.add_subcommand("launch", "start N local ranks of data-parallel training: memfit launch --nproc N -- train [flags]");
  launch_cmd->add_option("--nproc", launch_options.nproc, "ranks (processes) to start")->capture_default_str();
  launch_cmd->add_option("--master-port", launch_options.master_port, "rendezvous port on 127.0.0.1 (default: a free one)");
  launch_cmd->add_option("command", launch_options.command, "after --: train and its flags")->required();

  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "memfit: %s (see memfit --help)\n", e.what());
    return 2;
  }

  try {
    if (report->parsed()) return run_report_command(report_flags, report_steps, report_eval, report_json_flag, report_html, report_world, report_zero);
    if (plan_cmd->parsed()) return run_plan_command(plan_flags, plan_budget, plan_json_flag, !plan_no_verify);
    if (train_cmd->parsed()) return run_train_command(train_flags, train_options, train_budget, train_inject);
    if (launch_cmd->parsed()) return cli::launch(launch_options);
  } catch (const std::invalid_argument& e) {
    std::fprintf(stderr, "memfit: %s\n", e.what());
    return 2;
  } catch (const c10::Error& e) {
    std::fprintf(stderr, "memfit: %s\n", e.what_without_backtrace());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "memfit: %s\n", e.what());
    return 1;
  }
  return 0;
}
