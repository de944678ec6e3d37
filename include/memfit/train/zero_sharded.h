// zero_sharded.h — ZeRO stage 3 (Rajbhandari et al. 2020): weights, gradients and optimizer
// state all ~ 1/N per rank.
//
// Each block's parameters are laid out flat (in order, padded to a multiple of N) and rank r
// keeps elements [r*s, (r+1)*s) as one leaf tensor, its shard, which the optimizer steps (any
// family: elementwise ones give single-process numbers). Between uses the chain's parameters
// hold no storage. The chain runs each block through checkpoint_gathered
// (techniques/checkpoint.h): its parameters are gathered (one c10d broadcast per owner) before
// its forward and again before its recompute and backward, released after each, and as soon as
// its backward ends its full gradients are summed for their owners, range by range, along a
// chain of c10d sends in rank order (Gloo has no reduce_scatter, and its reduce sums in an
// order of its own): the sums, so the weights, equal single-process training bit for bit.
//
// Prefetch (the plan's StepConfig::prefetch_depth, d): gathering a block also starts the
// gathers of the next d blocks in the pass's order (forward: the following ones; backward,
// recompute included: the preceding ones), so a block's weights travel while the blocks before
// it compute. At most 1 + d blocks' weights are held at once (the planner counts them); a
// gather started before the shard changed (an optimizer step) is dropped, never used. With
// d >= 1 a block's gradients also travel while the block before it runs its backward: each
// rank sends each owner its piece of the owner's range (tagged c10d sends), the owner sums the
// N pieces in rank order when the next block's backward is done (the same order as the chain,
// so the same bits) and adds the sum to its shard's .grad; the backward's last block is summed
// at once, so no reduction outlives a backward.
//
// Saving gathers one block at a time on rank 0 (its weights and fp32 optimizer state), which
// writes that block's part of the single-process format; resuming reads one block's part at a
// time and keeps this rank's shards of it.
#pragma once

#include <functional>
#include <map>
#include <optional>

#include "memfit/train/strategy.h"
#include "memfit/train/strategy_registry.h"

namespace memfit {

class ZeroSharded : public Strategy {
 public:
  // Checks and broadcasts as ZeroReplicated does, then shards every block: the chain's
  // parameters lose their storage here and the chain runs its blocks through this object from
  // now on (it must outlive every forward and backward of the chain). Throws OptionError for a
  // parameter shared by two blocks, frozen, or of another dtype or device than its block's.
  ZeroSharded(std::unique_ptr<ProcessGroup> group, Chain& chain);
  ~ZeroSharded() override;

  // Bytes of all parameters, and of this rank's shards (padding included).
  int64_t parameter_bytes() const { return total_bytes_; }
  int64_t owned_bytes() const { return owned_bytes_; }
  // Each block of the chain: its parameters' bytes in full, and this rank's shard of them (0
  // and 0 for a block without parameters). What the planner counts.
  std::vector<GatheredBlockBytes> block_bytes() const;

  std::string describe() const override;
  // This rank's shard of every block with parameters.
  std::vector<at::Tensor> optimized_parameters() const override;
  std::vector<at::Tensor> held_parameters() const override { return optimized_parameters(); }
  void add_to_plan_request(PlanRequest& request, const MeasuredCosts& costs, const StateUse& state) const override;
  // Timing gathers the whole model: a collective the other ranks would not join.
  bool times_micro_batches_alone() const override { return false; }
  std::unique_ptr<WholeModelScope> whole_model() override;

  void save(const SaveRequest& request) override;
  void resume(SavedState& saved, torch::optim::Optimizer& optimizer, const OptimizerSpec& spec,
              c10::Device device) override;
  std::string weights_sha256(const std::string& dump_path) override;
  bool holds_whole_model() const override { return false; }
  // Takes the plan's prefetch depth (every rank runs rank 0's plan: the same gathers).
  void use_config(const StepConfig& config) override { prefetch_depth_ = config.prefetch_depth; }
  bool can_offload_optimizer() const override { return false; }
  // Lets gathers started for this step's passes go first: the shards change.
  bool optimizer_step(torch::optim::Optimizer& optimizer, const StepOptions& options) override;
  void reduce_gradients() override { finish_reduction(); }

  // Every rank calls these ------------------------------------------------------------------
  // Gathers the blocks one at a time, in order, calls `visit` with each block's parameters
  // (full values) and releases them: hashing, dumping. One block's bytes at a time.
  void for_each_gathered_block(const std::function<void(const std::vector<at::Tensor>&)>& visit);
  // Saving, one block at a time (fp32 state of any family): for each block in order, rank 0
  // receives every rank's shard of its weights (into the chain's parameters) and of their
  // optimizer state, runs `write(block, state)` with the state of each of the block's parameters
  // (Chain::block_parameters order; none before the first step), then releases the block.
  // Blocks without parameters are written too. Rank 0 holds at most the largest block's weights
  // and state beside its shards (the plan counts those bytes).
  using BlockState = std::vector<std::optional<ParamStateRecord>>;  // per parameter of a block
  void for_each_gathered_block_state(torch::optim::Optimizer& sharded, const OptimizerSpec& spec,
                                     const std::function<void(int block, const BlockState& state)>& write);
  // Resuming, one block at a time: for each block in order, the block is gathered, `load(block)`
  // fills its parameters (whole values) and returns their saved state, and each rank keeps its
  // range of both (the state moved into `sharded`); then the block is released. Throws
  // std::runtime_error if a block's parameters were saved with unequal optimizer steps (a shard
  // has one).
  void load_block_states(const std::function<BlockState(int block)>& load, torch::optim::Optimizer& sharded,
                         const OptimizerSpec& spec);

 private:
  // One block's parameters, laid out flat.
  struct BlockShard {
    int block = 0;
    std::vector<at::Tensor> params;  // the chain's; 0 elements while not gathered
    std::vector<int64_t> offsets;    // each parameter's first element in the flat layout
    std::vector<std::vector<int64_t>> shapes;  // each parameter's shape in full
    int64_t numel = 0;               // the flat layout's elements (rank_states.h's flat_layout)
    int64_t shard_numel = 0;         // s: each rank's elements, numel padded to a multiple of N, / N
    at::Tensor shard;                // this rank's s elements: a leaf requiring grad
  };
  // A gather started ahead of its use: the flat block its collectives fill, and the shard's
  // version when it started (a later version means the values are stale).
  struct Prefetch {
    at::Tensor flat;
    std::unique_ptr<PendingCollectives> pending;
    uint32_t shard_version = 0;
  };
  // A block's gradients on their way to their owners: this rank's full gradients (sent from),
  // and the N pieces of this rank's range, one row per rank (this rank's copied in).
  struct Reduction {
    int shard = -1;                      // index into shards_
    at::Tensor flat_grads;               // [N * s]: the block's flat layout, padded (flat_gradients)
    at::Tensor pieces;                   // [N, s]
    std::unique_ptr<PendingCollectives> pending;
  };
  class GatheredModel;
  BlockShard make_shard(int block);
  void install_runner();  // the chain runs its blocks through run_block
  Prefetch start_gather(const BlockShard& b);  // issued, not waited for
  // Block b's full weights in its parameters: from its prefetch when one is current, else
  // gathered now.
  void gather(BlockShard& b);
  // shards_[k] gathered for `pass`, and the gathers of the next prefetch_depth_ blocks in that
  // pass's order started.
  void gather_in_pass(int k, GatherFor pass);
  void drop_prefetched();  // waits for the gathers started and not used, and frees them
  void set_views(BlockShard& b, const at::Tensor& flat);  // the parameters become views of a flat block
  static at::Tensor laid_out_flat(const BlockShard& b, const std::vector<at::Tensor>& parts);  // parts at their offsets
  at::Tensor own_range(const BlockShard& b, const at::Tensor& flat) const;  // this rank's s elements of a flat block
  at::Tensor gather_to_rank0(const at::Tensor& piece, int64_t s, const char* what);  // rank 0: all ranks' pieces
  BlockState gather_state_to_rank0(BlockShard& b, torch::optim::Optimizer& sharded, const char* what);
  void keep_own_state(BlockShard& b, const BlockState& state, torch::optim::Optimizer& sharded, const OptimizerSpec& spec);
  void release(BlockShard& b);
  // The block's full gradients in its flat layout, padded to N ranges of s (zeros where a
  // parameter got none), each range one message; each parameter's gradient freed once copied.
  at::Tensor flat_gradients(const BlockShard& b, std::vector<at::Tensor> full_grads) const;
  at::Tensor reduce_to_shard(BlockShard& b, std::vector<at::Tensor> full_grads);
  at::Tensor sum_in_rank_order(at::Tensor mine, int owner);
  // Prefetch depth >= 1: block k's reduction started (the previous one finished first), and
  // the undefined tensor autograd then gets as its shard's gradient.
  at::Tensor reduce_in_flight(int k, std::vector<at::Tensor> full_grads);
  void start_reduction(int k, std::vector<at::Tensor> full_grads);
  void finish_reduction();  // waits, sums in rank order into the shard's .grad; none pending: nothing
  void drop_reduction();    // waits, and lets the gradients go
  at::Tensor run_block(int index, const at::Tensor& x, const BlockFn& run);
  // Runs `use`, then releases block b, also when `use` throws.
  void release_after(BlockShard& b, const std::function<void()>& use);

  int64_t total_bytes_ = 0;
  int64_t owned_bytes_ = 0;
  std::vector<BlockShard> shards_;     // the blocks with parameters, in order
  std::vector<int> shard_of_block_;    // index into shards_ per block, -1 without parameters
  int prefetch_depth_ = 0;
  std::map<int, Prefetch> prefetched_;  // by block index: gathers started ahead of their use
  Reduction reduction_;                 // in flight while the next block's backward runs
};

// Selected for several ranks at ZeRO stage 3; refuses saving or resuming 8-bit state and a
// pinned schedule that does not recompute every block.
StrategyEntry zero_sharded_entry();

}  // namespace memfit
