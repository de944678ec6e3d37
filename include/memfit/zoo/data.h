// data.h — the built-in data sets: the King James Bible (character level) and Fashion-MNIST,
// both from Debian packages, and any text file.
//
// Batches are a pure function of (seed, index): the same seed and batch index give the same
// batch, so a resumed run continues the exact stream by remembering one integer.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "memfit/runtime/dataset.h"

namespace memfit {

// Characters of a text as tokens; windows of `seq` characters predict the next character.
// The last 10% of the text is the held-out split. With 0 < shortest < seq, each training batch
// is as long as a DataLoader padding to its longest sequence makes it: a length drawn from
// shortest to seq per batch (deterministic in its seed and index); plans are made on seq.
class TextDataset : public Dataset {
 public:
  TextDataset(const std::string& text, int64_t seq, std::string source, int64_t shortest = 0);
  std::string describe() const override;
  Batch train_batch(int64_t index, int64_t batch_size, uint64_t seed) const override;
  Batch plan_batch(int64_t index, int64_t batch_size, uint64_t seed) const override;
  bool lengths_vary() const override { return shortest_ > 0 && shortest_ < seq_; }
  Batch eval_batch(int64_t index, int64_t batch_size) const override;
  int64_t eval_batch_count(int64_t batch_size) const override;
  int64_t vocab_size() const { return static_cast<int64_t>(vocab_.size()); }
  int64_t seq() const { return seq_; }
  std::string decode(const at::Tensor& tokens) const;

 private:
  Batch windows(const at::Tensor& tokens, const at::Tensor& starts) const;
  Batch random_windows(at::Generator& gen, int64_t batch_size) const;  // seq long
  std::string vocab_;    // sorted distinct characters; token id = position
  std::string source_;
  at::Tensor train_, eval_;  // int64 token ids
  int64_t seq_;
  int64_t shortest_;  // 0: every batch seq long
};

// Fashion-MNIST, 60000 train / 10000 test 28x28 images, scaled to [0, 1] and normalized.
class FashionMnistDataset : public Dataset {
 public:
  explicit FashionMnistDataset(const std::string& directory);
  std::string describe() const override;
  Batch train_batch(int64_t index, int64_t batch_size, uint64_t seed) const override;
  Batch eval_batch(int64_t index, int64_t batch_size) const override;
  int64_t eval_batch_count(int64_t batch_size) const override;

 private:
  std::string directory_;
  at::Tensor train_images_, train_labels_, test_images_, test_labels_;
};

// The text of the King James Bible (gen1:1 to rev22:21 from Debian's bible-kjv, verse
// references removed), cached once under $MEMFIT_CACHE or ~/.cache/memfit. Throws with a
// clear message if the reader is not installed.
std::string load_bible_text();
// A whole text file; throws std::runtime_error naming the path if it cannot be read or is empty.
std::string read_text_file(const std::string& path);
// Where Debian's dataset-fashion-mnist puts the files.
std::string default_fashion_mnist_dir();

}  // namespace memfit
