// dataset.h — what a workload trains on: batches of (input, target) drawn by index.
//
// Batches are a pure function of (seed, index): the same seed and batch index give the same
// batch, so a resumed run continues the exact stream by remembering one integer. Samples lie
// along dimension 0 of both tensors.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <string>

namespace memfit {

struct Batch {
  at::Tensor input;   // text: [B, T] int64 token ids; images: [B, 1, 28, 28] float
  at::Tensor target;  // text: [B, T] int64 next tokens; images: [B] int64 labels
  int64_t size() const { return input.size(0); }
  Batch slice(int64_t start, int64_t length) const {
    return {input.narrow(0, start, length), target.narrow(0, start, length)};
  }
  // Both tensors on `device` (no copy when they are there already).
  Batch to(c10::Device device) const { return {input.to(device), target.to(device)}; }
  // Its length: dimension 1 of integer token ids ([B, T]); 0 for a batch without one (images).
  int64_t length() const {
    return input.dim() >= 2 && !at::isFloatingType(input.scalar_type()) ? input.size(1) : 0;
  }
  // Its first `length` positions (views): both tensors' dimension 1 where it is the batch's length.
  Batch cut(int64_t length) const {
    const int64_t t = this->length();
    const auto cut_one = [&](const at::Tensor& x) { return x.dim() >= 2 && x.size(1) == t ? x.narrow(1, 0, length) : x; };
    return {cut_one(input), cut_one(target)};
  }
};

class Dataset {
 public:
  virtual ~Dataset() = default;
  virtual std::string describe() const = 0;
  // A training batch of `batch_size` random samples; deterministic in (seed, index).
  virtual Batch train_batch(int64_t index, int64_t batch_size, uint64_t seed) const = 0;
  // The batch a plan is made on: the longest one the data gives (where batches differ in
  // length, each is planned from its shape before it runs: plan/batch_shape.h). By default the
  // training batch `index`.
  virtual Batch plan_batch(int64_t index, int64_t batch_size, uint64_t seed) const {
    return train_batch(index, batch_size, seed);
  }
  // Whether training batches differ in length: the Trainer then profiles the plan's precision at
  // shorter lengths too, to plan each batch (it does not where every batch has the plan's shape).
  virtual bool lengths_vary() const { return false; }
  // The held-out split, in fixed order: batch `index` of `eval_batch_count(batch_size)`.
  virtual Batch eval_batch(int64_t index, int64_t batch_size) const = 0;
  virtual int64_t eval_batch_count(int64_t batch_size) const = 0;
};

// A reproducible random stream for batch `index` of the stream seeded `seed`: the same pair
// gives the same draws, different pairs independent ones.
at::Generator batch_generator(uint64_t seed, int64_t index);

// Samples held in two tensors (samples along dimension 0 of both): the last `eval_share` of
// them held out for evaluation, in order; training batches drawn at random from the rest.
//
//   auto data = std::make_shared<memfit::TensorDataset>(inputs, targets, "my data");
class TensorDataset : public Dataset {
 public:
  // Throws OptionError unless both have the same number of samples (>= 2) and the held-out
  // share leaves at least one sample on each side.
  TensorDataset(at::Tensor inputs, at::Tensor targets, std::string name, double eval_share = 0.1);
  std::string describe() const override;
  Batch train_batch(int64_t index, int64_t batch_size, uint64_t seed) const override;
  Batch eval_batch(int64_t index, int64_t batch_size) const override;
  int64_t eval_batch_count(int64_t batch_size) const override;

 private:
  at::Tensor inputs_, targets_;
  std::string name_;
  int64_t train_samples_ = 0;
};

}  // namespace memfit
