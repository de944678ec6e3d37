#include "memfit/runtime/step.h"

#include <torch/torch.h>

#include <algorithm>
#include <deque>
#include <limits>

#include "memfit/measure/memory_tracker.h"
#include "memfit/techniques/evaluation.h"
#include "memfit/techniques/grads.h"
#include "memfit/techniques/rng.h"

namespace memfit {
namespace {

// The version counter of each parameter's gradient (-1: none): whether an attempt touched them.
std::vector<int64_t> grad_versions(const std::vector<at::Tensor>& params) {
  std::vector<int64_t> v;
  v.reserve(params.size());
  for (const auto& p : params) v.push_back(p.grad().defined() ? static_cast<int64_t>(p.grad()._version()) : -1);
  return v;
}

}  // namespace

at::Tensor forward_loss(Workload& w, const Batch& part, const StepConfig& config, bool recompute_all) {
  const CheckpointPlan checkpoint = recompute_all ? CheckpointPlan::all(w.chain->size()) : config.checkpoint;
  PhaseGuard phase(Phase::kForward);
  Autocast autocast(part.input.device().type(), config.precision);  // exits (and frees its cast cache) before backward
  autocast.warm_cast_cache(autocast_cast_parameters(*w.chain));  // so its bytes are reported
  at::Tensor out = w.chain->forward(part.input, checkpoint, recompute_all ? std::vector<int>{} : config.offload.activation_blocks);
  return w.loss(out, part.target);
}

double forward_backward(Workload& w, const Batch& part, double weight, const StepOptions& o, bool recompute_all) {
  at::Tensor loss = forward_loss(w, part, o.config, recompute_all) * weight;
  const double value = loss.item<double>();  // logged by value: no graph outlives the step
  {
    PhaseGuard phase(Phase::kBackward);
    (o.scaler != nullptr ? o.scaler->scale(loss) : loss).backward();
  }
  if (o.after_backward) o.after_backward();
  return value;
}

StepResult accumulate_micro_batches(const std::vector<MicroBatch>& parts, const MicroBatchFn& run,
                                    const MicroBatchLoop& loop) {
  StepResult r;
  std::deque<PendingMicroBatch> pending;
  for (const auto& part : parts) pending.push_back({part, false});
  r.smallest_micro_batch = std::numeric_limits<int64_t>::max();
  while (!pending.empty()) {
    const PendingMicroBatch current = pending.front();
    const auto versions = grad_versions(loop.gradient_holders);
    const RngState rng = capture_rng(loop.device);
    try {
      r.loss += run(current);
      ++r.micro_batches;
      r.smallest_micro_batch = std::min(r.smallest_micro_batch, current.part.length);
      pending.pop_front();
    } catch (const c10::OutOfMemoryError& e) {
      if (loop.recovery == nullptr) throw;
      restore_rng(rng);  // the failed attempt's random draws are taken back
      bool partial_sums = false;
      if (grad_versions(loop.gradient_holders) != versions) {
        // The failure came after gradients were accumulated: release them. Those of the
        // failed micro-batch alone are simply redone; sums over earlier ones are lost.
        partial_sums = std::any_of(versions.begin(), versions.end(), [](int64_t v) { return v >= 0; });
        zero_grad(loop.gradient_holders, true);
      }
      zero_grad(loop.also_released, true);
      OomDecision d = loop.recovery->on_out_of_memory(current, partial_sums, e);
      pending.pop_front();
      if (d.restart_step) {
        pending.clear();
        r.loss = 0;
      }
      pending.insert(pending.begin(), d.next.begin(), d.next.end());
    }
  }
  if (r.micro_batches == 0) r.smallest_micro_batch = 0;
  return r;
}

StepResult accumulate_gradients(Workload& w, const Batch& batch, const std::vector<MicroBatch>& parts,
                                const StepOptions& o) {
  MicroBatchLoop loop;
  loop.device = batch.input.device();
  const auto params = w.chain->parameters();
  loop.gradient_holders = o.gradient_holders.empty() ? params : o.gradient_holders;
  if (!o.gradient_holders.empty()) loop.also_released = params;  // what offloading had not yet released
  loop.recovery = o.recovery;
  StepResult r = accumulate_micro_batches(
      parts,
      [&](const PendingMicroBatch& p) {
        return forward_backward(w, batch.slice(p.part.start, p.part.length), p.part.weight, o, p.recompute_all);
      },
      loop);
  r.smallest_micro_batch = std::min(r.smallest_micro_batch, batch.size());
  return r;
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
  zero_grad(optimizer, o.config.set_to_none);
  return skipped;
}

StepResult train_step(Workload& w, torch::optim::Optimizer& optimizer, const Batch& batch, const StepOptions& o) {
  const int64_t b = batch.size();
  const int64_t m = o.config.micro_batch > 0 ? std::min(o.config.micro_batch, b) : b;
  StepResult r = accumulate_gradients(w, batch, split_batch(b, m), o);
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
