// 8-bit optimizer state (issue 15), accuracy parity: the reference CNN trained on Fashion-MNIST
// for one epoch (60000 samples) with fp32 AdamW and with blockwise 8-bit AdamW, the same seed,
// weights and batches, then its test accuracy on the 10000 test images. Goal: within 1 point.
//
//   source bench/harness/quiet_env.sh && ./build/bench/optimizer_8bit_parity [--epochs-share F] [--threads N]
//        [--batch N] [--states fp32,8bit]
#include <torch/torch.h>

#include <chrono>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include "memfit/memfit.h"
#include "memfit/zoo/workloads.h"

using namespace memfit;

namespace {

// Share of the test set classified right, in inference mode, batches of 500.
double test_accuracy(Workload& w) {
  c10::InferenceMode guard;
  w.chain->eval();
  int64_t right = 0, total = 0;
  for (int64_t i = 0; i < w.data->eval_batch_count(500); ++i) {
    const Batch b = w.data->eval_batch(i, 500);
    right += w.chain->forward(b.input).argmax(1).eq(b.target).sum().item<int64_t>();
    total += b.target.size(0);
  }
  w.chain->train();
  return static_cast<double>(right) / static_cast<double>(total);
}

struct Outcome {
  double accuracy = 0, last_loss = 0, seconds = 0;
};

Outcome train_one(StatePrecision state, int64_t steps, int64_t batch) {
  ModelOptions m;
  m.model = "cnn";
  Workload w = make_workload(m);
  OptimizerSpec spec;
  spec.state = state;
  auto optimizer = make_optimizer(spec, w.chain->parameters());
  StepConfig config;
  config.batch = batch;
  config.optimizer = spec;
  const StepOptions so{config};
  torch::manual_seed(w.seed);
  const auto t0 = std::chrono::steady_clock::now();
  Outcome out;
  for (int64_t s = 0; s < steps; ++s) out.last_loss = train_step(w, *optimizer, w.data->train_batch(s, batch, w.seed), so).loss;
  out.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  out.accuracy = test_accuracy(w);
  return out;
}

}  // namespace

int main(int argc, char** argv) {
  BudgetAllocator::install();
  int threads = 2;
  int64_t batch = 16;
  double epochs = 1.0;
  std::string states = "fp32,8bit";
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--threads") threads = std::stoi(v);
    else if (k == "--batch") batch = std::stoll(v);
    else if (k == "--epochs-share") epochs = std::stod(v);
    else if (k == "--states") states = v;
    else { std::fprintf(stderr, "optimizer_8bit_parity: unknown flag %s\n", argv[i]); return 2; }
  }
  at::set_num_threads(threads);
  const auto steps = static_cast<int64_t>(epochs * 60000.0 / static_cast<double>(batch));
  std::printf("command: %s", argv[0]);
  for (int i = 1; i < argc; ++i) std::printf(" %s", argv[i]);
  std::printf("\ncnn on Fashion-MNIST, AdamW lr 0.001, batch %lld, %lld steps, %d threads\n",
              static_cast<long long>(batch), static_cast<long long>(steps), threads);
  std::stringstream list(states);
  for (std::string name; std::getline(list, name, ',');) {
    const Outcome o = train_one(parse_state_precision(name), steps, batch);
    std::printf("state %-5s test accuracy %.4f  last training loss %.4f  (%.0f s)\n", name.c_str(), o.accuracy,
                o.last_loss, o.seconds);
    std::fflush(stdout);
  }
  return 0;
}
