#include "memfit/techniques/checkpoint.h"

#include <torch/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/utils.h>

#include <utility>

#include "memfit/compat.h"
#include "memfit/measure/memory_tracker.h"
#include "memfit/techniques/autocast.h"
#include "memfit/techniques/rng.h"

namespace memfit {
namespace {

// What the block runs on, in the forward and in the recompute: the saved input itself, or a
// copy where the block may write into its input (the saved input is the caller's tensor: the
// chain's input, another block's output).
at::Tensor input_for_block(const at::Tensor& input, bool block_may_write_input) {
  at::NoGradGuard no_grad;
  return block_may_write_input ? input.clone() : input;
}

// The block's first pass (without grad), the input its recompute starts from (the saved
// input, which must still hold what the block first read), and whether the block writes into
// its input (kYes or kNo: known once it has run).
struct FirstPass {
  at::Tensor output;
  at::Tensor saved_input;
  InputWrites writes = InputWrites::kNo;
};

FirstPass run_first_pass(const BlockFn& block, const at::Tensor& input, InputWrites writes) {
  // An inference tensor has no version counter, and no block may write into it outside
  // inference mode.
  if (writes == InputWrites::kUnknown && input.is_inference()) writes = InputWrites::kNo;
  if (writes != InputWrites::kUnknown) {
    return {block(input_for_block(input, writes == InputWrites::kYes)), input, writes};
  }
  // The block runs on the input itself, as in a plain run: a copy would be aligned otherwise,
  // and BLAS kernels (MKL's) may round differently on it.
  at::Tensor before = input_for_block(input, true);
  const int64_t version = input._version();
  at::Tensor output = block(input);
  if (input._version() == version) return {output, input, InputWrites::kNo};
  before.requires_grad_(input.requires_grad());  // it stands for the input in the recompute
  return {output, before, InputWrites::kYes};
}

// Where the gradient arriving for a recompute's input is left (RecomputeInput's backward).
struct InputGradient : torch::CustomClassHolder {
  at::Tensor grad;
};

// The identity as the first node of a recomputed graph: its output is the block's input, not a
// leaf (an in-place first op is allowed, as on any block's input in a plain run), held by
// nothing but the graph (a copy the block writes into goes once the block's backward is done
// with it); the gradient arriving for it is left in `sink`. `anchor`, a scalar leaf that
// requires grad, makes the output require grad and gives backward a path to this node.
class RecomputeInput : public torch::autograd::Function<RecomputeInput> {
 public:
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, const at::Tensor& data, const at::Tensor& anchor,
                            c10::intrusive_ptr<InputGradient> sink) {
    (void)anchor;
    ctx->saved_data["sink"] = c10::IValue::make_capsule(std::move(sink));
    return data.detach();
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    auto sink = c10::static_intrusive_pointer_cast<InputGradient>(ctx->saved_data["sink"].toCapsule());
    sink->grad = grad_outputs[0];
    return {at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// A recomputed block: its output, and where its input's gradient arrives (differentiating
// w.r.t. `anchor` reaches it; both undefined where the input needs no gradient).
struct Recomputed {
  at::Tensor output;
  at::Tensor anchor;
  c10::intrusive_ptr<InputGradient> input_gradient;
};

// The block run again on its saved input, with grad, under the random and autocast state of
// its first forward.
Recomputed recompute_block(const at::Tensor& input, const BlockFn& block, const RngState& rng_state,
                           const AutocastState& autocast, bool block_may_write_input) {
  torch::AutoGradMode grad_on(true);
  Recomputed r;
  at::Tensor x = input_for_block(input, block_may_write_input).detach();
  if (input.requires_grad()) {
    r.anchor = at::zeros({}, input.options()).requires_grad_(true);
    r.input_gradient = c10::make_intrusive<InputGradient>();
    x = RecomputeInput::apply(x, r.anchor, r.input_gradient);
  }
  PhaseGuard recompute(Phase::kRecompute);
  RngStateGuard rng(rng_state);
  Autocast cpu_autocast(c10::kCPU, autocast.cpu_dtype, autocast.cpu_enabled);
  Autocast cuda_autocast(c10::kCUDA, autocast.cuda_dtype, autocast.cuda_enabled);
  r.output = block(x);
  return r;
}

// What a checkpointed block saves for backward as autograd's saved variables: its input and the
// random state its forward drew from (CPU's, and the input's CUDA device's when it lives there).
// Autograd frees saved variables once the node's backward has run (unless the graph is
// retained), as the plan counts them; in the node's capsule they would live until the graph is
// destroyed, past the step's backward.
struct SavedForRecompute {
  at::Tensor input;
  RngState rng;
};

void save_for_recompute(torch::autograd::AutogradContext* ctx, const at::Tensor& input, const RngState& rng) {
  ctx->save_for_backward({input, rng.cpu, rng.cuda});
  ctx->saved_data["cuda_device"] = static_cast<int64_t>(rng.cuda_device);
}

SavedForRecompute saved_for_recompute(torch::autograd::AutogradContext* ctx) {
  const auto saved = ctx->get_saved_variables();
  RngState rng{saved[1], saved[2], static_cast<int>(ctx->saved_data["cuda_device"].toInt())};
  return {saved[0], std::move(rng)};
}

// What the recompute needs besides what is saved for it: the block, and the autocast state the
// forward ran with.
struct CheckpointState : torch::CustomClassHolder {
  BlockFn block;
  RngState rng;  // until the forward saves it (save_for_recompute)
  AutocastState autocast;
  std::vector<at::Tensor> params;  // the parameters themselves (leaves: no copy is made)
  std::vector<at::Tensor> buffers;  // updated in place by the block (BatchNorm statistics)
  InputWrites input_writes = InputWrites::kNo;  // the forward turns kUnknown into kYes or kNo
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
    FirstPass pass = run_first_pass(state->block, input, state->input_writes);
    save_for_recompute(ctx, pass.saved_input, std::exchange(state->rng, RngState{}));
    state->input_writes = pass.writes;
    ctx->saved_data["state"] = c10::IValue::make_capsule(state);
    return pass.output;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const SavedForRecompute saved = saved_for_recompute(ctx);
    auto state = c10::static_intrusive_pointer_cast<CheckpointState>(
        ctx->saved_data["state"].toCapsule());
    const std::vector<at::Tensor>& params = state->params;

    // Until the recomputed graph is differentiated (BatchNorm's backward reads its statistics).
    BufferGuard buffers(state->buffers);
    const Recomputed r = recompute_block(saved.input, state->block, saved.rng, state->autocast, state->input_writes == InputWrites::kYes);

    // Differentiate the recomputed graph w.r.t. the input and the parameters. The parameters'
    // gradients go into their .grad as the recomputed graph's backward makes them (as in a plain
    // run: a later micro-batch's new gradient is freed once added), not held as results until
    // the whole segment's backward returns; the input's comes back from its leaf.
    std::vector<at::Tensor> wrt;
    if (r.anchor.defined()) wrt.push_back(r.anchor);
    for (const at::Tensor& p : params) {
      if (p.requires_grad()) wrt.push_back(p);
    }
    if (!wrt.empty() && r.output.requires_grad()) {
      torch::autograd::backward({r.output}, {grad_outputs[0]}, /*retain_graph=*/false, /*create_graph=*/false, wrt);
    }

    // One gradient per forward argument: input, each parameter (already added), and the
    // (non-tensor) state.
    torch::autograd::variable_list out;
    out.push_back(r.input_gradient ? r.input_gradient->grad : at::Tensor());
    for (size_t i = 0; i < params.size(); ++i) out.push_back(at::Tensor());
    out.push_back(at::Tensor());
    return out;
  }
};

// Gathered for the life of the scope (released on the way out, on errors too).
class GatheredScope {
 public:
  GatheredScope(const GatheredParams& g, GatherFor pass) : g_(g) { g_.gather(pass); }
  ~GatheredScope() { g_.release(); }
  GatheredScope(const GatheredScope&) = delete;
  GatheredScope& operator=(const GatheredScope&) = delete;

 private:
  const GatheredParams& g_;
};

struct GatheredState : torch::CustomClassHolder {
  BlockFn block;
  RngState rng;  // until the forward saves it (save_for_recompute)
  AutocastState autocast;
  GatheredParams gathered;
  std::vector<at::Tensor> buffers;
  InputWrites input_writes = InputWrites::kNo;  // the forward turns kUnknown into kYes or kNo
};

class GatheredFunction : public torch::autograd::Function<GatheredFunction> {
 public:
  // `shard` is an argument only so that autograd routes its gradient (backward's return).
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, at::Tensor input, at::Tensor shard,
                            c10::intrusive_ptr<GatheredState> state) {
    (void)shard;
    GatheredScope gathered(state->gathered, GatherFor::kForward);
    FirstPass pass = run_first_pass(state->block, input, state->input_writes);
    save_for_recompute(ctx, pass.saved_input, std::exchange(state->rng, RngState{}));
    state->input_writes = pass.writes;
    ctx->saved_data["state"] = c10::IValue::make_capsule(state);
    return pass.output;
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const SavedForRecompute saved = saved_for_recompute(ctx);
    auto state = c10::static_intrusive_pointer_cast<GatheredState>(ctx->saved_data["state"].toCapsule());
    const std::vector<at::Tensor>& params = state->gathered.params;
    std::vector<at::Tensor> full_grads(params.size());
    at::Tensor input_grad;
    {
      GatheredScope gathered(state->gathered, GatherFor::kBackward);
      BufferGuard buffers(state->buffers);
      const Recomputed r = recompute_block(saved.input, state->block, saved.rng, state->autocast, state->input_writes == InputWrites::kYes);
      std::vector<at::Tensor> wrt(params.begin(), params.end());
      if (r.anchor.defined()) wrt.push_back(r.anchor);
      if (r.output.requires_grad()) {
        auto grads = torch::autograd::grad({r.output}, wrt, {grad_outputs[0]}, /*retain_graph=*/false,
                                           /*create_graph=*/false, /*allow_unused=*/true);
        std::move(grads.begin(), grads.begin() + static_cast<int64_t>(params.size()), full_grads.begin());
        if (r.input_gradient) input_grad = r.input_gradient->grad;
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

at::Tensor checkpoint_gathered(BlockFn block, const at::Tensor& input, const at::Tensor& shard, GatheredParams gathered,
                               std::vector<at::Tensor> buffers, InputWrites input_writes) {
  if (!at::GradMode::is_enabled()) {
    GatheredScope scope(gathered, GatherFor::kForward);
    return block(input);
  }
  auto state = c10::make_intrusive<GatheredState>();
  state->block = std::move(block);
  state->rng = capture_rng(input.device());
  state->autocast = AutocastState::capture();
  state->gathered = std::move(gathered);
  state->buffers = std::move(buffers);
  state->input_writes = input_writes;
  return GatheredFunction::apply(input, shard, state);
}

at::Tensor checkpoint(BlockFn block, const at::Tensor& input, at::TensorList params, std::vector<at::Tensor> buffers,
                      InputWrites input_writes) {
  if (!at::GradMode::is_enabled()) return block(input);  // nothing to save in evaluation

  auto state = c10::make_intrusive<CheckpointState>();
  state->block = std::move(block);
  state->rng = capture_rng(input.device());
  state->autocast = AutocastState::capture();
  state->params = params.vec();
  state->buffers = std::move(buffers);
  state->input_writes = input_writes;
  return CheckpointFunction::apply(input, params, state);
}

}  // namespace memfit
