#include "memfit/checkpoint.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include <mutex>

#include "memfit/autocast.h"
#include "memfit/compat.h"
#include "memfit/memory_tracker.h"

#if MEMFIT_WITH_CUDA
#include <ATen/cuda/CUDAContext.h>
#include <ATen/cuda/CUDAGeneratorImpl.h>
#endif

namespace memfit {
namespace {

// What the recompute needs besides the saved input: the block, and the random and autocast
// state the forward ran with.
struct CheckpointState : torch::CustomClassHolder {
  BlockFn block;
  at::Tensor cpu_rng;
  at::Tensor cuda_rng;  // undefined unless the input lives on CUDA
  int cuda_device = -1;
  AutocastState autocast;
  std::vector<at::Tensor> params;  // the parameters themselves (leaves: no copy is made)
};

at::Tensor get_rng_state(at::Generator gen) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  return gen.get_state();
}

void set_rng_state(at::Generator gen, const at::Tensor& state) {
  std::lock_guard<std::mutex> lock(gen.mutex());
  gen.set_state(state);
}

at::Generator cuda_generator(int device) {
#if MEMFIT_WITH_CUDA
  return at::cuda::detail::getDefaultCUDAGenerator(device);
#else
  (void)device;
  TORCH_CHECK(false, "memfit: CUDA generator requested in a build without CUDA");
#endif
}

// Sets the generators to the forward's states for a scope, then puts the current ones back,
// so that recomputing does not disturb the random stream of the rest of the program.
class RngStateGuard {
 public:
  explicit RngStateGuard(const CheckpointState& s) : state_(s) {
    cpu_now_ = get_rng_state(at::detail::getDefaultCPUGenerator());
    set_rng_state(at::detail::getDefaultCPUGenerator(), s.cpu_rng);
    if (s.cuda_rng.defined()) {
      cuda_now_ = get_rng_state(cuda_generator(s.cuda_device));
      set_rng_state(cuda_generator(s.cuda_device), s.cuda_rng);
    }
  }
  ~RngStateGuard() {
    set_rng_state(at::detail::getDefaultCPUGenerator(), cpu_now_);
    if (state_.cuda_rng.defined()) set_rng_state(cuda_generator(state_.cuda_device), cuda_now_);
  }

 private:
  const CheckpointState& state_;
  at::Tensor cpu_now_, cuda_now_;
};

class CheckpointFunction : public torch::autograd::Function<CheckpointFunction> {
 public:
  // Runs without grad (Function::apply disables it): only `input` is saved.
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, at::Tensor input,
                            at::TensorList params, c10::intrusive_ptr<CheckpointState> state) {
    (void)params;
    ctx->save_for_backward({input});
    ctx->saved_data["state"] = c10::IValue::make_capsule(state);
    return state->block(input);
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grad_outputs) {
    const at::Tensor input = ctx->get_saved_variables()[0];
    auto state = c10::static_intrusive_pointer_cast<CheckpointState>(
        ctx->saved_data["state"].toCapsule());
    const std::vector<at::Tensor>& params = state->params;

    at::Tensor x = input.detach();
    x.requires_grad_(input.requires_grad());
    at::Tensor y;
    {
      torch::AutoGradMode grad_on(true);
      PhaseGuard recompute(Phase::kRecompute);
      RngStateGuard rng(*state);
      Autocast cpu_autocast(c10::kCPU, state->autocast.cpu_dtype, state->autocast.cpu_enabled);
      Autocast cuda_autocast(c10::kCUDA, state->autocast.cuda_dtype, state->autocast.cuda_enabled);
      y = state->block(x);
    }

    // Differentiate the recomputed graph w.r.t. the input and the parameters.
    std::vector<at::Tensor> wrt;
    if (x.requires_grad()) wrt.push_back(x);
    for (const at::Tensor& p : params) {
      if (p.requires_grad()) wrt.push_back(p);
    }
    std::vector<at::Tensor> grads;
    if (!wrt.empty() && y.requires_grad()) {
      grads = torch::autograd::grad({y}, wrt, {grad_outputs[0]}, /*retain_graph=*/false,
                                    /*create_graph=*/false, /*allow_unused=*/true);
    } else {
      grads.assign(wrt.size(), at::Tensor());
    }

    // One gradient per forward argument: input, each parameter, and the (non-tensor) state.
    torch::autograd::variable_list out;
    size_t next = 0;
    out.push_back(x.requires_grad() ? grads[next++] : at::Tensor());
    for (const at::Tensor& p : params) out.push_back(p.requires_grad() ? grads[next++] : at::Tensor());
    out.push_back(at::Tensor());
    return out;
  }
};

}  // namespace

at::Tensor checkpoint(BlockFn block, const at::Tensor& input, at::TensorList params) {
  if (!at::GradMode::is_enabled()) return block(input);  // nothing to save in evaluation

  auto state = c10::make_intrusive<CheckpointState>();
  state->block = std::move(block);
  state->cpu_rng = get_rng_state(at::detail::getDefaultCPUGenerator());
  if (input.is_cuda()) {
    state->cuda_device = input.get_device();
    state->cuda_rng = get_rng_state(cuda_generator(state->cuda_device));
  }
  state->autocast = AutocastState::capture();
  state->params = params.vec();
  return CheckpointFunction::apply(input, params, state);
}

}  // namespace memfit
