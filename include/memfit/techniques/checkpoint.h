// checkpoint.h — activation checkpointing for any block: forward keeps only the block's input,
// backward runs the block again (with gradients) and differentiates the recomputed graph.
//
//   y = memfit::checkpoint([&](const torch::Tensor& x) { return block->forward(x); },
//                          x, block->parameters());
//
// Semantics (those of torch.utils.checkpoint, reentrant variant, with its gaps closed):
// - CPU and CUDA random generator states are saved at forward and restored for the
//   recompute, so dropout draws the same masks: gradients equal the plain run's bit for bit.
// - The autocast state of the forward (enabled flags and dtypes) is re-applied in the recompute.
// - `params` are differentiable inputs of the checkpoint: they receive gradients even when
//   `input` does not require grad. Every tensor requiring grad that the block reads must be in
//   `params` (usually module->parameters()); one that is not gets no gradient.
// - Outside grad mode (evaluation) the block simply runs.
// - The recompute's backward adds the parameters' gradients into their .grad as it makes them
//   (as a plain run does), rather than holding them until the whole segment's backward is done.
// - `buffers` (BatchNorm's running statistics and the like) are updated once, by the forward:
//   the recompute's second update is undone (PyTorch's checkpoint updates them twice).
// - A block whose first op writes into its input (ReLU(inplace=True), x.add_(...)) works when
//   `input_writes` says kYes: the forward and the recompute each run it on a copy of the saved
//   input (the caller's tensor, left as it was), the recompute's as a tensor of the graph,
//   not a leaf. Gradients equal the plain run's. (PyTorch 1.13's reentrant checkpoint
//   refuses such a block; its non-reentrant one recomputes on the input the forward already
//   wrote into: SiLU(inplace=True) then gets wrong gradients.) With kUnknown the forward runs
//   on the caller's tensor, as a plain run does (a copy sits elsewhere in memory, and BLAS
//   kernels may round differently on differently aligned data), keeping a copy for the
//   recompute in case the block writes into it. With kNo, such a block writes into the saved input.
// Nested checkpoints work: a checkpointed block may itself checkpoint its parts.
#pragma once

#include <ATen/ATen.h>

#include <functional>
#include <vector>

namespace memfit {

using BlockFn = std::function<at::Tensor(const at::Tensor&)>;

// Whether a block writes into its input: known, or not yet (learned by running it).
enum class InputWrites : int8_t { kUnknown, kNo, kYes };

at::Tensor checkpoint(BlockFn block, const at::Tensor& input, at::TensorList params, std::vector<at::Tensor> buffers = {},
                      InputWrites input_writes = InputWrites::kNo);

// A block whose parameters exist in full only while gathered (ZeRO 3, train/zero_sharded.h):
// the hooks make `params` hold their full values, free them again, and turn the full
// gradients of `params` (undefined where unused) into this process's shard's gradient.
// `gather` is told which pass needs the weights: the next block to gather follows the pass's
// order (forward: the next block; backward: the previous one), which prefetching relies on.
enum class GatherFor { kForward, kBackward };
struct GatheredParams {
  std::vector<at::Tensor> params;
  std::function<void(GatherFor pass)> gather;
  std::function<void()> release;
  std::function<at::Tensor(std::vector<at::Tensor> full_grads)> reduce;
};

// checkpoint() for such a block: forward gathers, runs the block without grad, releases and
// keeps only `input`; backward gathers again, recomputes with grad (random, autocast and
// buffer state as in checkpoint()), differentiates, releases, and returns reduce(full grads)
// as the gradient of `shard` (a leaf holding this process's part of the parameters). Outside
// grad mode the block runs between gather and release. Every process must run the same blocks
// in the same order: the hooks may be collectives.
at::Tensor checkpoint_gathered(BlockFn block, const at::Tensor& input, const at::Tensor& shard, GatheredParams gathered,
                               std::vector<at::Tensor> buffers = {}, InputWrites input_writes = InputWrites::kNo);

}  // namespace memfit
