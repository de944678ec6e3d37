// partwise.h — a model memfit can run part by part: what the profiler (profile.h) measures. Two
// implementations: the C++ Chain (and a TorchScript file, which becomes one), below, and the
// Python package's runner of the user's nn.Module (python/memfit/_parts.py), which the
// profiler calls back only to run the model.
//
// A forward is a sequence of parts, each starting on the previous part's output. The model runs
// its forward as a training step runs it and tells an observer where each part starts; the
// profiler measures every part where it runs (in place, with everything around it alive), with
// the allocator's exact bytes, and turns what it measured into the planner's block costs.
//
//   C++ Chain:   part i = block i (block 0 with the chain's input copy, the last with the loss)
//   Python:      part 0 = the model's code before the first block (embeddings, masks),
//                parts 1..N = the blocks, part N+1 = the code after the last block and the loss
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "memfit/runtime/workload.h"
#include "memfit/techniques/autocast.h"

namespace memfit {

// What a partwise model tells as its forward runs.
class PartObserver {
 public:
  virtual ~PartObserver() = default;
  // Part `part` (1 or more) starts on `input`, the previous part's output (undefined where the
  // model found no tensor to hand on).
  virtual void enter(int part, const at::Tensor& input) = 0;
  // Whether the model should report saved_tensor_read: only models whose checkpointed segments
  // recompute when backward first reads a saved tensor (non-reentrant) can, and only some runs ask.
  virtual bool watches_saved_reads() const = 0;
  // Backward reads a tensor part `part`'s forward saved (the first time is what counts).
  virtual void saved_tensor_read(int part) = 0;
  // Part `part`'s forward changed state that outlives the call (`what`: a key/value cache it was
  // handed and appended to, a counter of its module): it is not recomputed as if it were pure.
  virtual void state_changed(int part, const std::string& what) = 0;
  // Part `part`'s block has returned: the rest of the part is the model's own code after it,
  // which a recompute does not run (a model whose parts are its blocks never calls this).
  virtual void block_returned(int part) {}
  // Part `part`'s block, run as inside a checkpointed segment, was handed `tensor` besides its
  // input, made by the step's forward before it (a position bias, a skip): the segment's
  // recording would hold it to the segment's backward.
  virtual void handed(int part, const at::Tensor& tensor) {}
  // Part `part`'s block returned `output` (its main output, which the model's code after it may
  // keep apart from the part's output); `saved` where the block's own graph saved it for backward.
  virtual void block_output(int part, const at::Tensor& output, bool saved) {}
};

// One forward's settings: the first `samples` samples of the model's batch, at a precision, and
// (timing where the plain step does not fit) with every block recomputed.
struct PartRun {
  int64_t samples = 0;
  Precision precision = Precision::kFP32;
  bool recompute_all = false;
  // The blocks run without grad, as inside a checkpointed segment, each block's output requiring
  // grad as a recomputed segment's does; the model's own code between blocks runs with grad, as
  // it does around a segment (it is never recomputed, so the tensors it saves stay).
  bool blocks_without_grad = false;
};

class PartwiseModel {
 public:
  virtual ~PartwiseModel() = default;

  virtual int parts() const = 0;
  // How plans and notes name part `part` ("block 3 (attn1)", "code before the first block").
  virtual std::string part_name(int part) const = 0;
  // Whether a checkpointed segment may hold part `part` (the model's own code around its blocks
  // cannot be run again alone).
  virtual bool recomputable(int part) const = 0;
  // Whether its checkpointed segments are non-reentrant (ChainCosts::non_reentrant).
  virtual bool non_reentrant_checkpoint() const = 0;
  // Bytes of a copy of its input that part `part` runs on inside a checkpointed segment (a block
  // writing into its input: BlockCost::input_copy_bytes); 0 for most.
  virtual int64_t input_copy_bytes(int part, const at::Tensor& input) const = 0;

  virtual int64_t samples() const = 0;                     // in the batch measured
  virtual c10::Device device() const = 0;
  virtual std::vector<at::Tensor> parameters() const = 0;  // what the optimizer steps, each once
  virtual int64_t weight_bytes() const = 0;                // every parameter's storage, once
  virtual std::vector<at::Tensor> batch_tensors() const = 0;

  // The loss of one forward as `run` says, in the caller's grad mode and tracker phase,
  // telling `observer` (if given) where each part starts.
  virtual at::Tensor forward(const PartRun& run, PartObserver* observer) = 0;

  // Whether a forward + backward of `run`'s samples at its precision ran on this model before:
  // its first use is paid (oneDNN's kernels for those shapes built, a caching allocator grown),
  // so a timing needs no run to pay it (timing_rounds.h). The measuring runs mark it.
  bool warm(const PartRun& run) const { return warm_.count({run.precision, run.samples}) > 0; }
  void mark_warm(const PartRun& run) { warm_.insert({run.precision, run.samples}); }

 private:
  std::set<std::pair<Precision, int64_t>> warm_;
};

// A Workload's Chain on one batch, part by part: each block a part.
class ChainParts : public PartwiseModel {
 public:
  ChainParts(Workload& workload, Batch batch);

  int parts() const override;
  std::string part_name(int part) const override;
  bool recomputable(int part) const override { return true; }
  bool non_reentrant_checkpoint() const override { return false; }
  int64_t input_copy_bytes(int part, const at::Tensor& input) const override;
  int64_t samples() const override { return batch_.size(); }
  c10::Device device() const override { return batch_.input.device(); }
  std::vector<at::Tensor> parameters() const override;
  int64_t weight_bytes() const override;
  std::vector<at::Tensor> batch_tensors() const override { return {batch_.input, batch_.target}; }
  at::Tensor forward(const PartRun& run, PartObserver* observer) override;

 private:
  Workload& workload_;
  Batch batch_;
};

}  // namespace memfit
