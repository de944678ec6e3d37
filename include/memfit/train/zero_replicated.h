// zero_replicated.h — data parallel over N ranks, each holding every weight, with ZeRO's
// stages 0-2 (Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion
// Parameter Models"):
//
//   stage 0: gradients all-reduced, every rank runs the optimizer over every parameter;
//   stage 1: gradients all-reduced, rank r runs the optimizer only over the parameters it owns
//            (a contiguous range, balanced by bytes: partition_by_bytes): optimizer state per
//            rank ~ 1/N; owners broadcast the updated parameters;
//   stage 2: as 1, but each gradient is reduced to its owner only and the others release
//            theirs: gradient bytes per rank at the optimizer step ~ 1/N.
//
// Saving gathers the whole optimizer state on rank 0 (any family), which writes the
// single-process format; resuming reads it and keeps this rank's share.
#pragma once

#include "memfit/train/strategy.h"
#include "memfit/train/strategy_registry.h"

namespace memfit {

class ZeroReplicated : public Strategy {
 public:
  // Joins nothing itself (`group` is joined); checks that every rank has the same number and
  // bytes of parameters and broadcasts rank 0's weights, so that all ranks start equal.
  ZeroReplicated(std::unique_ptr<ProcessGroup> group, Chain& chain, int zero_stage);

  int zero_stage() const { return stage_; }
  int owner(size_t parameter_index) const { return owner_.at(parameter_index); }
  bool owns(size_t parameter_index) const { return owner(parameter_index) == rank(); }
  // Bytes of all parameters, and of the range this rank owns.
  int64_t parameter_bytes() const { return total_bytes_; }
  int64_t owned_bytes() const { return owned_bytes_; }

  std::string describe() const override;
  // Every parameter at stage 0, this rank's range at 1 and 2.
  std::vector<at::Tensor> optimized_parameters() const override;
  std::vector<at::Tensor> held_parameters() const override { return parameters_; }
  void add_to_plan_request(PlanRequest& request, const MeasuredCosts& costs, const StateUse& state) const override;
  void check_plan(const Plan& plan) const override;

  // SUM-reduces the gradients: all-reduce at stages 0 and 1, reduce to each owner at stage 2
  // (the others released). A parameter without a gradient on this rank contributes zeros.
  void reduce_gradients() override;
  // The optimizer step, then finish_step.
  bool optimizer_step(torch::optim::Optimizer& optimizer, const StepOptions& options) override;
  // After the optimizer step (which released or zeroed the gradients of the optimized
  // parameters): at stages 1 and 2 owners broadcast their updated parameters, and at stage 1
  // the gradients of the parameters this rank does not own are released (or zeroed).
  void finish_step(bool set_to_none);

  void save(const SaveRequest& request) override;
  void resume(SavedState& saved, torch::optim::Optimizer& optimizer, const OptimizerSpec& spec,
              c10::Device device) override;
  std::string weights_sha256(const std::string& dump_path) override;

  // Saving at stages 1 and 2 (every rank calls it): rank 0 receives every other rank's state of
  // `sharded` (this rank's optimizer, built from `spec`) and returns an optimizer of `spec` over
  // all parameters holding the whole state; the other ranks get nullptr.
  std::unique_ptr<torch::optim::Optimizer> gather_optimizer_state(torch::optim::Optimizer& sharded,
                                                                  const OptimizerSpec& spec);
  // Resuming at stages 1 and 2: keep of `full` only the state of the parameters this rank owns,
  // moved into `sharded`.
  void keep_owned_state(torch::optim::Optimizer& full, torch::optim::Optimizer& sharded) const;

 private:
  void send_param_state(torch::optim::Optimizer& sharded, size_t index, size_t slots, const char* what);
  void receive_param_state(torch::optim::Optimizer& full, size_t index, int from, const OptimizerSpec& spec,
                           const char* what);

  std::vector<at::Tensor> parameters_;
  std::vector<int> owner_;
  int stage_;
  int64_t total_bytes_ = 0;
  int64_t owned_bytes_ = 0;
};

// Selected for several ranks at ZeRO stage 0, 1 or 2; refuses a pinned fp16 at stages 1 and 2.
StrategyEntry zero_replicated_entry();

}  // namespace memfit
