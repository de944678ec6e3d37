// The Strategy base and what data-parallel strategies share (the list of strategies is
// strategy_registry.cpp's).
#include "memfit/train/strategy.h"

#include <torch/torch.h>

#include "memfit/errors.h"
#include "memfit/measure/memory_space.h"

namespace memfit {

Strategy::Strategy(std::unique_ptr<ProcessGroup> group, Chain& chain) : chain_(chain), group_(std::move(group)) {}
Strategy::~Strategy() = default;

bool Strategy::optimizer_step(torch::optim::Optimizer& optimizer, const StepOptions& options) {
  if (!offload_) return memfit::optimizer_step(optimizer, options);
  bool skipped = false;
  offload_->step([&] { skipped = memfit::optimizer_step(optimizer, options); });
  return skipped;
}

void Strategy::offload_optimizer(torch::optim::Optimizer& optimizer) {
  check_option(can_offload_optimizer(), "offload", "optimizer", "ZeRO 3 shards the optimizer's state across ranks instead");
  if (!offload_) offload_ = std::make_unique<OptimizerOffload>(chain_.parameters());
  offload_->adopt(optimizer);
}

at::Tensor Strategy::zero_gradient(size_t index, const at::Tensor& parameter) const {
  if (!offload_) return at::zeros_like(parameter);
  HostSpaceGuard host;
  return at::zeros_like(offload_->host_parameters().at(index));
}

at::Tensor& Strategy::gradient_of(size_t index, const at::Tensor& parameter) {
  return offload_ ? offload_->host_parameters().at(index).mutable_grad() : parameter.mutable_grad();
}

BatchSlice rank_slice(int64_t batch, int rank, int world_size) {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    throw std::invalid_argument("rank_slice: rank " + std::to_string(rank) + " outside a world of " + std::to_string(world_size));
  }
  const int64_t base = batch / world_size, extra = batch % world_size;
  BatchSlice s;
  s.start = rank * base + std::min<int64_t>(rank, extra);
  s.length = base + (rank < extra ? 1 : 0);
  return s;
}

void start_from_rank0_weights(ProcessGroup& group, const std::vector<at::Tensor>& params, int zero_stage) {
  int64_t bytes = 0;
  for (const auto& p : params) bytes += static_cast<int64_t>(p.nbytes());
  group.check_same_on_all_ranks({{"the number of parameters", static_cast<int64_t>(params.size())},
                                 {"the parameter bytes (the model's shape)", bytes},
                                 {"zero_stage", zero_stage}});
  at::NoGradGuard no_grad;
  PendingCollectives pending(group, "broadcasting the initial weights");
  for (const auto& p : params) pending.broadcast(p.detach(), 0);
  pending.wait();
}

WeightsDump::WeightsDump(const std::string& path) {
  if (path.empty()) return;
  file_.open(path, std::ios::binary);
  check_option(static_cast<bool>(file_), "dump_weights", "'" + path + "'", "cannot create it");
}

void WeightsDump::write(const at::Tensor& p) {
  if (!file_.is_open()) return;
  const at::Tensor c = p.detach().to(c10::kCPU, at::kFloat).contiguous();
  file_.write(static_cast<const char*>(c.data_ptr()), static_cast<std::streamsize>(c.numel() * 4));
}

void dump_weights(const std::string& path, const std::vector<at::Tensor>& params) {
  WeightsDump dump(path);
  for (const auto& p : params) dump.write(p);
}

}  // namespace memfit
