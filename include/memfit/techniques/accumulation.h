// accumulation.h — micro-batching with gradient accumulation.
//
// A batch of B samples runs as micro-batches of m (the last may be smaller). Each micro-batch's
// mean loss is weighted by its share of the samples, length / B, so the accumulated gradient
// equals the gradient of the full batch's mean loss (up to float rounding):
//
//   for (const auto& mb : memfit::split_batch(B, m)) {
//     auto out = model(x.narrow(0, mb.start, mb.length));
//     (loss_fn(out, y.narrow(0, mb.start, mb.length)) * mb.weight).backward();
//   }
//   optimizer.step();
//
// Activation memory then scales with m instead of B.
#pragma once

#include <cstdint>
#include <vector>

namespace memfit {

struct MicroBatch {
  int64_t start;   // first sample
  int64_t length;  // samples in this micro-batch
  double weight;   // length / batch: the factor for this micro-batch's mean loss
};

// Throws std::invalid_argument unless 1 <= micro_batch <= batch.
std::vector<MicroBatch> split_batch(int64_t batch, int64_t micro_batch);

// Splits one micro-batch into two halves (the first gets the extra sample), keeping weights
// relative to the same full batch: used to redo a micro-batch that ran out of memory.
std::vector<MicroBatch> split_in_two(const MicroBatch& mb, int64_t batch);

}  // namespace memfit
