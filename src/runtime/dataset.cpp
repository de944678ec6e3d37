#include "memfit/runtime/dataset.h"

#include <ATen/CPUGeneratorImpl.h>

#include <cmath>

#include "memfit/errors.h"

namespace memfit {

at::Generator batch_generator(uint64_t seed, int64_t index) {
  // A distinct, reproducible stream per (seed, batch index).
  const uint64_t mixed = seed * 0x9E3779B97F4A7C15ULL + static_cast<uint64_t>(index) * 0xBF58476D1CE4E5B9ULL + 1;
  return at::make_generator<at::CPUGeneratorImpl>(mixed);
}

TensorDataset::TensorDataset(at::Tensor inputs, at::Tensor targets, std::string name, double eval_share)
    : inputs_(std::move(inputs)), targets_(std::move(targets)), name_(std::move(name)) {
  check_option(inputs_.dim() >= 1 && targets_.dim() >= 1 && inputs_.size(0) == targets_.size(0), "data",
               "'" + name_ + "'", "expected inputs and targets with the same number of samples along dimension 0");
  const int64_t n = inputs_.size(0);
  const auto held_out = static_cast<int64_t>(std::floor(eval_share * static_cast<double>(n)));
  train_samples_ = n - held_out;
  check_option(eval_share >= 0 && eval_share < 1 && held_out >= 1 && train_samples_ >= 1, "data", "'" + name_ + "'",
               "expected enough samples (" + std::to_string(n) + " given) to hold out a share of " +
                   std::to_string(eval_share) + " and train on the rest");
}

std::string TensorDataset::describe() const {
  return name_ + ", " + std::to_string(inputs_.size(0)) + " samples (" + std::to_string(inputs_.size(0) - train_samples_) +
         " held out)";
}

Batch TensorDataset::train_batch(int64_t index, int64_t batch_size, uint64_t seed) const {
  auto gen = batch_generator(seed, index);
  const at::Tensor idx = at::randint(0, train_samples_, {batch_size}, gen, at::TensorOptions().dtype(at::kLong));
  return {inputs_.index_select(0, idx), targets_.index_select(0, idx)};
}

int64_t TensorDataset::eval_batch_count(int64_t batch_size) const {
  return (inputs_.size(0) - train_samples_) / batch_size;
}

Batch TensorDataset::eval_batch(int64_t index, int64_t batch_size) const {
  const int64_t start = train_samples_ + index * batch_size;
  return {inputs_.narrow(0, start, batch_size), targets_.narrow(0, start, batch_size)};
}

}  // namespace memfit
