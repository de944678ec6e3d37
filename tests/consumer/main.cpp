// Uses the installed library: tracker + checkpoint on a tiny module; exits 0 when bytes add up.
#include <memfit/memfit.h>
#include <torch/torch.h>

#include <iostream>

int main() {
  auto tracker = std::make_shared<memfit::MemoryTracker>();
  memfit::TrackerScope scope(tracker);
  torch::nn::Linear linear(16, 16);
  auto x = torch::randn({8, 16});
  auto y = memfit::checkpoint([&](const at::Tensor& in) { return torch::relu(linear(in)); }, x,
                              linear->parameters());
  y.sum().backward();
  const bool ok = linear->weight.grad().defined() && tracker->peak() > 0;
  std::cout << "consumer: peak " << tracker->peak() << " bytes, " << (ok ? "ok" : "FAILED") << "\n";
  return ok ? 0 : 1;
}
