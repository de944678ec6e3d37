// strategy.h — how a training step's parameters, gradients and optimizer state are held across
// processes. The Trainer runs one loop over a Strategy and never asks which one it has:
//
//   SingleProcess    one process holds everything                               single_process.h
//   ZeroReplicated   N ranks, each holding every weight: ZeRO stage 0 (gradients all-reduced),
//                    1 (optimizer state sharded), 2 (gradients sharded too)      zero_replicated.h
//   ZeroSharded      ZeRO stage 3: weights, gradients and state 1/N per rank     zero_sharded.h
//
// Every rank trains on its contiguous slice of the global batch (rank_slice), each micro-batch's
// loss weighted by its share of the *global* batch, and gradients are summed: the update equals
// single-process training on the same global batch.
//
// A strategy owns what differs between these setups: the parameters the optimizer steps,
// gradient reduction after the micro-batches, the optimizer step (and what follows it),
// its additions to the plan request, saving and resuming (always in the single-process format),
// the weights' hash, and the scope in which the whole model runs as one process runs it
// (profiling). Each runs over a ProcessGroup (a group of one for SingleProcess), which the
// Trainer also uses to agree across ranks.
//
// A new strategy: a class deriving from Strategy in its own header and source, with its entry
// (strategy_registry.h: which options select it, what it refuses, how it is made) listed in
// strategy_registry.cpp, and a case in tests/test_strategies.cpp.
#pragma once

#include <ATen/ATen.h>
#include <c10/core/Device.h>
#include <nlohmann/json.hpp>
#include <torch/optim/optimizer.h>

#include <fstream>
#include <memory>
#include <string>
#include <vector>

#include "memfit/plan/planner.h"
#include "memfit/runtime/chain.h"
#include "memfit/runtime/optimizer.h"
#include "memfit/runtime/optimizer_offload.h"
#include "memfit/runtime/step.h"
#include "memfit/train/process_group.h"

namespace memfit {

class SavedState;  // saved_state.h

// Rank `rank`'s contiguous part of a global batch of `batch` samples: the first batch % world
// ranks take one sample more. Rank order is sample order, so the ranks together see exactly
// the samples a single process would.
struct BatchSlice {
  int64_t start = 0;
  int64_t length = 0;
};
BatchSlice rank_slice(int64_t batch, int rank, int world_size);

// How the run uses saved state: what the plan reserves room for, and what a strategy refuses.
struct StateUse {
  bool saves = false;    // state is saved during the run
  bool resumes = false;  // the run starts from saved state
};

// What saving writes: the optimizer's state (built from `spec`) with the model's, and `meta`
// (which holds "step") as the state's head.
struct SaveRequest {
  std::string dir;
  torch::optim::Optimizer& optimizer;
  const OptimizerSpec& spec;
  const nlohmann::json& meta;
  c10::Device device;
};

class Strategy {
 public:
  virtual ~Strategy();
  Strategy(const Strategy&) = delete;
  Strategy& operator=(const Strategy&) = delete;

  ProcessGroup& group() { return *group_; }
  const ProcessGroup& group() const { return *group_; }
  int rank() const { return group_->rank(); }
  int world_size() const { return group_->world_size(); }
  bool primary() const { return rank() == 0; }  // writes the log, the report and saved state
  BatchSlice local_slice(int64_t batch) const { return rank_slice(batch, rank(), world_size()); }

  // How this process takes part, in a line ("rank 0 of 2 (gloo via ...), ZeRO stage 2: ..."),
  // or "" for one process alone.
  virtual std::string describe() const = 0;

  // --- parameters --------------------------------------------------------------------------
  // What this process's optimizer steps.
  virtual std::vector<at::Tensor> optimized_parameters() const = 0;
  // The tensors holding this process's weights and gradients between steps.
  virtual std::vector<at::Tensor> held_parameters() const = 0;

  // --- planning ----------------------------------------------------------------------------
  // Completes `request` (step, costs and margin set) with what this strategy holds per rank:
  // gradient bytes through the optimizer step, gathered blocks, what saving adds on rank 0.
  virtual void add_to_plan_request(PlanRequest& request, const MeasuredCosts& costs, const StateUse& state) const = 0;
  // Whether micro-batches can be timed by this process alone while planning (a collective
  // strategy would need every rank to join each timing).
  virtual bool times_micro_batches_alone() const { return true; }
  // Throws OptionError if this strategy cannot run `plan` (a precision it does not support).
  virtual void check_plan(const Plan& plan) const {}
  // Takes what it needs of the configuration every rank runs (ZeRO 3: the prefetch depth).
  virtual void use_config(const StepConfig& config) {}
  // With the optimizer offloaded (runtime/optimizer_offload.h): every parameter gets a host
  // master, its gradients go there, `optimizer` (built over optimized_parameters()) steps the
  // masters on the host, and the weights are copied back before anything the strategy does after
  // the step. Throws OptionError where the strategy cannot (ZeRO 3).
  void offload_optimizer(torch::optim::Optimizer& optimizer);
  OptimizerOffload* optimizer_offload() { return offload_.get(); }
  // While alive, the chain runs as a single process runs it (every weight present): what
  // profiling measures. Collective where weights are sharded: every rank enters it together.
  class WholeModelScope {
   public:
    virtual ~WholeModelScope() = default;
  };
  virtual std::unique_ptr<WholeModelScope> whole_model() { return std::make_unique<WholeModelScope>(); }

  // --- the step ----------------------------------------------------------------------------
  // After the last micro-batch's backward: this rank's gradients summed as the strategy holds them.
  virtual void reduce_gradients() {}
  // The optimizer step (options.scaler-aware; on the host when offloaded, the weights copied
  // back after), and what the strategy does after it. Returns whether the loss scaler skipped it.
  virtual bool optimizer_step(torch::optim::Optimizer& optimizer, const StepOptions& options);

  // --- state -------------------------------------------------------------------------------
  // Every rank calls it; the single-process format is written (by rank 0).
  virtual void save(const SaveRequest& request) = 0;
  // Loads `saved` (the single-process format) into this rank's weights and `optimizer`.
  virtual void resume(SavedState& saved, torch::optim::Optimizer& optimizer, const OptimizerSpec& spec,
                      c10::Device device) = 0;
  // sha256 of every parameter in order, as a single process would hash them (every rank calls
  // it); `dump_path` non-empty: rank 0 also writes them there as raw float32.
  virtual std::string weights_sha256(const std::string& dump_path) = 0;
  // Whether one process holds the whole model, so that rank 0 can write it as a model file.
  virtual bool holds_whole_model() const { return true; }

 protected:
  Strategy(std::unique_ptr<ProcessGroup> group, Chain& chain);
  virtual bool can_offload_optimizer() const { return true; }
  // The gradient sum of the `index`-th of the chain's parameters, where this process holds it: the
  // parameter's .grad, or its host master's with the optimizer offloaded.
  at::Tensor& gradient_of(size_t index, const at::Tensor& parameter);
  at::Tensor zero_gradient(size_t index, const at::Tensor& parameter) const;  // where gradient_of keeps it
  Chain& chain_;
  std::unique_ptr<OptimizerOffload> offload_;

 private:
  std::unique_ptr<ProcessGroup> group_;
};

// For data-parallel strategies: checks that every rank has the same parameter count and bytes
// and the same ZeRO stage, then broadcasts rank 0's weights. Ranks build the model from the same
// seed; the broadcast makes equality a guarantee rather than an assumption (as PyTorch's
// DistributedDataParallel does).
void start_from_rank0_weights(ProcessGroup& group, const std::vector<at::Tensor>& params, int zero_stage);

// Parameters as raw float32, in order, into a file: for comparing runs within a tolerance.
// An empty path writes nothing. Throws OptionError("dump_weights", ...) if it cannot be created.
class WeightsDump {
 public:
  explicit WeightsDump(const std::string& path);
  void write(const at::Tensor& parameter);

 private:
  std::ofstream file_;
};
void dump_weights(const std::string& path, const std::vector<at::Tensor>& params);

}  // namespace memfit
