// The memfit side of bench/harness/vs_pytorch.sh: memfit's plans for the budgets PyTorch's variants are
// compared at, each run for real under BudgetAllocator at that budget. One JSON line per row:
//
//   plain        the whole batch, nothing recomputed, no budget (memfit's "eager")
//   fp32_plan    Planner::plan(budget) in fp32, for each --budgets value
//   mixed_plan   the same with mixed precision allowed (candidates fp32 and bf16; the planner
//                picks the faster that fits; the step runs in the plan's precision)
//   microbatch   the plan at 1.1 x (weights + gradients + AdamW state): the same batch of
//                --batch samples, trained as micro-batches with gradient accumulation
//
// Each row: model, variant, budget_bytes, plan (description), predicted_peak_bytes, peak_bytes
// (measured: the tracker's exact maximum over the steady-state steps), median_step_s, fits (no
// OutOfMemoryError under the budget), attempts (plans tried, as verify_plan tightens), notes.
// The workload is built once; the Planner profiles it once per precision set (fp32 alone, then
// fp32 + bf16). Every row trains the same model with a fresh AdamW; its first step, which
// creates the optimizer state, is a warm-up, not timed, and runs under the budget too.
//
//   ./build/bench/vs_pytorch_memfit --model gpt --budgets 534641785,415832499 [--threads 2] [--steps 5]
//       [--batch 16] [--layers 8 --d-model 256 --heads 8 --seq 128 --dropout 0.1] [--blocks 6 --channels 32]
//   ./build/bench/vs_pytorch_memfit --model FILE.pt --data DATA.pt [--loss cross-entropy|mse|model] ...
//
// A TorchScript model (the user's, from Python): its data tensors are loaded before the tracker
// starts and run outside the budget (each budget is raised by their bytes), as the PyTorch side
// holds its data outside the allocator; peaks are then the step's own bytes on both sides.
//
// Set OPENBLAS_NUM_THREADS (and OMP_NUM_THREADS) to --threads before starting it, as
// bench/harness/vs_pytorch.sh does: OpenBLAS sizes its own pool when it is loaded.
#include <torch/torch.h>

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <optional>
#include <sstream>
#include <stdexcept>
#include <string>
#include <vector>

#include "memfit/memfit.h"
#include "memfit/zoo/workloads.h"

using namespace memfit;

namespace {

struct Measured {
  bool fits = true;
  int64_t peak = 0;    // the largest tracker peak over the timed steps
  double seconds = 0;  // median of the timed steps
  std::string error;   // a failure other than running out of memory (first line)
};

// One warm-up step (it creates AdamW's state), then `steps` timed steps, all under `budget`.
Measured measure(Workload& w, const Batch& data, const StepOptions& so, MemoryTracker& tracker, int64_t budget,
                 int steps) {
  Measured r;
  auto params = w.chain->parameters();
  torch::optim::AdamW optimizer(params, torch::optim::AdamWOptions(1e-3));
  std::vector<double> times;
  BudgetGuard guard(budget);
  try {
    for (int s = 0; s <= steps; ++s) {
      tracker.reset_peak();
      const auto t0 = std::chrono::steady_clock::now();
      train_step(w, optimizer, data, so);
      if (s == 0) continue;
      times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      r.peak = std::max(r.peak, tracker.peak(MemoryDevice::kCPU));
    }
  } catch (const c10::OutOfMemoryError&) {
    zero_grad(params, true);  // the failed step's partial gradients
    r.fits = false;
    return r;
  } catch (const std::exception& e) {  // e.g. an op autocast cannot run in this precision
    zero_grad(params, true);
    r.fits = false;
    const std::string what = e.what();
    r.error = what.substr(0, what.find('\n'));
    return r;
  }
  std::sort(times.begin(), times.end());
  r.seconds = times[times.size() / 2];
  return r;
}

std::string describe(const Plan& p) {
  return std::to_string(p.config.micro_batch_size()) + "x" + std::to_string(p.config.accumulation()) + ", " +
         precision_name(p.config.precision) + ", recompute " + p.config.checkpoint.describe();
}

int64_t parse_int(const std::string& flag, const std::string& text) {
  size_t used = 0;
  long long v = 0;
  try {
    v = std::stoll(text, &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != text.size() || v < 0) throw std::invalid_argument("invalid " + flag + " '" + text + "': expected a non-negative integer");
  return v;
}

struct Args {
  ModelOptions model;
  std::string data_file, loss = "cross-entropy";  // a TorchScript --model
  int64_t batch = 16;
  int threads = 2, steps = 5;
  std::vector<int64_t> budgets;
  bool plain_only = false;  // --plain-only 1: the plain row alone (the driver's base comparison)
};

Args parse(int argc, char** argv) {
  Args a;
  for (int i = 1; i < argc; i += 2) {
    const std::string k = argv[i];
    if (i + 1 >= argc) throw std::invalid_argument(k + " needs a value");
    const std::string v = argv[i + 1];
    if (k == "--model") a.model.model = v;
    else if (k == "--layers") a.model.gpt.layers = parse_int(k, v);
    else if (k == "--d-model") a.model.gpt.d_model = parse_int(k, v);
    else if (k == "--heads") a.model.gpt.heads = parse_int(k, v);
    else if (k == "--seq") a.model.gpt.seq = parse_int(k, v);
    else if (k == "--dropout") a.model.gpt.dropout = std::stod(v);
    else if (k == "--blocks") a.model.cnn.blocks = parse_int(k, v);
    else if (k == "--channels") a.model.cnn.channels = parse_int(k, v);
    else if (k == "--data") a.data_file = v;
    else if (k == "--loss") a.loss = v;
    else if (k == "--seed") a.model.seed = static_cast<uint64_t>(parse_int(k, v));
    else if (k == "--batch") a.batch = parse_int(k, v);
    else if (k == "--threads") a.threads = static_cast<int>(parse_int(k, v));
    else if (k == "--steps") a.steps = static_cast<int>(parse_int(k, v));
    else if (k == "--plain-only") a.plain_only = parse_int(k, v) != 0;
    else if (k == "--budgets") {
      std::stringstream ss(v);
      for (std::string item; std::getline(ss, item, ',');) a.budgets.push_back(parse_int(k, item));
    } else {
      throw std::invalid_argument("unknown flag " + k);
    }
  }
  if (a.model.model != "gpt" && a.model.model != "cnn" && a.data_file.empty()) {
    throw std::invalid_argument("--model must be gpt, cnn, or a TorchScript file with --data");
  }
  if (a.batch < 1 || a.threads < 1 || a.steps < 1) throw std::invalid_argument("--batch, --threads and --steps must be >= 1");
  return a;
}

bool is_script(const Args& a) { return !a.data_file.empty(); }

Workload load_workload(const Args& a) {
  if (!is_script(a)) return make_workload(a.model);
  ScriptWorkloadOptions o;
  o.model_file = a.model.model;
  o.data_file = a.data_file;
  o.loss = parse_loss_kind(a.loss);
  o.seed = a.model.seed;
  return load_script_workload(o);
}

}  // namespace

int main(int argc, char** argv) {
  Args args;
  try {
    args = parse(argc, argv);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "vs_pytorch_memfit: %s\n", e.what());
    return 2;
  }
  BudgetAllocator::install();  // before any tensor exists, so every byte is counted
  at::set_num_threads(args.threads);
  std::shared_ptr<MemoryTracker> tracker;
  std::optional<TrackerScope> scope;
  Workload w;
  int64_t outside_budget = 0;  // a TorchScript model's data tensors (see the top)
  try {
    if (!is_script(args)) tracker = std::make_shared<MemoryTracker>(), scope.emplace(tracker);
    w = load_workload(args);
    if (is_script(args)) {
      tracker = std::make_shared<MemoryTracker>();
      scope.emplace(tracker);
      adopt_tensors(*tracker, w.chain->parameters());
      adopt_tensors(*tracker, w.chain->buffers());
      outside_budget = BudgetAllocator::install().allocated() - tracker->current(MemoryDevice::kCPU);
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "vs_pytorch_memfit: %s\n", e.what());
    return 2;
  }
  const Batch data = w.data->train_batch(0, args.batch, 0);
  int64_t weight_bytes = 0;
  for (const auto& p : w.chain->parameters()) weight_bytes += static_cast<int64_t>(p.storage().nbytes());

  std::string command = argv[0];
  for (int i = 1; i < argc; ++i) command += std::string(" ") + argv[i];
  const nlohmann::json common = {{"side", "memfit"},
                                 {"model", w.name},
                                 {"description", w.description},
                                 {"parameters", parameter_count(*w.chain)},
                                 {"weight_bytes", weight_bytes},
                                 {"batch", args.batch},
                                 {"threads", args.threads},
                                 {"steps", args.steps},
                                 {"outside_budget_bytes", outside_budget},
                                 {"command", command}};
  auto emit = [&](const std::string& variant, int64_t budget, const Plan* plan, const Measured& m, int attempts) {
    nlohmann::json j = common;
    j["variant"] = variant;
    j["attempts"] = attempts;
    j["budget_bytes"] = budget > 0 ? nlohmann::json(budget) : nlohmann::json(nullptr);
    j["feasible"] = plan == nullptr || plan->feasible;
    if (plan != nullptr) j["notes"] = plan->notes;
    if (plan != nullptr && plan->feasible) {
      j["plan"] = describe(*plan);
      j["predicted_peak_bytes"] = plan->predicted_peak;
      j["predicted_time_ratio"] = plan->plain_predicted_seconds > 0 ? plan->predicted_seconds / plan->plain_predicted_seconds : 0.0;
    } else if (plan != nullptr) {
      j["plan"] = "infeasible: floor " + std::to_string(plan->floor_bytes) + " bytes";
      j["floor_bytes"] = plan->floor_bytes;
    } else {
      j["plan"] = "whole batch, fp32, nothing recomputed";
    }
    const bool ran = plan == nullptr || plan->feasible;
    j["fits"] = ran && m.fits && (budget <= 0 || m.peak <= budget);
    j["peak_bytes"] = ran && m.fits ? nlohmann::json(m.peak) : nlohmann::json(nullptr);
    j["median_step_s"] = ran && m.fits ? nlohmann::json(m.seconds) : nlohmann::json(nullptr);
    std::printf("%s\n", j.dump().c_str());
    std::fflush(stdout);
  };

  // The plain step first: it is memfit's own eager baseline.
  StepConfig plain;
  plain.batch = args.batch;
  emit("plain", 0, nullptr, measure(w, data, StepOptions{plain}, *tracker, BudgetAllocator::kUnlimited, args.steps), 1);
  if (args.plain_only) return 0;

  PlanRequest req;
  req.step = plain;
  const Planner planner = measure_and_plan(w, data, {Precision::kFP32}, req, *tracker);
  // A plan that runs out of memory under its budget is planned again for 5% less, up to three
  // attempts, and run under the real budget: what verify_plan (memfit plan, memfit train) does.
  auto run_plan = [&](const std::string& variant, const Planner& pl, int64_t budget) {
    Plan p = pl.plan(budget);
    Measured m;
    std::vector<std::string> retries;
    for (int attempt = 1; p.feasible; ++attempt) {
      m = measure(w, data, StepOptions{p.config}, *tracker, budget + outside_budget, args.steps);
      if (m.fits || !m.error.empty() || attempt == 3) break;
      const auto tighter = static_cast<int64_t>(static_cast<double>(budget) * (1.0 - 0.05 * attempt));
      retries.push_back(describe(p) + " ran out of memory under the budget: planned again for " +
                        std::to_string(tighter) + " bytes");
      p = pl.plan(tighter);
    }
    p.notes.insert(p.notes.end(), retries.begin(), retries.end());
    if (!m.error.empty()) p.notes.push_back(describe(p) + " failed: " + m.error);
    emit(variant, budget, &p, m, static_cast<int>(retries.size()) + 1);
  };
  for (int64_t budget : args.budgets) run_plan("fp32_plan", planner, budget);
  {
    // Mixed precision allowed: a Planner of its own, profiling bf16 too (a precision that fails
    // on the model, like 1.13's GroupNorm under CPU bf16 autocast, is dropped with a note).
    const Planner mixed_planner = measure_and_plan(w, data, {Precision::kFP32, Precision::kBF16}, req, *tracker);
    for (int64_t budget : args.budgets) run_plan("mixed_plan", mixed_planner, budget);
  }
  // Weights + gradients + AdamW's two moments, and 10% more: below anything a whole-batch
  // schedule reaches, since every one of them keeps some activations of all the samples.
  run_plan("microbatch", planner, static_cast<int64_t>(1.1 * static_cast<double>(4 * weight_bytes)));
  return 0;
}
