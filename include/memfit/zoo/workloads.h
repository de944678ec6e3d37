// workloads.h — the built-in workloads (GPT on the Bible, CNN and MLP on Fashion-MNIST),
// built from command-line-like options: demos and test subjects, one way to make a Workload.
#pragma once

#include <string>

#include "memfit/runtime/workload.h"
#include "memfit/zoo/data.h"
#include "memfit/zoo/models.h"

namespace memfit {

struct ModelOptions {
  std::string model = "gpt";  // gpt | cnn | mlp
  GptConfig gpt;              // gpt.vocab is taken from the data
  CnnConfig cnn;
  MlpConfig mlp;
  std::string data_file;      // gpt: any text file instead of the Bible
  int64_t shortest = 0;       // gpt: each training batch shortest to gpt.seq long (0: all gpt.seq)
  uint64_t seed = 0;          // initial weights, and the workload's batch stream and dropout
};

// Seeds LibTorch's generator with options.seed, then builds the model. Throws OptionError
// (a bad option, named) or std::runtime_error (missing data).
Workload make_workload(const ModelOptions& options);

}  // namespace memfit
