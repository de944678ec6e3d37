// chain.h — a model as an ordered list of blocks, each tensor -> tensor.
//
// Like nn::Sequential, but memfit reasons per block: the tracker tags every allocation with
// the block that made it (per-block activation bytes), and a CheckpointPlan says which runs
// of blocks keep only their input and recompute in backward. Adopt it for your own model by
// adding one block per stage:
//
//   auto chain = std::make_shared<memfit::Chain>();
//   chain->add("embed", embed);                   // any module with forward(Tensor) -> Tensor
//   chain->add("attn0", attn, [attn](const torch::Tensor& x) { return attn->forward(x); });
//   auto y = chain->forward(x, memfit::CheckpointPlan::parse("every:2", chain->size()));
#pragma once

#include <torch/nn/module.h>

#include <functional>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "memfit/techniques/activation_offload.h"
#include "memfit/techniques/checkpoint.h"

namespace memfit {

// Blocks recomputed in backward, as segments [first, last] (inclusive, sorted, disjoint). A
// segment keeps only the input of its first block during forward, and recomputes all its
// blocks in backward.
struct CheckpointPlan {
  std::vector<std::pair<int, int>> segments;

  static CheckpointPlan none() { return {}; }
  // Every block its own segment.
  static CheckpointPlan all(int blocks);
  // Segments of k consecutive blocks (the last may be shorter), like checkpoint_sequential.
  static CheckpointPlan every(int k, int blocks);
  // The listed blocks, each its own segment.
  static CheckpointPlan of_blocks(std::vector<int> indices, int blocks);
  // "none" | "all" | "every:K" | "i,j,..." (block indices). Throws std::invalid_argument with
  // one line naming the value and what is accepted.
  static CheckpointPlan parse(const std::string& spec, int blocks);

  bool empty() const { return segments.empty(); }
  std::vector<int> recomputed_blocks() const;
  bool recomputes(int block) const;
  std::string describe() const;  // "none", "1,3,5", "0-3,4-7"
};

using BlockForward = BlockFn;

// Runs block `index` on `x` in place of the chain's own call, given `run`, the block's own
// forward (tagged with its index): ZeRO 3 (train/zero_sharded.h) gathers the block's sharded
// weights around it and recomputes it in backward.
using BlockRunner = std::function<at::Tensor(int index, const at::Tensor& x, const BlockFn& run)>;

struct Block {
  std::string name;
  std::shared_ptr<torch::nn::Module> module;  // owns the block's parameters
  BlockForward forward;
};

class Chain : public torch::nn::Module {
 public:
  // Adds a block; the module is registered as a submodule "<index>_<name>".
  void add(const std::string& name, std::shared_ptr<torch::nn::Module> module, BlockForward forward);
  template <class ModuleType>
  void add(const std::string& name, std::shared_ptr<ModuleType> module) {
    add(name, module, [module](const at::Tensor& x) { return module->forward(x); });
  }

  int size() const { return static_cast<int>(blocks_.size()); }
  const Block& block(int index) const { return blocks_.at(static_cast<size_t>(index)); }
  // How errors and notes name block `index`: "block 2 (embed)"; a TorchScript block, named
  // "<child>:<type>", "block 2:relu (ReLU)".
  std::string describe_block(int index) const;
  std::vector<std::string> block_names() const;  // in order: what reports and plans name blocks by
  // The parameters blocks [first, last] read, each once.
  std::vector<at::Tensor> block_parameters(int first, int last) const;
  std::vector<at::Tensor> block_buffers(int first, int last) const;

  // Each parameter once, in the order blocks first hold them. A tensor that several blocks
  // hold (tied weights, as GPT-2's token embedding and output layer) is one parameter, as
  // PyTorch's Module.parameters() has it; torch::nn::Module's own list names it once per holder
  // (an optimizer given that list steps it twice a step). Hides torch::nn::Module::parameters.
  std::vector<at::Tensor> parameters(bool recurse = true) const;
  // For each of parameters(), the block whose backward makes its gradient: the last block that
  // holds it (backward runs the blocks in reverse).
  std::vector<int> parameter_blocks() const;

  // Whether block `index` may write into its input tensor (an in-place first op, as
  // torchvision's ReLU(inplace=True)): learned from the input's version counter whenever the
  // block runs (outside inference mode); a block not run yet may. Such a block gets a copy of
  // an input someone else keeps: a checkpointed segment's saved input, and the chain's own
  // input (the caller's batch) once the block is known to write into it. Between blocks of a
  // plain run it writes into the previous block's output, as in eager PyTorch.
  bool may_write_input(int index) const;
  InputWrites input_writes(int index) const { return input_writes_.at(static_cast<size_t>(index)); }
  // Runs the chain once, without grad, on a copy of `input` when a block has not run yet, so
  // that may_write_input() is known for every block (`input` is left as it was). Dropout draws
  // and running statistics move as in any forward; callers restore what they need.
  void learn_input_writes(const at::Tensor& input);

  // Runs all blocks, checkpointing the plan's segments and offloading the saved activations of
  // the `offloaded` blocks to the host until their backward (techniques/activation_offload.h;
  // sorted, none recomputed); each block's allocations are tagged with its index for the memory
  // tracker. With a block runner set, every block goes through it instead and neither is used
  // (the runner decides what is kept).
  at::Tensor forward(const at::Tensor& input, const CheckpointPlan& plan = {}, const std::vector<int>& offloaded = {});
  // Empty: none (the default).
  void set_block_runner(BlockRunner runner) { runner_ = std::move(runner); }
  const BlockRunner& block_runner() const { return runner_; }
  // Called as each block of a run without checkpointing starts, with its input: how the
  // profiler (plan/partwise.h) sees where the chain's parts begin. Empty: none (the default).
  using BlockStart = std::function<void(int index, const at::Tensor& input)>;
  void set_block_start(BlockStart on_start) { on_block_start_ = std::move(on_start); }
  // Runs blocks [first, last] without checkpointing. An error inside a block (out of memory
  // excepted, which stays what it is) comes out as a c10::Error of one line naming the block,
  // what ran and the cause: "block 2:relu (ReLU), forward: <cause>".
  at::Tensor run_blocks(const at::Tensor& input, int first, int last);
  // Runs block `index` alone, as run_blocks does; `running`, when given, is what its errors say
  // ran ("profiling at micro-batch 8").
  at::Tensor run_block(int index, const at::Tensor& x, const char* running = nullptr);

 private:
  at::Tensor run_through_runner(const at::Tensor& input);
  at::Tensor own_input(const at::Tensor& input) const;
  // Blocks [first, last] as run_blocks runs them, the `offloaded` ones through run_offloaded.
  // `waiting`: the last offloaded block's activations, prefetched when backward reaches the
  // output of the block after it (then the last offloaded block's here, or null).
  at::Tensor run_plain(const at::Tensor& input, int first, int last, const std::vector<int>& offloaded,
                       std::shared_ptr<OffloadedActivations>& waiting);

  std::vector<Block> blocks_;
  std::vector<InputWrites> input_writes_;  // by block, learned as blocks run
  BlockRunner runner_;
  BlockStart on_block_start_;
};

}  // namespace memfit
