// workload.h — what memfit trains, reports on and plans for: a model as a Chain of blocks,
// the data it learns from and the loss it minimizes. Any model and data can be one; the
// built-in GPT/CNN/MLP are one way to make it (zoo/workloads.h).
//
//   memfit::Workload w;
//   w.chain = my_chain;                                    // runtime/chain.h
//   w.data = std::make_shared<MyDataset>(...);             // runtime/dataset.h
//   w.loss = [](const at::Tensor& out, const at::Tensor& y) { return at::mse_loss(out, y); };
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "memfit/runtime/chain.h"
#include "memfit/runtime/dataset.h"

namespace memfit {

// The mean loss over the samples (and tokens) of `output` against `target`.
using LossFn = std::function<at::Tensor(const at::Tensor& output, const at::Tensor& target)>;

struct Workload {
  std::string name;            // "gpt", a file name, ...: saved state must match it to resume
  std::string description;     // one line, e.g. "gpt: 8 layers, d=256, ...; King James Bible, ..."
  std::shared_ptr<Chain> chain;
  std::shared_ptr<Dataset> data;
  LossFn loss;
  uint64_t seed = 0;           // the batch stream and dropout (the weights are the caller's)
  int64_t sample_tokens = 1;   // tokens per sample (seq for text), for throughput
  // What the costs depend on besides the blocks' shapes and the program's code (a TorchScript
  // file's sha256 and the loss): the profile cache keys on it (plan/profile_cache.h).
  std::string fingerprint;
  std::vector<std::string> notes;  // said once when the workload is used (e.g. "runs as one block")
  // Optional: writes the trained model to a file in the workload's own format (a TorchScript
  // file for a model that came as one); the trainer writes DIR/model.pt with it on --save.
  std::function<void(const std::string& path)> save_model;
};

// Throws memfit::OptionError unless chain (with at least one block), data and loss are set.
void check_workload(const Workload& workload);

// Number of scalar parameters, and their bytes.
int64_t parameter_count(const torch::nn::Module& module);
int64_t parameter_bytes(const torch::nn::Module& module);

}  // namespace memfit
