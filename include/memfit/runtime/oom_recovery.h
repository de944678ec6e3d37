// oom_recovery.h — memfit's answer to an out-of-memory error in the middle of a step, plugged
// into the step runner's micro-batch loop (runtime/step.h's OomRecovery). No sample is lost or
// counted twice:
//   1. the failed micro-batch is redone with every block recomputed (gradients with
//      recomputation are bit-equal to plain ones: the exact answer);
//   2. then it is split in two halves (exact up to float summation order);
//   3. if gradients of earlier micro-batches were mixed into those released, the whole step
//      is redone (first recomputing every block, then with half the micro-batch);
//   4. a 1-sample micro-batch with every block recomputed gives up (std::runtime_error).
// Evaluation follows the same rule: it keeps no graph, so there is nothing to recompute and
// nothing accumulated; a micro-batch that runs out of memory is split in two (begin_evaluation).
// And after a step that met a real out-of-memory error (one not injected: likely to repeat), the
// following steps run what worked (next_steps). The one policy: the C++ Trainer and the Python
// package's step (memfit.apply) both follow it.
#pragma once

#include <cstdint>
#include <functional>
#include <string>

#include "memfit/runtime/step.h"

namespace memfit {

class SplitRecovery : public OomRecovery {
 public:
  // local_batch: this rank's samples; global_batch: all ranks' (micro-batch weights are
  // shares of it). `note` hears what each recovery does, in a sentence.
  using Note = std::function<void(const std::string&)>;
  SplitRecovery(int64_t local_batch, int64_t global_batch, int blocks, Note note = {});

  void begin_step(int64_t step, const CheckpointPlan& planned, const std::string& budget_text);
  // Held-out batches under inference (no graph): only the split applies.
  void begin_evaluation(const std::string& budget_text);
  OomDecision on_out_of_memory(const PendingMicroBatch& failed, bool partial_sums,
                               const c10::OutOfMemoryError& error) override;

  // What the steps after this one run, where it met a real out-of-memory error: the smallest
  // micro-batch that completed, or, where that is the micro-batch already, every block
  // recomputed (`recomputes_all`: whether they are already). Says which.
  struct NextSteps {
    int64_t micro_batch;
    bool recompute_all;
  };
  NextSteps next_steps(int64_t micro_batch, int64_t smallest_completed, bool recomputes_all) const;

  int64_t recoveries() const { return recoveries_; }
  bool real_oom_in_step() const { return real_oom_; }  // one not injected (likely to repeat)
  // This rank's micro-batches of size m, weighted by their share of the global batch.
  std::vector<MicroBatch> split(int64_t m) const;

 private:
  OomDecision restart(int64_t m, bool recompute_all) const;
  [[noreturn]] void give_up(const c10::OutOfMemoryError& error) const;
  void say(const std::string& text) const;

  int64_t local_batch_, global_batch_;
  int blocks_;
  Note note_;
  std::string where_ = "step";  // "step N" or "evaluation", in messages
  bool evaluating_ = false;
  bool plan_recomputes_all_ = false;
  std::string budget_text_;
  int64_t recoveries_ = 0;
  bool real_oom_ = false;
};

}  // namespace memfit
