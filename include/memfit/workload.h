// workload.h — a model, its data and its loss, built from command-line-like options. The unit
// that `memfit report`, `plan` and `train` (and the tests) run.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include "memfit/chain.h"
#include "memfit/data.h"
#include "memfit/models.h"

namespace memfit {

struct ModelOptions {
  std::string model = "gpt";  // gpt | cnn | mlp
  GptConfig gpt;              // gpt.vocab is taken from the data
  CnnConfig cnn;
  MlpConfig mlp;
  std::string data_file;      // gpt: any text file instead of the Bible
  uint64_t seed = 0;          // initial weights (and, in training, batches and dropout)
};

using LossFn = std::function<at::Tensor(const at::Tensor& output, const at::Tensor& target)>;

struct Workload {
  std::string model_name;
  std::string description;  // "gpt: 8 layers, d=256, 8 heads, seq 128; King James Bible, ..."
  std::shared_ptr<Chain> chain;
  std::shared_ptr<Dataset> data;
  LossFn loss;              // mean over samples (and tokens)
  int64_t sample_tokens = 1;  // tokens per sample (seq for text), for throughput
};

// Seeds LibTorch's generator with options.seed, then builds the model. Throws
// std::invalid_argument (bad option, one line naming it) or std::runtime_error (missing data).
Workload make_workload(const ModelOptions& options);

}  // namespace memfit
