// memfit — the command-line tool: a thin layer over the library. Each subcommand declares its
// flags (the shared ones once, in flags.cpp), builds the workload, calls the library, prints.
// Bad input: one clear line naming the flag, and exit 2.
#include <CLI/CLI.hpp>
#include <fmt/format.h>
#include <torch/version.h>
#include <malloc.h>
#include <unistd.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>
#include <limits>

#include "commands.h"
#include "launch.h"

#ifndef MEMFIT_VERSION  // set by CMake from project(VERSION)
#define MEMFIT_VERSION "unknown"
#endif

namespace {

using namespace memfit;
using namespace memfit::cli;

// A subcommand with the shared workload and step flags.
CLI::App* add_command(CLI::App& app, const char* name, const char* help, WorkloadFlags& w, StepFlags& s, bool planned) {
  CLI::App* cmd = app.add_subcommand(name, help);
  add_workload_flags(*cmd, w);
  add_step_flags(*cmd, s, planned);
  return cmd;
}

void add_offload_flags(CLI::App& cmd, std::string& offload, std::string& host_budget) {
  cmd.add_option("--offload", offload,
                 "what goes to host memory: none, optimizer (state, step, fp32 weights, gradients streamed), "
                 "activations (of the blocks the plan chooses), all, auto (each only where it pays)")
      ->capture_default_str();
  cmd.add_option("--host-budget", host_budget, "host bytes an offloading plan may use (default: unlimited)");
}

CLI::App* add_report(CLI::App& app, WorkloadFlags& w, StepFlags& s, ReportFlags& f) {
  CLI::App* cmd = add_command(app, "report", "run real training steps and show where the memory goes", w, s, false);
  cmd->add_option("--steps", f.steps, "training steps; the last is analysed")->capture_default_str();
  cmd->add_flag("--eval", f.eval, "inference only (InferenceMode)");
  cmd->add_flag("--json", f.json, "exact JSON (bytes as integers) instead of a table");
  cmd->add_option("--html", f.html, "also write a self-contained HTML report to this file");
  cmd->add_option("--world-size", f.world_size, "also show state bytes per rank for this many data-parallel ranks")
      ->capture_default_str();
  cmd->add_option("--zero", f.zero_stage, "ZeRO stage for --world-size: 0, 1, 2 or 3")->capture_default_str();
  return cmd;
}

CLI::App* add_plan(CLI::App& app, WorkloadFlags& w, StepFlags& s, PlanFlags& f) {
  CLI::App* cmd = add_command(app, "plan", "choose micro-batch, precision and recomputed blocks for a budget", w, s, true);
  cmd->add_option("--budget", f.budget, "memory budget: 512MiB, 1.5GiB, 800MB, 1e9 or bytes")->required();
  cmd->add_flag("--json", f.json, "JSON output");
  cmd->add_flag("!--no-verify", f.verify, "predict only; do not run real steps");
  cmd->add_option("--verify-steps", f.verify_steps, "real steps that verify the plan (the first warms up)")
      ->capture_default_str();
  add_offload_flags(*cmd, f.offload, f.host_budget);
  return cmd;
}

CLI::App* add_train(CLI::App& app, WorkloadFlags& w, StepFlags& s, TrainFlags& f) {
  TrainOptions& o = f.options;
  o.report_html = "memfit-report.html";
  CLI::App* cmd = add_command(app, "train", "train under a hard memory budget with an automatic plan", w, s, true);
  cmd->add_option("--budget", f.budget,
                  "memory budget: 512MiB, 1.5GiB, 800MB, 1e9 or bytes (default: halfway between the smallest plan and the plain step)");
  cmd->add_option("--steps", o.steps, "train until this step (counted from the start, resumes included)")->capture_default_str();
  cmd->add_option("--save", o.save_dir, "save state into this directory (atomically)");
  cmd->add_option("--save-every", o.save_every, "save every K steps")->capture_default_str();
  cmd->add_option("--resume", o.resume_dir, "resume from the state saved in this directory");
  cmd->add_option("--eval-every", o.eval_every, "held-out evaluation every K steps (0: never)")->capture_default_str();
  cmd->add_option("--eval-batches", o.eval_batches, "held-out batches per evaluation")->capture_default_str();
  cmd->add_option("--inject-oom", f.inject_oom, "steps (from 1) whose first micro-batch fails once, e.g. 3,7");
  cmd->add_option("--json-log", o.json_log, "write JSON lines (plan, steps, summary) to this file");
  cmd->add_option("--report", o.report_html, "HTML report of the last step")->capture_default_str();
  cmd->add_flag("!--no-progress", f.progress, "no progress lines");
  cmd->add_option("--progress-every", f.progress_every,
                  "not on a terminal: a progress line every K steps (0: about 20 lines a run)")
      ->capture_default_str();
  cmd->add_option("--world-size", o.distributed.world_size, "data-parallel ranks (memfit launch sets it)")->capture_default_str();
  cmd->add_option("--rank", o.distributed.rank, "this process's rank: 0 to --world-size - 1")->capture_default_str();
  cmd->add_option("--master", o.distributed.master, "HOST:PORT of the rendezvous rank 0 opens")->capture_default_str();
  cmd->add_option("--zero", o.distributed.zero_stage, "0: data parallel; 1: optimizer state sharded; 2: gradients too; 3: weights too")
      ->capture_default_str();
  cmd->add_option("--prefetch-depth", o.distributed.prefetch_depth,
                  "--zero 3: blocks whose weights are gathered ahead of the one running, 0 to 2 (default: the plan chooses)");
  add_offload_flags(*cmd, f.offload, f.host_budget);
  cmd->add_option("--dist-timeout", o.distributed.timeout_seconds, "seconds to wait for other ranks (rendezvous, each collective)")
      ->capture_default_str();
  cmd->add_option("--dump-weights", f.dump_weights, "write all parameters as raw float32 (tests)")->group("");
  return cmd;
}

CLI::App* add_launch(CLI::App& app, LaunchOptions& o) {
  CLI::App* cmd = app.add_subcommand("launch", "start N local ranks of data-parallel training: memfit launch --nproc N -- train [flags]");
  cmd->add_option("--nproc", o.nproc, "ranks (processes) to start")->capture_default_str();
  cmd->add_option("--master-port", o.master_port, "rendezvous port on 127.0.0.1 (default: a free one)");
  cmd->add_option("command", o.command, "after --: train and its flags")->required();
  return cmd;
}

// CLI11 clamps integers past 64 bits silently: such a value is refused before parsing, naming
// the flag it follows. Returns the error line, or "" when every integer fits.
std::string out_of_range_integer(int argc, char** argv) {
  for (int i = 1; i < argc; ++i) {
    std::string value = argv[i];
    std::string flag = i > 1 ? argv[i - 1] : "";
    const size_t eq = value.find('=');
    if (value.rfind("--", 0) == 0 && eq != std::string::npos) {
      flag = value.substr(0, eq);
      value = value.substr(eq + 1);
    }
    const size_t first = value.rfind('-', 0) == 0 ? 1 : 0;
    if (value.size() <= first || value.find_first_not_of("0123456789", first) != std::string::npos) continue;
    errno = 0;
    std::strtoll(value.c_str(), nullptr, 10);
    if (errno == ERANGE) return "invalid " + flag + " " + value + ": out of the range of a 64-bit integer";
  }
  return "";
}

// CLI11 reads integers with base 0, so --batch 010 would be 8 and 0x10 16: every integer
// option of every command takes plain decimal only ("-" allowed, no leading zeros).
void require_decimal_integers(CLI::App& app) {
  const CLI::Validator decimal(
      [](std::string& text) -> std::string {
        const size_t digits = text.rfind('-', 0) == 0 ? 1 : 0;
        const bool ok = text.size() > digits && text.find_first_not_of("0123456789", digits) == std::string::npos &&
                        (text[digits] != '0' || text.size() == digits + 1);
        return ok ? "" : "'" + text + "': expected a decimal integer (no leading zeros, no 0x)";
      },
      "");
  for (CLI::Option* option : app.get_options()) {
    const std::string type = option->get_type_name();
    if (type == "INT" || type == "UINT") option->check(decimal);
  }
  for (CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) require_decimal_integers(*sub);
}

// CLI11 reads an empty value as 0 for a number (--momentum '' ran with momentum 0, --lr '' was
// refused as "--lr 0"), and an empty --budget reads as none given: every number and size
// option refuses an empty value, naming the flag.
void refuse_empty_numbers(CLI::App& app) {
  const auto refuse_empty = [](const std::string& expected) {
    return CLI::Validator([expected](std::string& text) { return text.empty() ? "'': expected " + expected : ""; }, "");
  };
  for (CLI::Option* option : app.get_options()) {
    const std::string type = option->get_type_name();
    if (type == "FLOAT" || type == "INT" || type == "UINT") option->check(refuse_empty("a number"));
    if (option->check_name("--budget")) option->check(refuse_empty("a size such as 512MiB, 1.5GiB or 1e9"));
  }
  for (CLI::App* sub : app.get_subcommands([](CLI::App*) { return true; })) refuse_empty_numbers(*sub);
}

// One line: one "memfit: " prefix, whatever the library's message starts with; the line that
// says the cause (for a TorchScript error, the innermost); nothing raw from a file (parser
// errors quote what they read), and not too long.
void print_error(const std::string& message) {
  const std::string prefix = "memfit: ";
  const std::string text = message.rfind(prefix, 0) == 0 ? message.substr(prefix.size()) : message;
  std::fprintf(stderr, "memfit: %s\n", in_flag_terms(printable(error_cause(text))).c_str());
}

// Runs the parsed subcommand; library errors become one line (flag names for bad options).
int dispatch(const std::function<int()>& command) {
  try {
    return command();
  } catch (const OptionError& e) {
    print_error(flag_message(e));
    return 2;
  } catch (const std::invalid_argument& e) {
    print_error(e.what());
    return 2;
  } catch (const c10::Error& e) {
    print_error(e.what_without_backtrace());
    return 1;
  } catch (const std::exception& e) {
    print_error(e.what());
    return 1;
  }
}

// Sets an environment variable the user left unset; whether it did.
bool set_unless_chosen(const char* name, const char* value) {
  return std::getenv(name) == nullptr && setenv(name, value, 1) == 0;
}

// The process as memfit runs in it: its environment, the C library's memory and memfit's allocator.
void prepare_process(char** argv) {
  // OpenMP threads that spin while they wait take the cores the work needs on small machines,
  // and make every time the planner measures noisy (a plan's predicted step time off by a
  // factor of four on 2 cores; with passive waiting, within a few percent). oneMKL (LibTorch
  // 2.x's CPU BLAS) gives the same bits run to run only at a fixed thread count, MKL_DYNAMIC and
  // OMP_DYNAMIC false (its "Reproducibility Conditions"): memfit resumes bit-exactly and ZeRO 3
  // sums as one process does. libgomp and oneMKL read these only when loaded, so memfit
  // restarts itself once with them set, unless the user chose.
  if (set_unless_chosen("OMP_WAIT_POLICY", "PASSIVE") | set_unless_chosen("MKL_DYNAMIC", "FALSE") |
      set_unless_chosen("OMP_DYNAMIC", "FALSE")) {
    execv("/proc/self/exe", argv);  // returns only on failure: then run on as we are
  }
  // Freed tensor memory stays in this process (as a GPU caching allocator keeps it) instead of
  // going back to the kernel and being page-faulted in again on the next step: on small
  // machines that costs up to a third of a step as system time. Allocated bytes, which memfit counts and
  // budgets, are unchanged. (bench/harness/quiet_env.sh sets the same for both sides of benchmarks.)
  mallopt(M_MMAP_THRESHOLD, 1 << 30);
  mallopt(M_TRIM_THRESHOLD, std::numeric_limits<int>::max());
  // First thing: every tensor from here on goes through memfit's allocator (no budget yet),
  // which reports each allocation to the memory tracker.
  BudgetAllocator::install();
}

}  // namespace

int main(int argc, char** argv) {
  prepare_process(argv);
  CLI::App app{"memfit: make deep-learning training fit in the memory you have"};
  app.require_subcommand(1);
  // What memfit was built against: the test logs of each build print it (scripts/test-torch2.sh).
  app.set_version_flag("--version", fmt::format("memfit {} (LibTorch {}, CUDA {})", MEMFIT_VERSION, TORCH_VERSION,
                                                 MEMFIT_WITH_CUDA ? "yes" : "no"));
  WorkloadFlags report_w, plan_w, train_w;
  StepFlags report_s, plan_s, train_s;
  ReportFlags report_f;
  PlanFlags plan_f;
  TrainFlags train_f;
  LaunchOptions launch_o;
  CLI::App* report = add_report(app, report_w, report_s, report_f);
  CLI::App* plan = add_plan(app, plan_w, plan_s, plan_f);
  CLI::App* train = add_train(app, train_w, train_s, train_f);
  CLI::App* launch_cmd = add_launch(app, launch_o);
  refuse_empty_numbers(app);
  require_decimal_integers(app);
  if (const std::string bad = out_of_range_integer(argc, argv); !bad.empty()) {
    std::fprintf(stderr, "memfit: %s\n", bad.c_str());
    return 2;
  }
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForAllHelp& e) {
    return app.exit(e);
  } catch (const CLI::CallForVersion& e) {
    return app.exit(e);
  } catch (const CLI::ParseError& e) {
    std::fprintf(stderr, "memfit: %s (see memfit --help)\n", printable(e.what()).c_str());
    return 2;
  }
  if (report->parsed()) return dispatch([&] { return run_report_command(report_w, report_s, report_f); });
  if (plan->parsed()) return dispatch([&] { return run_plan_command(plan_w, plan_s, plan_f); });
  if (train->parsed()) return dispatch([&] { return run_train_command(train_w, train_s, train_f); });
  if (launch_cmd->parsed()) return dispatch([&] { return launch(launch_o); });
  return 0;
}
