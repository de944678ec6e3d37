// step.h — one training step with the techniques composed: micro-batches with gradient
// accumulation, autocast, checkpointing, loss scaling, and releasing gradients after the step.
// This is the one micro-batch loop in memfit: `memfit report`, the planner's verification and
// the trainer (with out-of-memory recovery plugged in) all run it.
//
//   memfit::StepConfig c;                                 // step_config.h
//   c.batch = 16; c.micro_batch = 4;                      // 16 samples as 4 x 4
//   c.precision = memfit::Precision::kBF16;
//   auto r = memfit::train_step(workload, *optimizer, batch, memfit::StepOptions{c});
//
// Each part runs in its tracker phase (forward, backward, recompute inside backward, optimizer).
#pragma once

#include <c10/util/Exception.h>
#include <torch/optim/optimizer.h>

#include <functional>
#include <vector>

#include "memfit/runtime/step_config.h"
#include "memfit/runtime/workload.h"
#include "memfit/techniques/accumulation.h"
#include "memfit/techniques/grad_scaler.h"

namespace memfit {

// A micro-batch waiting to run, and whether it runs with every block recomputed.
struct PendingMicroBatch {
  MicroBatch part;
  bool recompute_all = false;
};

// What runs instead of a micro-batch that ran out of memory.
struct OomDecision {
  bool restart_step = false;            // drop this step's gradients and loss; `next` is the whole step
  std::vector<PendingMicroBatch> next;  // run before the rest of the step (or as the step, on restart)
};

// Decides how a step goes on after an out-of-memory error (runtime/oom_recovery.h has memfit's
// policy). The loop has already taken back the failed attempt's random draws and released the
// gradients it touched.
class OomRecovery {
 public:
  virtual ~OomRecovery() = default;
  // partial_sums: gradients of earlier micro-batches of this step were mixed into those
  // released, so only a restart is exact. Throws to give up.
  virtual OomDecision on_out_of_memory(const PendingMicroBatch& failed, bool partial_sums,
                                       const c10::OutOfMemoryError& error) = 0;
};

struct StepOptions {
  StepOptions() = default;
  explicit StepOptions(StepConfig step_config) : config(std::move(step_config)) {}

  StepConfig config;
  GradScaler* scaler = nullptr;          // loss scaling (fp16); nullptr = none
  OomRecovery* recovery = nullptr;       // nullptr: an out-of-memory error propagates
  std::function<void()> after_optimizer; // after the optimizer step, before gradients go (measuring)
  // Where the step's gradient sums are held: the chain's parameters' .grad unless they are
  // offloaded (train/optimizer_offload.h: the host masters'). An out-of-memory error releases them.
  std::vector<at::Tensor> gradient_holders;
  std::function<void()> after_backward;  // after each micro-batch's backward (offload's release)
};

struct StepResult {
  double loss = 0;                  // mean loss over the whole batch
  bool skipped = false;             // the scaler skipped the optimizer step (inf/NaN gradient)
  int64_t micro_batches = 0;        // forward + backward passes that completed
  int64_t smallest_micro_batch = 0; // the smallest that completed
};

// The loss of one micro-batch's forward as a step runs it (autocast at the config's precision,
// its weight casts made first, its segments recomputed and blocks offloaded; every block
// recomputed instead where recompute_all), in the forward phase.
at::Tensor forward_loss(Workload& workload, const Batch& part, const StepConfig& config, bool recompute_all = false);

// Forward + backward of one micro-batch: accumulates weight * loss gradients into .grad and
// returns weight * loss as a number. Throws c10::OutOfMemoryError if memory runs out.
double forward_backward(Workload& workload, const Batch& part, double weight, const StepOptions& options,
                        bool recompute_all = false);

// One micro-batch's forward + backward, its weight * loss gradients accumulated; returns weight *
// loss. Throws c10::OutOfMemoryError if memory runs out.
using MicroBatchFn = std::function<double(const PendingMicroBatch& part)>;

// What the micro-batch loop needs besides the parts and how to run one.
struct MicroBatchLoop {
  c10::Device device = c10::kCPU;             // whose random state a failed attempt takes back
  std::vector<at::Tensor> gradient_holders;   // where the step's gradient sums are held
  // Gradients released after an out-of-memory error besides the holders' (the model's own where
  // the holders are the offloaded optimizer's masters).
  std::vector<at::Tensor> also_released;
  OomRecovery* recovery = nullptr;            // nullptr: an out-of-memory error propagates
};

// The one micro-batch loop (the C++ Trainer's and the Python package's step run it): each part
// by `run`, gradients accumulated. After an out-of-memory error the failed attempt's random
// draws are taken back, the gradients it touched released, and `loop.recovery` says what runs
// next. StepResult::loss: the sum of weight * loss.
StepResult accumulate_micro_batches(const std::vector<MicroBatch>& parts, const MicroBatchFn& run,
                                    const MicroBatchLoop& loop);

// That loop over every part of `batch` of the workload (weights as given).
StepResult accumulate_gradients(Workload& workload, const Batch& batch, const std::vector<MicroBatch>& parts,
                                const StepOptions& options);

// The optimizer part alone (scaler-aware), then after_optimizer, then zero_grad. Returns
// whether the scaler skipped the step.
bool optimizer_step(torch::optim::Optimizer& optimizer, const StepOptions& options);

// The whole step: the batch as config.micro_batch-sized parts, then the optimizer step.
StepResult train_step(Workload& workload, torch::optim::Optimizer& optimizer, const Batch& batch,
                      const StepOptions& options);

// Mean loss of the model on `batch` under inference mode (no graph kept).
double eval_loss(Workload& workload, const Batch& batch, Precision precision = Precision::kFP32);

}  // namespace memfit
