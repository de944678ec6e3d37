// Tracker overhead: step time of the reference GPT with and without a MemoryTracker installed,
// interleaved in the same run, medians of several steps. Goal: <= 2% of step time.
//
//   ./build/bench/tracker_overhead [--steps N] [--threads N] [--precision fp32|bf16] [--layers N --d-model N ...]
//
// --tracked 0|1 runs one warm-up step and then --steps steps, all without (0) or with (1) the
// tracker, and times nothing: bench/harness/tracker_instructions.sh counts their instructions under
// callgrind, which (unlike time) repeats exactly.
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "memfit/memfit.h"
#include "memfit/zoo/workloads.h"

using namespace memfit;

static double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

int main(int argc, char** argv) {
  BudgetAllocator::install();
  ModelOptions m;
  int steps = 7, threads = 2, tracked_only = -1;  // -1: interleaved timing
  int64_t batch = 16;
  Precision precision = Precision::kFP32;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    if (k == "--precision") {
      precision = parse_precision(argv[i + 1]);
      continue;
    }
    const long long v = std::atoll(argv[i + 1]);
    if (k == "--steps") steps = static_cast<int>(v);
    else if (k == "--threads") threads = static_cast<int>(v);
    else if (k == "--layers") m.gpt.layers = v;
    else if (k == "--d-model") m.gpt.d_model = v;
    else if (k == "--seq") m.gpt.seq = v;
    else if (k == "--batch") batch = v;
    else if (k == "--tracked") tracked_only = v != 0;
    else { std::fprintf(stderr, "tracker_overhead: unknown flag %s\n", argv[i]); return 2; }
  }
  at::set_num_threads(threads);
  Workload w = make_workload(m);
  torch::optim::AdamW optimizer(w.chain->parameters(), torch::optim::AdamWOptions(1e-3));
  const Batch data = w.data->train_batch(0, batch, 0);
  StepConfig config;
  config.batch = batch;
  config.precision = precision;
  const StepOptions so{config};
  auto tracker = std::make_shared<MemoryTracker>();
  std::vector<double> with, without;
  if (tracked_only >= 0) {  // for callgrind: the same steps, one way only
    std::optional<TrackerScope> scope;
    if (tracked_only) scope.emplace(tracker);
    for (int s = 0; s <= steps; ++s) train_step(w, optimizer, data, so);
    return 0;
  }
  train_step(w, optimizer, data, so);  // warm-up
  for (int s = 0; s < steps; ++s) {
    for (int tracked = 0; tracked < 2; ++tracked) {  // interleaved: drift hits both alike
      const auto t0 = std::chrono::steady_clock::now();
      if (tracked) {
        TrackerScope scope(tracker);
        train_step(w, optimizer, data, so);
      } else {
        train_step(w, optimizer, data, so);
      }
      const double secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      (tracked ? with : without).push_back(secs);
    }
  }
  const double a = median(without), b = median(with);
  std::printf("command: %s", argv[0]);
  for (int i = 1; i < argc; ++i) std::printf(" %s", argv[i]);
  std::printf("\n%s, batch %lld, %s, %d threads, %d steps each (interleaved)\n", w.description.c_str(),
              static_cast<long long>(batch), precision_name(precision), threads, steps);
  std::printf("median step without tracker: %.4f s\nmedian step with tracker:    %.4f s\n", a, b);
  std::printf("overhead: %+.2f%% (allocations seen per step: %lld)\n", 100.0 * (b - a) / a,
              static_cast<long long>(tracker->allocation_count() / steps));
  return 0;
}
