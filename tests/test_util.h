// Shared helpers for the torch tests: small reference workloads and a tracker per test.
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "memfit/memfit.h"
#include "memfit/zoo/workloads.h"

namespace memfit::test {

// A GPT small enough for 2 cores, with 6 layers (14 blocks) and dropout on.
inline ModelOptions small_gpt(uint64_t seed = 0) {
  ModelOptions o;
  o.model = "gpt";
  o.gpt.layers = 6;
  o.gpt.d_model = 64;
  o.gpt.heads = 4;
  o.gpt.seq = 64;
  o.gpt.dropout = 0.1;
  o.seed = seed;
  return o;
}

// The counted device of the CPU, where these tests run: kCPU, or kCUDA in the counted-as-CUDA
// mode (MEMFIT_COUNT_CPU_AS=cuda: memory_tracker.h), under which the suite's plan, train and
// report tests run a second time with the same numbers.
inline MemoryDevice cpu_counted() { return memory_device_of(c10::Device(c10::kCPU)); }

// Installs memfit's allocator once per process, so every test counts through the same path
// as the CLI.
inline void use_memfit_allocator() { BudgetAllocator::install(); }

// `memfit report` on a freshly built workload, as the CLI runs it.
inline Report report_of(const ModelOptions& model, const ReportOptions& options) {
  use_memfit_allocator();
  Workload w = make_workload(model);
  return run_report(w, options);
}

// Report options for `batch` samples per step over `steps` steps (AdamW, fp32, nothing recomputed).
inline ReportOptions report_options(int64_t batch, int64_t steps = 3) {
  ReportOptions o;
  o.step.batch = batch;
  o.steps = steps;
  return o;
}

// Copies of all .grad tensors (undefined where a parameter has none).
inline std::vector<at::Tensor> grads_of(const torch::nn::Module& m) {
  std::vector<at::Tensor> out;
  for (const auto& p : m.parameters()) out.push_back(p.grad().defined() ? p.grad().clone() : at::Tensor());
  return out;
}

inline double max_relative_difference(const std::vector<at::Tensor>& a, const std::vector<at::Tensor>& b) {
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double scale = std::max(a[i].abs().max().item<double>(), 1e-12);
    worst = std::max(worst, (a[i] - b[i]).abs().max().item<double>() / scale);
  }
  return worst;
}

}  // namespace memfit::test
