// step.h — one training step with the techniques composed: micro-batches with gradient
// accumulation, autocast, checkpointing, loss scaling, and releasing gradients after the step.
//
//   memfit::StepOptions o;
//   o.micro_batch = 4;                                    // 16 samples as 4 x 4
//   o.precision = memfit::Precision::kBF16;
//   o.checkpoint = memfit::CheckpointPlan::parse("every:2", chain->size());
//   auto r = memfit::train_step(workload, optimizer, batch, o);   // r.loss: the batch's mean
//
// Each part runs in its tracker phase (forward, backward, recompute inside backward, optimizer).
#pragma once

#include <torch/optim/optimizer.h>

#include <functional>

#include "memfit/accumulation.h"
#include "memfit/autocast.h"
#include "memfit/chain.h"
#include "memfit/grad_scaler.h"
#include "memfit/workload.h"

namespace memfit {

struct StepOptions {
  int64_t micro_batch = 0;  // samples per micro-batch; 0 = the whole batch at once
  Precision precision = Precision::kFP32;
  CheckpointPlan checkpoint;
  bool set_to_none = true;           // release gradients after the step (else zero them)
  GradScaler* scaler = nullptr;      // loss scaling (fp16); nullptr = none
  // Called after the optimizer step, before gradients are released (for measurements).
  std::function<void()> after_optimizer;
};

struct StepResult {
  double loss = 0;           // mean loss over the whole batch
  bool skipped = false;      // the scaler skipped the optimizer step (inf/NaN gradient)
  int64_t micro_batches = 0;
};

// Forward + backward of one micro-batch: accumulates weight * loss gradients into .grad and
// returns weight * loss as a number. Throws c10::OutOfMemoryError if memory runs out.
double forward_backward(Workload& workload, const Batch& part, double weight, const StepOptions& options);

// The whole step: all micro-batches, then the optimizer, then zero_grad(set_to_none).
StepResult train_step(Workload& workload, torch::optim::Optimizer& optimizer, const Batch& batch,
                      const StepOptions& options);

// The optimizer part alone (scaler-aware), then after_optimizer, then zero_grad.
bool optimizer_step(torch::optim::Optimizer& optimizer, const StepOptions& options);

// Mean loss of the model on `batch` under inference mode (no graph kept).
double eval_loss(Workload& workload, const Batch& batch, Precision precision = Precision::kFP32);

}  // namespace memfit
