// memfit's plan vs uniform segment checkpointing (checkpoint_sequential style: S equal
// segments, all but the last recomputed; the best S that fits) at 90/70/50/35% of the plain
// step's measured peak. Peaks in exact bytes from the tracker; times as ratios of medians
// measured in this run.
//
//   ./build/bench/plan_vs_uniform [--model gpt|cnn] [--steps N] [--threads N]
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "memfit/memfit.h"

using namespace memfit;

namespace {

struct Measured {
  bool fits = true;
  int64_t peak = 0;
  double seconds = 0;  // median of steady-state steps
};

Measured measure(Workload& w, const Batch& data, const StepOptions& so, MemoryTracker& tracker, int64_t budget,
                 int steps) {
  Measured r;
  auto params = w.chain->parameters();
  torch::optim::AdamW optimizer(params, torch::optim::AdamWOptions(1e-3));
  std::vector<double> times;
  BudgetGuard guard(budget);
  try {
    for (int s = 0; s < steps + 1; ++s) {
      tracker.reset_peak();
      const auto t0 = std::chrono::steady_clock::now();
      train_step(w, optimizer, data, so);
      if (s == 0) continue;  // optimizer state appears in the first step
      times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      r.peak = std::max(r.peak, tracker.peak());
    }
  } catch (const c10::OutOfMemoryError&) {
    zero_grad(params, true);
    r.fits = false;
    return r;
  }
  std::sort(times.begin(), times.end());
  r.seconds = times[times.size() / 2];
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  BudgetAllocator::install();
  auto tracker = std::make_shared<MemoryTracker>();
  TrackerScope scope(tracker);
  ModelOptions m;
  int steps = 3, threads = 2;
  int64_t batch = 16;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    if (k == "--model") m.model = argv[i + 1];
    else if (k == "--steps") steps = std::atoi(argv[i + 1]);
    else if (k == "--threads") threads = std::atoi(argv[i + 1]);
    else if (k == "--batch") batch = std::atoll(argv[i + 1]);
    else { std::fprintf(stderr, "plan_vs_uniform: unknown flag %s\n", argv[i]); return 2; }
  }
  at::set_num_threads(threads);
  Workload w = make_workload(m);
  const Batch data = w.data->train_batch(0, batch, 0);
  PlanRequest req;
  req.batch = batch;
  Planner planner(w, data, req, *tracker);
  const int n = w.chain->size();

  StepOptions plain_options;
  const Measured plain = measure(w, data, plain_options, *tracker, BudgetAllocator::kUnlimited, steps);
  std::printf("command: %s", argv[0]);
  for (int i = 1; i < argc; ++i) std::printf(" %s", argv[i]);
  std::printf("\n%s; batch %lld, %d threads, medians of %d steps\n", w.description.c_str(),
              static_cast<long long>(batch), threads, steps);
  std::printf("plain step: peak %lld bytes (%s), %.3f s\n\n", static_cast<long long>(plain.peak),
              format_bytes(plain.peak).c_str(), plain.seconds);
  std::printf("| budget | memfit plan | predicted peak | measured peak | pred. err | time vs plain | uniform (S segments) | measured peak | time vs plain | memfit / uniform time |\n");
  std::printf("|---|---|---:|---:|---:|---:|---|---:|---:|---:|\n");
  for (int percent : {90, 70, 50, 35}) {
    const int64_t budget = plain.peak * percent / 100;
    Plan p = planner.plan(budget);
    Measured mine;
    std::string plan_text = "infeasible";
    if (p.feasible) {
      StepOptions so;
      so.micro_batch = p.micro_batch;
      so.checkpoint = p.checkpoint;
      mine = measure(w, data, so, *tracker, budget, steps);
      plan_text = std::to_string(p.micro_batch) + "x" + std::to_string(p.accumulation) + ", recompute " +
                  p.checkpoint.describe();
    }
    // Uniform: the fewest segments whose prediction fits, then measured; more if it does not fit.
    Measured uni;
    int chosen = 0;
    for (int s = 1; s <= n; ++s) {
      const Schedule sched = planner.uniform(batch, s);
      if (sched.peak_bytes > budget && s < n) continue;
      StepOptions so;
      so.checkpoint.segments = sched.segments;
      uni = measure(w, data, so, *tracker, budget, steps);
      if (uni.fits) {
        chosen = s;
        break;
      }
    }
    auto cell = [](const Measured& r) {
      return r.fits ? std::to_string(r.peak) : std::string("OOM");
    };
    const double err = mine.fits && mine.peak > 0
                           ? 100.0 * static_cast<double>(p.predicted_peak - mine.peak) / static_cast<double>(mine.peak)
                           : 0.0;
    std::printf("| %d%% (%s) | %s | %lld | %s | %+.1f%% | %.2fx | %s | %s | %s | %s |\n", percent,
                format_bytes(budget).c_str(), plan_text.c_str(), static_cast<long long>(p.predicted_peak),
                cell(mine).c_str(), err, mine.fits ? mine.seconds / plain.seconds : 0.0,
                chosen ? ("S=" + std::to_string(chosen)).c_str() : "none fits", cell(uni).c_str(),
                uni.fits && chosen ? (std::to_string(uni.seconds / plain.seconds).substr(0, 4) + "x").c_str() : "-",
                mine.fits && uni.fits && chosen ? (std::to_string(mine.seconds / uni.seconds).substr(0, 4) + "x").c_str() : "-");
    std::fflush(stdout);
  }
  return 0;
}
