#include "memfit/train/zero_replicated.h"

#include <torch/torch.h>

#include "memfit/errors.h"
#include "memfit/measure/size.h"
#include "memfit/plan/rank_states.h"
#include "memfit/train/saved_state.h"

namespace memfit {

ZeroReplicated::ZeroReplicated(std::unique_ptr<ProcessGroup> group, Chain& chain, int zero_stage)
    : Strategy(std::move(group), chain), parameters_(chain.parameters()), stage_(zero_stage) {
  check_option(zero_stage >= 0 && zero_stage <= 2, "zero_stage", zero_stage,
               "expected 0, 1 or 2 (stage 3 is ZeroSharded: zero_sharded.h)");
  owner_ = partition_by_bytes(parameters_, world_size());
  for (size_t i = 0; i < parameters_.size(); ++i) {
    const auto& p = parameters_[i];
    check_option(p.is_contiguous(), "zero_stage", zero_stage, "parameter " + std::to_string(i) + " is not contiguous");
    total_bytes_ += static_cast<int64_t>(p.nbytes());
    if (owns(i)) owned_bytes_ += static_cast<int64_t>(p.nbytes());
  }
  start_from_rank0_weights(this->group(), parameters_, zero_stage);
}

std::string ZeroReplicated::describe() const {
  const int64_t stepped = stage_ > 0 ? owned_bytes_ : total_bytes_;
  return "rank " + std::to_string(rank()) + " of " + std::to_string(world_size()) + " (" + group().backend_name() +
         " via " + group().options().master + "), ZeRO stage " + std::to_string(stage_) + ": the optimizer steps " +
         format_bytes(stepped) + " of the parameters";
}

std::vector<at::Tensor> ZeroReplicated::optimized_parameters() const {
  if (stage_ == 0) return parameters_;
  std::vector<at::Tensor> mine;
  for (size_t i = 0; i < parameters_.size(); ++i) {
    if (owns(i)) mine.push_back(parameters_[i]);
  }
  return mine;
}

void ZeroReplicated::add_to_plan_request(PlanRequest& request, const MeasuredCosts& costs, const StateUse& state) const {
  // The gradients kept through the optimizer step: only this rank's share at stage 2.
  request.gradient_bytes = predicted_rank_states(parameters_, world_size(), stage_, 0).at(static_cast<size_t>(rank())).gradients;
  if (!(stage_ > 0 && primary() && state.saves)) return;
  // Saving: rank 0 gathers the whole optimizer state beside its own share. With state auto, the
  // larger of the candidate states per byte of weights: a safe bound for either.
  int64_t state_bytes = 0;
  for (const auto& c : costs.optimizer) state_bytes = std::max(state_bytes, c.state_bytes);
  const double per_byte = owned_bytes_ > 0 ? static_cast<double>(state_bytes) / static_cast<double>(owned_bytes_) : 0.0;
  request.extra_bytes = std::llround(per_byte * static_cast<double>(costs.profile.weight_bytes)) - state_bytes;
}

void ZeroReplicated::check_plan(const Plan& plan) const {
  check_option(!(stage_ > 0 && plan.config.precision == Precision::kFP16), "precision", "fp16",
               "fp16 with ZeRO 1 or 2 is not supported: the loss scaler's overflow check would see one shard only");
}

void ZeroReplicated::reduce_gradients() {
  at::NoGradGuard no_grad;
  PendingCollectives pending(group(), stage_ == 2 ? "reducing gradients to their owners" : "all-reducing gradients");
  for (size_t i = 0; i < parameters_.size(); ++i) {
    at::Tensor& grad = gradient_of(i, parameters_[i]);
    if (!grad.defined()) grad = zero_gradient(i, parameters_[i]);  // every rank must take part
    if (stage_ == 2) {
      pending.reduce_sum(grad, owner(i));
    } else {
      pending.all_reduce_sum(grad);
    }
  }
  pending.wait();
  if (stage_ != 2) return;
  for (size_t i = 0; i < parameters_.size(); ++i) {
    if (!owns(i)) gradient_of(i, parameters_[i]).reset();  // only the owner needs the sum
  }
}

bool ZeroReplicated::optimizer_step(torch::optim::Optimizer& optimizer, const StepOptions& options) {
  const bool skipped = Strategy::optimizer_step(optimizer, options);
  finish_step(options.config.set_to_none);
  return skipped;
}

void ZeroReplicated::finish_step(bool set_to_none) {
  if (stage_ == 0) return;
  at::NoGradGuard no_grad;
  if (stage_ == 1) {
    for (size_t i = 0; i < parameters_.size(); ++i) {
      at::Tensor& grad = gradient_of(i, parameters_[i]);
      if (owns(i) || !grad.defined()) continue;
      if (set_to_none) {
        grad.reset();
      } else {
        grad.zero_();
      }
    }
  }
  PendingCollectives pending(group(), "broadcasting updated parameters from their owners");
  for (size_t i = 0; i < parameters_.size(); ++i) pending.broadcast(parameters_[i].detach(), owner(i));
  pending.wait();
}

void ZeroReplicated::save(const SaveRequest& r) {
  if (stage_ == 0) {  // every rank holds the whole state
    if (primary()) save_state(r.dir, chain_, r.optimizer, r.spec, r.meta, r.device);
    return;
  }
  // Rank 0 saves the whole state, gathered from its owners: the single-process format.
  const auto full = gather_optimizer_state(r.optimizer, r.spec);
  if (primary()) save_state(r.dir, chain_, *full, r.spec, r.meta, r.device);
}

void ZeroReplicated::resume(SavedState& saved, torch::optim::Optimizer& optimizer, const OptimizerSpec& spec,
                            c10::Device device) {
  if (stage_ == 0) {
    saved.load_into(chain_, optimizer, spec, device);
    return;
  }
  // The files hold the whole state: keep this rank's share.
  auto full = make_optimizer(spec, parameters_);
  saved.load_into(chain_, *full, spec, device);
  keep_owned_state(*full, optimizer);
}

std::string ZeroReplicated::weights_sha256(const std::string& dump_path) {
  if (primary() && !dump_path.empty()) dump_weights(dump_path, parameters_);
  return memfit::weights_sha256(chain_);
}

std::unique_ptr<torch::optim::Optimizer> ZeroReplicated::gather_optimizer_state(torch::optim::Optimizer& sharded,
                                                                              const OptimizerSpec& spec) {
  TORCH_CHECK(stage_ > 0, "gather_optimizer_state: at stage 0 every rank has the whole state");
  const char* what = "gathering the optimizer state on rank 0";
  std::unique_ptr<torch::optim::Optimizer> full = primary() ? make_optimizer(spec, parameters_) : nullptr;
  const size_t slots = param_state_slots(spec);
  for (size_t i = 0; i < parameters_.size(); ++i) {
    const int from = owner(i);
    if (from == 0 && primary()) {
      auto it = sharded.state().find(param_state_key(parameters_[i]));
      if (it != sharded.state().end()) full->state()[it->first] = it->second->clone();  // tensors shared, not copied
    } else if (rank() == from) {
      send_param_state(sharded, i, slots, what);
    } else if (primary()) {
      receive_param_state(*full, i, from, spec, what);
    }
  }
  return full;
}

// The header says whether the parameter has state, its step and which slots are defined; the
// defined tensors follow.
void ZeroReplicated::send_param_state(torch::optim::Optimizer& sharded, size_t index, size_t slots, const char* what) {
  auto it = sharded.state().find(param_state_key(parameters_[index]));
  ParamStateRecord record;
  if (it != sharded.state().end()) record = read_param_state(*it->second);
  std::vector<int64_t> header{it != sharded.state().end() ? 1 : 0, record.step};
  for (size_t s = 0; s < slots; ++s) header.push_back(s < record.tensors.size() && record.tensors[s].defined() ? 1 : 0);
  group().send(at::tensor(header, at::kLong), 0, what);
  for (const auto& t : record.tensors) {
    if (t.defined()) group().send(t.contiguous(), 0, what);
  }
}

void ZeroReplicated::receive_param_state(torch::optim::Optimizer& full, size_t index, int from, const OptimizerSpec& spec,
                                         const char* what) {
  const at::Tensor& p = parameters_[index];
  at::Tensor header = at::empty({2 + static_cast<int64_t>(param_state_slots(spec))}, at::kLong);
  group().receive(header, from, what);
  const auto h = header.accessor<int64_t, 1>();
  if (h[0] == 0) return;
  ParamStateRecord record;
  record.step = h[1];
  for (int64_t s = 2; s < header.size(0); ++s) {
    at::Tensor t;
    if (h[s] != 0) {
      t = empty_param_state_slot(spec, static_cast<size_t>(s - 2), p);  // 8-bit state: codes and absmax
      group().receive(t, from, what);
    }
    record.tensors.push_back(t);
  }
  full.state()[param_state_key(p)] = make_param_state(spec, record);
}

void ZeroReplicated::keep_owned_state(torch::optim::Optimizer& full, torch::optim::Optimizer& sharded) const {
  TORCH_CHECK(stage_ > 0, "keep_owned_state: at stage 0 every rank keeps the whole state");
  for (size_t i = 0; i < parameters_.size(); ++i) {
    if (!owns(i)) continue;
    const auto key = param_state_key(parameters_[i]);
    auto it = full.state().find(key);
    if (it != full.state().end()) sharded.state()[key] = std::move(it->second);
  }
  full.state().clear();  // the other ranks' shares are released here
}

StrategyEntry zero_replicated_entry() {
  return {"ZeRO 0-2", [](const DistributedOptions& o) { return o.enabled() && o.zero_stage <= 2; },
          [](const StrategyAsk& a) {
            check_option(!(a.distributed.zero_stage > 0 && a.precision_pinned && a.step.precision == Precision::kFP16),
                         "precision", "fp16",
                         "fp16 with ZeRO 1 or 2 is not supported: the loss scaler's overflow check would see one shard only");
            check_option(a.offload == OffloadMode::kNone || !a.step.device.is_cuda(), "offload", offload_mode_name(a.offload),
                         "several ranks on CUDA reduce gradients with NCCL, which cannot reach host memory");
          },
          [](const DistributedOptions& o, Chain& chain) -> std::unique_ptr<Strategy> {
            auto group = std::make_unique<ProcessGroup>(o);  // joined first: a bad master fails before any work
            return std::make_unique<ZeroReplicated>(std::move(group), chain, o.zero_stage);
          }};
}

}  // namespace memfit
