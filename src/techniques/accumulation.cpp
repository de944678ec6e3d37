#include "memfit/techniques/accumulation.h"

#include <stdexcept>
#include <string>

#include "memfit/errors.h"

namespace memfit {

std::vector<MicroBatch> split_batch(int64_t batch, int64_t micro_batch) {
  check_option(batch >= 1, "batch", batch, "expected >= 1");
  check_option(micro_batch >= 1 && micro_batch <= batch, "micro_batch", micro_batch,
               "expected 1 to the batch size " + std::to_string(batch));
  std::vector<MicroBatch> out;
  for (int64_t start = 0; start < batch; start += micro_batch) {
    const int64_t length = std::min(micro_batch, batch - start);
    out.push_back({start, length, static_cast<double>(length) / static_cast<double>(batch)});
  }
  return out;
}

std::vector<MicroBatch> split_in_two(const MicroBatch& mb, int64_t batch) {
  if (mb.length < 2) throw std::invalid_argument("a micro-batch of one sample cannot be split");
  const int64_t first = (mb.length + 1) / 2;
  const int64_t second = mb.length - first;
  return {{mb.start, first, static_cast<double>(first) / static_cast<double>(batch)},
          {mb.start + first, second, static_cast<double>(second) / static_cast<double>(batch)}};
}

}  // namespace memfit
