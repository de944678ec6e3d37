#include "memfit/step.h"

#include <torch/torch.h>

#include "memfit/evaluation.h"
#include "memfit/grads.h"
#include "memfit/memory_tracker.h"

namespace memfit {

double forward_backward(Workload& w, const Batch& part, double weight, const StepOptions& o) {
  const auto device = part.input.device().type();
  at::Tensor loss;
  {
    PhaseGuard phase(Phase::kForward);
    Autocast autocast(device, o.precision);  // exits (and frees its cast cache) before backward
    autocast.warm_cast_cache(autocast_cast_parameters(*w.chain));  // so its bytes are reported
    at::Tensor out = w.chain->forward(part.input, o.checkpoint);
    loss = w.loss(out, part.target) * weight;
  }
  const double value = loss.item<double>();  // logged by value: no graph outlives the step
  {
    PhaseGuard phase(Phase::kBackward);
    (o.scaler != nullptr ? o.scaler->scale(loss) : loss).backward();
  }
  return value;
}

bool optimizer_step(torch::optim::Optimizer& optimizer, const StepOptions& o) {
  PhaseGuard phase(Phase::kOptimizer);
  bool skipped = false;
  if (o.scaler != nullptr) {
    skipped = o.scaler->step(optimizer).skipped;
    o.scaler->update();
  } else {
    optimizer.step();
  }
  if (o.after_optimizer) o.after_optimizer();
  zero_grad(optimizer, o.set_to_none);
  return skipped;
}

StepResult train_step(Workload& w, torch::optim::Optimizer& optimizer, const Batch& batch,
                      const StepOptions& o) {
  StepResult r;
  const int64_t b = batch.size();
  for (const MicroBatch& mb : split_batch(b, o.micro_batch > 0 ? o.micro_batch : b)) {
    r.loss += forward_backward(w, batch.slice(mb.start, mb.length), mb.weight, o);
    ++r.micro_batches;
  }
  r.skipped = optimizer_step(optimizer, o);
  return r;
}

double eval_loss(Workload& w, const Batch& batch, Precision precision) {
  // Dropout off for evaluation, and back to the previous mode afterwards.
  struct EvalMode {
    torch::nn::Module& m;
    bool was_training;
    explicit EvalMode(torch::nn::Module& module) : m(module), was_training(module.is_training()) { m.eval(); }
    ~EvalMode() { m.train(was_training); }
  } mode(*w.chain);
  return evaluate([&] {
    Autocast autocast(batch.input.device().type(), precision);
    return w.loss(w.chain->forward(batch.input), batch.target).item<double>();
  });
}

}  // namespace memfit
