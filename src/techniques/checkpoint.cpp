#include "memfit/techniques/checkpoint.h"

#include <torch/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/utils.h>

#include "memfit/compat.h"
#include "memfit/measure/memory_tracker.h"
#include "memfit/techniques/autocast.h"
#include "memfit/techniques/rng.h"

namespace memfit {
namespace {

// The identity, as a node of the graph: its output shares the input's storage (no copy) but is
// not a leaf, and not a view of one, so the block may write into it in place. (A view of a leaf
// that requires grad may not be written into either.)
class NonLeafAlias : public torch::autograd::Function<NonLeafAlias> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext*, const at::Tensor& x) { return x.detach(); }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*, torch::autograd::variable_list g) {
    return {g[0]};
  }
};

// What the block runs on, in the forward and in the recompute: the saved input itself, or a
// copy where the block may write into its input (the saved input is the caller's tensor: the
// chain's input, another block's output).
at::Tensor input_for_block(const at::Tensor& input, bool block_may_write_input) {
  at::NoGradGuard no_grad;
  return block_may_write_input ? input.clone() : input;
}

// The block run again on its saved input, with grad, under the random and autocast state of
// its first forward: the leaf that gradients are taken against and the output, whose graph
// backward then differentiates.
std::pair<at::Tensor, at::Tensor> recompute_block(const at::Tensor& input, const BlockFn& block, const RngState& rng_state,
                                                  const AutocastState& autocast, bool block_may_write_input) {
  torch::AutoGradMode grad_on(true);
  const BlockInput x = block_input(input_for_block(input, block_may_write_input), input.requires_grad());
  PhaseGuard recompute(Phase::kRecompute);
  RngStateGuard rng(rng_state);
  Autocast cpu_autocast(c10::kCPU, autocast.cpu_dtype, autocast.cpu_enabled);
  Autocast cuda_autocast(c10::kCUDA, autocast.cuda_dtype, autocast.cuda_enabled);
  at::Tensor y = block(x.input);
  return {x.leaf, y};
}

// What the recompute needs besides the saved input: the block, and the random and autocast
// state the forward ran with.
struct CheckpointState : torch::CustomClassHolder {
  BlockFn block;
  RngState rng;  // CPU's, and the input's CUDA device's when it lives there
  AutocastState autocast;
  std::vector<at::Tensor> params;  // the parameters themselves (leaves: no copy is made)
  std::vector<at::Tensor> buffers;  // updated in place by the block (BatchNorm statistics)
  bool block_may_write_input = false;
};

// Puts buffers back, at the end of a scope, to their values at its start: the recompute runs
// the block a second time, and its running statistics must count the batch once.
class BufferGuard {
 public:
  explicit BufferGuard(const std::vector<at::Tensor>& buffers) : buffers_(buffers) {
    at::NoGradGuard no_grad;
    for (const auto& b : buffers_) saved_.push_back(b.clone());
  }
  ~BufferGuard() {
    at::NoGradGuard no_grad;
    for (size_t i = 0; i < buffers_.size(); ++i) buffers_[i].copy_(saved_[i]);
  }

 private:
  const std::vector<at::Tensor>& buffers_;
  std::vector<at::Tensor> saved_;
};

class CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
 public:
  // Runs without grad (Function::apply disables it): only `input` is saved.
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, at::Tensor input,
                            at::TensorList params, c10::intrusive_ptr<CheckpointState> state) {
    (void)params;
    ctx->save_for_backward({input});
    ctx->saved_data["state"] = c10::IValue::make_capsule(state);
    return state->block(input_for_block(input, state->block_may_write_input));
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const at::Tensor input = ctx->get_saved_variables()[0];
    auto state = c10::static_intrusive_pointer_cast<CheckpointState>(
        ctx->saved_data["state"].toCapsule());
    const std::vector<at::Tensor>& params = state->params;

    // Until the recomputed graph is differentiated (BatchNorm's backward reads its statistics).
    BufferGuard buffers(state->buffers);
    auto [x, y] = recompute_block(input, state->block, state->rng, state->autocast, state->block_may_write_input);

    // Differentiate the recomputed graph w.r.t. the input and the parameters. The parameters'
    // gradients go into their .grad as the recomputed graph's backward makes them (as in a plain
    // run: a later micro-batch's new gradient is freed once added), not held as results until
    // the whole segment's backward returns; the input's comes back from its leaf.
    std::vector<at::Tensor> wrt;
    if (x.requires_grad()) wrt.push_back(x);
    for (const at::Tensor& p : params) {
      if (p.requires_grad()) wrt.push_back(p);
    }
    if (!wrt.empty() && y.requires_grad()) {
      torch::autograd::backward({y}, {grad_outputs[0]}, /*retain_graph=*/false, /*create_graph=*/false, wrt);
    }

    // One gradient per forward argument: input, each parameter (already added), and the
    // (non-tensor) state.
    torch::autograd::variable_list out;
    out.push_back(x.requires_grad() ? x.grad() : at::Tensor());
    for (size_t i = 0; i < params.size(); ++i) out.push_back(at::Tensor());
    out.push_back(at::Tensor());
    return out;
  }
};

// Gathered for the life of the scope (released on the way out, on errors too).
class GatheredScope {
 public:
  explicit GatheredScope(const GatheredParams& g) : g_(g) { g_.gather(); }
  ~GatheredScope() { g_.release(); }
  GatheredScope(const GatheredScope&) = delete;
  GatheredScope& operator=(const GatheredScope&) = delete;

 private:
  const GatheredParams& g_;
};

struct GatheredState : torch::CustomClassHolder {
  BlockFn block;
  RngState rng;
  AutocastState autocast;
  GatheredParams gathered;
  std::vector<at::Tensor> buffers;
  bool block_may_write_input = false;
};

class GatheredFunction : public torch::autograd::Function<GatheredFunction> {
 public:
  // `shard` is an argument only so that autograd routes its gradient (backward's return).
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, at::Tensor input, at::Tensor shard,
                            c10::intrusive_ptr<GatheredState> state) {
    (void)shard;
    ctx->save_for_backward({input});
    ctx->saved_data["state"] = c10::IValue::make_capsule(state);
    GatheredScope gathered(state->gathered);
    return state->block(input_for_block(input, state->block_may_write_input));
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const at::Tensor input = ctx->get_saved_variables()[0];
    auto state = c10::static_intrusive_pointer_cast<GatheredState>(ctx->saved_data["state"].toCapsule());
    const std::vector<at::Tensor>& params = state->gathered.params;
    std::vector<at::Tensor> full_grads(params.size());
    at::Tensor input_grad;
    {
      GatheredScope gathered(state->gathered);
      BufferGuard buffers(state->buffers);
      auto [x, y] = recompute_block(input, state->block, state->rng, state->autocast, state->block_may_write_input);
      std::vector<at::Tensor> wrt(params.begin(), params.end());
      if (x.requires_grad()) wrt.push_back(x);
      if (y.requires_grad()) {
        auto grads = torch::autograd::grad({y}, wrt, {grad_outputs[0]}, /*retain_graph=*/false,
                                           /*create_graph=*/false, /*allow_unused=*/true);
        std::move(grads.begin(), grads.begin() + static_cast<int64_t>(params.size()), full_grads.begin());
        if (x.requires_grad()) input_grad = grads.back();
      }
    }
    // reduce may work in place on the full gradients: none may share the input gradient's
    // storage (a parameter added as is passes the incoming gradient through unchanged).
    for (auto& g : full_grads) {
      if (g.defined() && input_grad.defined() && g.is_alias_of(input_grad)) g = g.clone();
    }
    // Reduced after the weights are released: the full gradients are then the block's only
    // full-size tensors.
    at::Tensor shard_grad = state->gathered.reduce(std::move(full_grads));
    return {input_grad, shard_grad, at::Tensor()};
  }
};

}  // namespace

BlockInput block_input(const at::Tensor& x, bool requires_grad) {
  at::Tensor leaf = x.detach();
  if (!requires_grad) return {leaf, leaf};
  leaf.requires_grad_(true);
  return {leaf, NonLeafAlias::apply(leaf)};
}

at::Tensor checkpoint_gathered(BlockFn block, const at::Tensor& input, const at::Tensor& shard, GatheredParams gathered,
                               std::vector<at::Tensor> buffers, bool block_may_write_input) {
  if (!at::GradMode::is_enabled()) {
    GatheredScope scope(gathered);
    return block(input);
  }
  auto state = c10::make_intrusive<GatheredState>();
  state->block = std::move(block);
  state->rng = capture_rng(input.device());
  state->autocast = AutocastState::capture();
  state->gathered = std::move(gathered);
  state->buffers = std::move(buffers);
  state->block_may_write_input = block_may_write_input;
  return GatheredFunction::apply(input, shard, state);
}

at::Tensor checkpoint(BlockFn block, const at::Tensor& input, at::TensorList params, std::vector<at::Tensor> buffers,
                      bool block_may_write_input) {
  if (!at::GradMode::is_enabled()) return block(input);  // nothing to save in evaluation

  auto state = c10::make_intrusive<CheckpointState>();
  state->block = std::move(block);
  state->rng = capture_rng(input.device());
  state->autocast = AutocastState::capture();
  state->params = params.vec();
  state->buffers = std::move(buffers);
  state->block_may_write_input = block_may_write_input;
  return CheckpointFunction::apply(input, params, state);
}

}  // namespace memfit
