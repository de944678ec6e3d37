// memfit's plan vs uniform segment checkpointing (checkpoint_sequential style: S equal
// segments, all but the last recomputed; the best S that fits) at 90/70/50/35% of the plain
// step's measured peak. Peaks in exact bytes from the tracker; times as ratios of medians
// measured in this run.
//
//   source bench/harness/quiet_env.sh   # OpenMP wait policy and malloc settings: see there
//   ./build/bench/plan_vs_uniform [--model gpt|cnn] [--batch N] [--rounds R] [--steps N] [--threads N]
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "memfit/memfit.h"
#include "memfit/zoo/workloads.h"

using namespace memfit;

namespace {

struct Measured {
  bool fits = true;
  int64_t peak = 0;
  std::vector<double> times;  // timed steps of every round
  double median() const {
    std::vector<double> t = times;
    std::sort(t.begin(), t.end());
    return t.empty() ? 0.0 : t[t.size() / 2];
  }
};

// One round: a fresh AdamW, one untimed step (its optimizer state appears), then `steps`
// timed steps, all under `budget`. Rounds of the variants being compared alternate, so slow
// spells of this shared machine fall on all of them alike.
void round(Workload& w, const Batch& data, const StepOptions& so, MemoryTracker& tracker, int64_t budget, int steps,
           Measured& r) {
  if (!r.fits) return;
  auto params = w.chain->parameters();
  torch::optim::AdamW optimizer(params, torch::optim::AdamWOptions(1e-3));
  BudgetGuard guard(budget);
  try {
    for (int s = 0; s < steps + 1; ++s) {
      tracker.reset_peak();
      const auto t0 = std::chrono::steady_clock::now();
      train_step(w, optimizer, data, so);
      if (s == 0) continue;
      r.times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      r.peak = std::max(r.peak, tracker.peak(MemoryDevice::kCPU));
    }
  } catch (const c10::OutOfMemoryError&) {
    zero_grad(params, true);
    r.fits = false;
  }
}

}  // namespace

int main(int argc, char** argv) {
  BudgetAllocator::install();
  auto tracker = std::make_shared<MemoryTracker>();
  TrackerScope scope(tracker);
  ModelOptions m;
  int steps = 2, threads = 2, rounds = 3;
  int64_t batch = 16;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    if (k == "--model") m.model = argv[i + 1];
    else if (k == "--steps") steps = std::atoi(argv[i + 1]);
    else if (k == "--threads") threads = std::atoi(argv[i + 1]);
    else if (k == "--rounds") rounds = std::atoi(argv[i + 1]);
    else if (k == "--batch") batch = std::atoll(argv[i + 1]);
    else { std::fprintf(stderr, "plan_vs_uniform: unknown flag %s\n", argv[i]); return 2; }
  }
  at::set_num_threads(threads);
  Workload w = make_workload(m);
  const Batch data = w.data->train_batch(0, batch, 0);
  PlanRequest req;
  req.step.batch = batch;
  const Planner planner = measure_and_plan(w, data, {Precision::kFP32}, req, *tracker);
  const int n = w.chain->size();

  StepConfig plain_config;
  plain_config.batch = batch;
  const StepOptions plain_options{plain_config};
  const char* wait = std::getenv("OMP_WAIT_POLICY");
  std::printf("command: %s", wait ? "source bench/harness/quiet_env.sh && " : "");
  std::printf("%s", argv[0]);
  for (int i = 1; i < argc; ++i) std::printf(" %s", argv[i]);
  std::printf("\n%s; batch %lld, %d threads; per budget, %d alternating rounds of plain / memfit / uniform, "
              "each 1 untimed + %d timed steps; times are medians\n\n",
              w.description.c_str(), static_cast<long long>(batch), threads, rounds, steps);
  Measured plain_peak;
  round(w, data, plain_options, *tracker, BudgetAllocator::kUnlimited, 1, plain_peak);
  std::printf("plain step: peak %lld bytes (%s)\n\n", static_cast<long long>(plain_peak.peak), format_bytes(plain_peak.peak).c_str());
  std::printf("| budget | memfit plan | predicted peak | measured peak | pred. err | time vs plain | uniform (S segments) | measured peak | time vs plain | memfit / uniform time |\n");
  std::printf("|---|---|---:|---:|---:|---:|---|---:|---:|---:|\n");
  for (int percent : {90, 70, 50, 35}) {
    const int64_t budget = plain_peak.peak * percent / 100;
    Plan p = planner.plan(budget);
    StepOptions mine_options{plain_config};
    std::string plan_text = "infeasible";
    if (p.feasible) {
      mine_options.config = p.config;
      plan_text = std::to_string(p.config.micro_batch_size()) + "x" + std::to_string(p.config.accumulation()) +
                  ", recompute " + p.config.checkpoint.describe();
    }
    // Uniform: the fewest segments whose prediction fits and whose one-step run fits.
    StepOptions uni_options{plain_config};
    int chosen = 0;
    for (int s = 1; s <= n && chosen == 0; ++s) {
      const Schedule sched = planner.uniform(batch, s);
      if (sched.peak_bytes > budget && s < n) continue;
      StepOptions so{plain_config};
      so.config.checkpoint.segments = sched.segments;
      Measured probe;
      round(w, data, so, *tracker, budget, 1, probe);
      if (probe.fits) {
        chosen = s;
        uni_options = so;
      }
    }
    Measured plain, mine, uni;
    mine.fits = p.feasible;
    uni.fits = chosen > 0;
    for (int r = 0; r < rounds; ++r) {
      round(w, data, plain_options, *tracker, BudgetAllocator::kUnlimited, steps, plain);
      round(w, data, mine_options, *tracker, budget, steps, mine);
      round(w, data, uni_options, *tracker, budget, steps, uni);
    }
    auto cell = [](const Measured& r) { return r.fits ? std::to_string(r.peak) : std::string("OOM"); };
    auto ratio = [](double a, double b) {
      char buf[32];
      std::snprintf(buf, sizeof buf, "%.2fx", a / b);
      return std::string(buf);
    };
    const double err = mine.fits && mine.peak > 0
                           ? 100.0 * static_cast<double>(p.predicted_peak - mine.peak) / static_cast<double>(mine.peak)
                           : 0.0;
    std::printf("| %d%% (%s) | %s | %lld | %s | %+.1f%% | %s | %s | %s | %s | %s |\n", percent,
                format_bytes(budget).c_str(), plan_text.c_str(), static_cast<long long>(p.predicted_peak),
                cell(mine).c_str(), err, mine.fits ? ratio(mine.median(), plain.median()).c_str() : "-",
                chosen ? ("S=" + std::to_string(chosen)).c_str() : "none fits", cell(uni).c_str(),
                uni.fits ? ratio(uni.median(), plain.median()).c_str() : "-",
                mine.fits && uni.fits ? ratio(mine.median(), uni.median()).c_str() : "-");
    std::fflush(stdout);
  }
  return 0;
}
