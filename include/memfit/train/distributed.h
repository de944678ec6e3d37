// distributed.h — data-parallel training over torch.distributed's C++ core (c10d), with the
// optimizer state (ZeRO stage 1), the gradients (stage 2) and the weights (stage 3) sharded
// across ranks.
//
// Every rank runs forward + backward on its contiguous slice of the global batch (and, at
// stages 0-2, holds all weights), each micro-batch's loss weighted by its share of the
// *global* batch; gradients are SUM-reduced, so the update equals single-process training on
// the same global batch.
//
//   stage 0: gradients all-reduced, every rank runs the optimizer over every parameter;
//   stage 1: gradients all-reduced, rank r runs the optimizer only over the parameters it owns
//            (a contiguous range, balanced by bytes): optimizer state per rank ~ 1/N; owners
//            broadcast the updated parameters;
//   stage 2: as 1, but each gradient is reduced to its owner only and the others release
//            theirs (set to none): gradient bytes per rank at the optimizer step ~ 1/N;
//   stage 3: weights, gradients and optimizer state all ~ 1/N per rank. Each block's
//            parameters are laid out flat (in order, padded to a multiple of N) and rank r
//            keeps elements [r*s, (r+1)*s) as one leaf tensor, its shard, which the optimizer
//            steps (any family: elementwise ones give single-process numbers). Between uses
//            the chain's parameters hold no storage. The chain runs each block through
//            checkpoint_gathered (techniques/checkpoint.h): its parameters are gathered (one
//            c10d broadcast per owner) before its forward and again before its recompute and
//            backward, released after each, and as soon as its backward ends its full
//            gradients are summed for their owners, range by range, along a chain of c10d
//            sends in rank order (Gloo has no reduce_scatter, and its reduce sums in an order
//            of its own): the sums, so the weights, equal single-process training bit for bit.
//            At most one block is gathered at a time (no prefetch). Construct it from the
//            Chain; optimized_parameters() are the shards. Saving gathers one block at a
//            time on rank 0 (its weights and fp32 optimizer state), which writes that block's
//            part of the single-process format; resuming reads one block's part at a time and
//            keeps this rank's shards of it.
//
//   memfit::DistributedContext ctx(options);                  // rendezvous at options.master
//   memfit::ShardedDataParallel sdp(ctx, *chain, 2);           // stage 3 likewise, from the chain
//   auto optimizer = memfit::make_optimizer(spec, sdp.optimized_parameters());  // any family
//   for (...) { forward_backward(... weight = samples / global batch ...);
//               sdp.reduce_gradients(); optimizer->step(); sdp.finish_step(set_to_none); }
//
// Backends: Gloo on CPU; NCCL when memfit is built against a CUDA LibTorch. Every failure of
// the rendezvous or of a collective (a peer died, a timeout) throws DistributedError.
#pragma once

#include <ATen/ATen.h>
#include <torch/optim/optimizer.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "memfit/plan/rank_states.h"
#include "memfit/runtime/chain.h"
#include "memfit/runtime/optimizer.h"

namespace memfit {

struct DistributedOptions {
  int world_size = 1;                   // 1: not distributed
  int rank = 0;
  std::string master = "127.0.0.1:29500";  // HOST:PORT of the rendezvous store rank 0 opens
  int zero_stage = 0;                   // 0 to 3 (see above)
  double timeout_seconds = 30;          // rendezvous and every collective
  std::string backend = "auto";         // auto (gloo on CPU) | gloo | nccl
  bool enabled() const { return world_size > 1; }
};

// Throws OptionError naming the option (distributed.world_size, .rank, .master, .timeout,
// .backend, zero_stage).
void validate(const DistributedOptions& options);

// HOST:PORT split; throws OptionError naming distributed.master.
std::pair<std::string, int> parse_master(const std::string& master);

// The rendezvous failed, or a collective did (a peer exited, a timeout): one line, saying which.
class DistributedError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// A c10d process group of world_size ranks joined through a TCPStore on rank 0.
class DistributedContext {
 public:
  // Blocks until every rank has joined or options.timeout_seconds pass.
  explicit DistributedContext(const DistributedOptions& options);
  ~DistributedContext();
  DistributedContext(const DistributedContext&) = delete;
  DistributedContext& operator=(const DistributedContext&) = delete;

  int rank() const { return options_.rank; }
  int world_size() const { return options_.world_size; }
  const DistributedOptions& options() const { return options_; }
  std::string backend_name() const;

  // Collectives on one tensor each; each call returns when it is done on this rank. `what`
  // names the operation in errors.
  void all_reduce_sum(const at::Tensor& tensor, const char* what);
  void reduce_sum(const at::Tensor& tensor, int root, const char* what);
  void broadcast(const at::Tensor& tensor, int root, const char* what);
  void send(const at::Tensor& tensor, int to, const char* what);
  void receive(const at::Tensor& tensor, int from, const char* what);

  // `root`'s text, on every rank (the others' `text` is ignored).
  std::string broadcast_string(const std::string& text, int root, const char* what);
  // Every rank's values (same count on every rank), rank by rank.
  std::vector<std::vector<int64_t>> all_gather(const std::vector<int64_t>& values, const char* what);
  // Throws std::invalid_argument naming the first value on which ranks differ: the flags that
  // must agree (model shape, batch, steps, stage) are checked before training starts, so a
  // mismatch is one clear line rather than a hang in a collective.
  void check_same_on_all_ranks(const std::vector<std::pair<std::string, int64_t>>& named_values);

 private:
  friend class ShardedDataParallel;
  struct Impl;
  DistributedOptions options_;
  std::unique_ptr<Impl> impl_;
};

// Rank `rank`'s contiguous part of a global batch of `batch` samples: the first batch % world
// ranks take one sample more. Rank order is sample order, so the ranks together see exactly
// the samples a single process would.
struct BatchSlice {
  int64_t start = 0;
  int64_t length = 0;
};
BatchSlice rank_slice(int64_t batch, int rank, int world_size);

class ShardedDataParallel {
 public:
  // Partitions `parameters` (the same model, in the same order, on every rank), checks that
  // every rank has the same number and bytes of parameters, and broadcasts rank 0's weights so
  // that all ranks start equal.
  ShardedDataParallel(DistributedContext& context, std::vector<at::Tensor> parameters, int zero_stage);
  // Any stage; stage 3 needs the chain (the unit gathered is its block). The chain's
  // parameters lose their storage here and it runs its blocks through this object from now
  // on: it must outlive every forward and backward of the chain.
  ShardedDataParallel(DistributedContext& context, Chain& chain, int zero_stage);
  ~ShardedDataParallel();
  ShardedDataParallel(const ShardedDataParallel&) = delete;
  ShardedDataParallel& operator=(const ShardedDataParallel&) = delete;

  int zero_stage() const { return stage_; }
  int rank() const { return context_.rank(); }
  int world_size() const { return context_.world_size(); }
  int owner(size_t parameter_index) const { return owner_.at(parameter_index); }
  bool owns(size_t parameter_index) const { return owner(parameter_index) == rank(); }

  // What this rank's optimizer must step: every parameter at stage 0, its own range at 1 and
  // 2, its shard of every block with parameters at 3.
  std::vector<at::Tensor> optimized_parameters() const;
  // Bytes of all parameters, and of this rank's range (stage 3: its shards, padding included).
  int64_t parameter_bytes() const { return total_bytes_; }
  int64_t owned_bytes() const { return owned_bytes_; }

  // After the last micro-batch's backward: SUM-reduce the gradients (all-reduce at stages 0
  // and 1; reduce to each owner at stage 2, the others released). A parameter without a
  // gradient on this rank contributes zeros. Nothing at stage 3 (backward reduced them).
  void reduce_gradients();
  // After the optimizer step (which released or zeroed the gradients of the optimized
  // parameters): at stages 1 and 2 owners broadcast their updated parameters, and at stage 1
  // the gradients of the parameters this rank does not own are released (or zeroed).
  void finish_step(bool set_to_none);

  // Saving (stages 1 and 2; every rank calls it): rank 0 receives every other rank's state of
  // `sharded` (this rank's optimizer, built from `spec`) and returns an optimizer of `spec`
  // over all parameters holding the whole state, so that rank 0 saves the single-process
  // format; the other ranks get nullptr. Any torch::optim family (runtime/optimizer.h).
  std::unique_ptr<torch::optim::Optimizer> gather_optimizer_state(torch::optim::Optimizer& sharded,
                                                                  const OptimizerSpec& spec);
  // Resuming (stages 1 and 2): keep of `full` (loaded from a saved file) only the state of the
  // parameters this rank owns, moved into `sharded`.
  void keep_owned_state(torch::optim::Optimizer& full, torch::optim::Optimizer& sharded) const;

  // Stage 3 (every rank calls them) ---------------------------------------------------------
  // Each block of the chain: its parameters' bytes in full, and this rank's shard of them
  // (0 and 0 for a block without parameters). What the planner counts.
  std::vector<GatheredBlockBytes> block_bytes() const;
  // Gathers the blocks one at a time, in order, calls `visit` with each block's parameters
  // (full values) and releases them: hashing, dumping. One block's bytes at a time.
  void for_each_gathered_block(const std::function<void(const std::vector<at::Tensor>&)>& visit);
  // Saving, one block at a time (fp32 state of any family; every rank calls it): for each block
  // in order, rank 0 receives every rank's shard of its weights (into the chain's parameters)
  // and of their optimizer state, runs `write(block, state)` with the state of each of the
  // block's parameters (Chain::block_parameters order; none before the first step), then
  // releases the block. Blocks without parameters are written too. Rank 0 holds at most the
  // largest block's weights and state beside its shards (the trainer plans for those bytes).
  using BlockState = std::vector<std::optional<ParamStateRecord>>;  // per parameter of a block
  void for_each_gathered_block_state(torch::optim::Optimizer& sharded, const OptimizerSpec& spec,
                                     const std::function<void(int block, const BlockState& state)>& write);
  // Resuming, one block at a time: for each block in order, the block is gathered, `load(block)`
  // fills its parameters (whole values) and returns their saved state, and each rank keeps its
  // range of both (the state moved into `sharded`); then the block is released. Throws
  // std::runtime_error if a block's parameters were saved with unequal optimizer steps (a
  // shard has one).
  void load_block_states(const std::function<BlockState(int block)>& load, torch::optim::Optimizer& sharded,
                         const OptimizerSpec& spec);
  // Every block gathered and the chain running plainly, for the life of the scope: profiling
  // the model as a single process would run it (it holds the whole model meanwhile).
  class FullWeights {
   public:
    explicit FullWeights(ShardedDataParallel& sdp);
    ~FullWeights();
    FullWeights(const FullWeights&) = delete;
    FullWeights& operator=(const FullWeights&) = delete;

   private:
    ShardedDataParallel& sdp_;
  };

 private:
  // Stage 3: one block's parameters, laid out flat.
  struct BlockShard {
    int block = 0;
    std::vector<at::Tensor> params;  // the chain's; 0 elements while not gathered
    std::vector<int64_t> offsets;    // each parameter's first element in the flat layout
    std::vector<std::vector<int64_t>> shapes;  // each parameter's shape in full
    int64_t numel = 0;               // the parameters' elements
    int64_t shard_numel = 0;         // s: each rank's elements, numel padded to a multiple of N, / N
    at::Tensor shard;                // this rank's s elements: a leaf requiring grad
  };
  ShardedDataParallel(DistributedContext& context, std::vector<at::Tensor> parameters, int zero_stage, Chain* chain);
  void shard_blocks();
  void install_runner();  // the chain runs its blocks through run_block
  void gather(BlockShard& b);
  void set_views(BlockShard& b, const at::Tensor& flat);  // the parameters become views of a flat block
  at::Tensor own_range(const BlockShard& b, const at::Tensor& flat) const;  // this rank's s elements of a flat block
  at::Tensor gather_to_rank0(const at::Tensor& piece, int64_t s, const char* what);  // rank 0: all ranks' pieces
  BlockState gather_state_to_rank0(BlockShard& b, torch::optim::Optimizer& sharded, const char* what);
  void keep_own_state(BlockShard& b, const BlockState& state, torch::optim::Optimizer& sharded, const OptimizerSpec& spec);
  void release(BlockShard& b);
  at::Tensor reduce_to_shard(BlockShard& b, std::vector<at::Tensor> full_grads);
  at::Tensor sum_in_rank_order(at::Tensor mine, int owner);
  at::Tensor run_block(int index, const at::Tensor& x, const BlockFn& run);

  void send_param_state(torch::optim::Optimizer& sharded, const compat::OptimizerStateKey& key, size_t slots, const char* what);
  void receive_param_state(torch::optim::Optimizer& full, size_t index, int from, const OptimizerSpec& spec,
                           const char* what);

  DistributedContext& context_;
  std::vector<at::Tensor> parameters_;
  std::vector<int> owner_;
  int stage_;
  int64_t total_bytes_ = 0;
  int64_t owned_bytes_ = 0;
  Chain* chain_ = nullptr;             // stage 3
  std::vector<BlockShard> shards_;     // stage 3: the blocks with parameters, in order
  std::vector<int> shard_of_block_;    // stage 3: index into shards_ per block, -1 without parameters
};

}  // namespace memfit
