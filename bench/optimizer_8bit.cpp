// 8-bit optimizer state (issue 15): the optimizer phase and the whole step of the reference
// GPT with fp32 AdamW vs blockwise 8-bit AdamW, alternating in rounds (the same weights and
// batch for both), medians. Goals: optimizer phase <= 2x fp32's, whole step <= 1.05x.
//
//   source bench/harness/quiet_env.sh && ./build/bench/optimizer_8bit [--rounds N] [--threads N] [--batch N]
//        [--layers N --d-model N --seq N]
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "memfit/memfit.h"
#include "memfit/zoo/workloads.h"

using namespace memfit;

namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

struct Side {
  Workload workload;
  std::unique_ptr<torch::optim::Optimizer> optimizer;
  std::vector<double> optimizer_seconds, step_seconds;
};

// One step: forward + backward of the whole batch, then the optimizer step (timed apart).
void timed_step(Side& side, const Batch& batch, const StepOptions& so) {
  const auto t0 = std::chrono::steady_clock::now();
  forward_backward(side.workload, batch, 1.0, so);
  const auto t1 = std::chrono::steady_clock::now();
  optimizer_step(*side.optimizer, so);
  side.optimizer_seconds.push_back(seconds_since(t1));
  side.step_seconds.push_back(seconds_since(t0));
}

}  // namespace

int main(int argc, char** argv) {
  BudgetAllocator::install();
  ModelOptions m;
  int rounds = 9, threads = 2;
  int64_t batch = 16;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    const long long v = std::atoll(argv[i + 1]);
    if (k == "--rounds") rounds = static_cast<int>(v);
    else if (k == "--threads") threads = static_cast<int>(v);
    else if (k == "--layers") m.gpt.layers = v;
    else if (k == "--d-model") m.gpt.d_model = v;
    else if (k == "--seq") m.gpt.seq = v;
    else if (k == "--batch") batch = v;
    else { std::fprintf(stderr, "optimizer_8bit: unknown flag %s\n", argv[i]); return 2; }
  }
  at::set_num_threads(threads);
  OptimizerSpec fp32_spec, q8_spec;
  q8_spec.state = StatePrecision::k8Bit;
  Side sides[2] = {{make_workload(m), nullptr, {}, {}}, {make_workload(m), nullptr, {}, {}}};
  sides[0].optimizer = make_optimizer(fp32_spec, sides[0].workload.chain->parameters());
  sides[1].optimizer = make_optimizer(q8_spec, sides[1].workload.chain->parameters());
  const Batch data = sides[0].workload.data->train_batch(0, batch, 0);
  StepConfig config;
  config.batch = batch;
  const StepOptions so{config};
  for (auto& side : sides) timed_step(side, data, so);  // warm-up: the state is made
  for (auto& side : sides) side.optimizer_seconds.clear(), side.step_seconds.clear();
  for (int r = 0; r < rounds; ++r) {
    for (int s = 0; s < 2; ++s) timed_step(sides[(r + s) % 2], data, so);  // alternating, first one swapped each round
  }
  std::printf("command: %s", argv[0]);
  for (int i = 1; i < argc; ++i) std::printf(" %s", argv[i]);
  std::printf("\n%s, batch %lld, %d threads, %d rounds (alternating)\n", sides[0].workload.description.c_str(),
              static_cast<long long>(batch), threads, rounds);
  const double o32 = median(sides[0].optimizer_seconds), o8 = median(sides[1].optimizer_seconds);
  const double s32 = median(sides[0].step_seconds), s8 = median(sides[1].step_seconds);
  std::printf("median optimizer phase: fp32 AdamW %.4f s, 8-bit AdamW %.4f s: ratio %.2fx\n", o32, o8, o8 / o32);
  std::printf("median whole step:      fp32 AdamW %.4f s, 8-bit AdamW %.4f s: ratio %.3fx\n", s32, s8, s8 / s32);
  return 0;
}
