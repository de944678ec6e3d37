#include "memfit/runtime/oom_recovery.h"

#include <stdexcept>

#include "memfit/measure/budget_allocator.h"

namespace memfit {

SplitRecovery::SplitRecovery(int64_t local_batch, int64_t global_batch, int blocks, Note note)
    : local_batch_(local_batch), global_batch_(global_batch), blocks_(blocks), note_(std::move(note)) {}

void SplitRecovery::say(const std::string& text) const {
  if (note_) note_(text);
}

void SplitRecovery::begin_step(int64_t step, const CheckpointPlan& planned, const std::string& budget_text) {
  where_ = "step " + std::to_string(step);
  evaluating_ = false;
  plan_recomputes_all_ = planned.recomputed_blocks().size() >= static_cast<size_t>(blocks_);
  budget_text_ = budget_text;
  real_oom_ = false;
}

void SplitRecovery::begin_evaluation(const std::string& budget_text) {
  where_ = "evaluation";
  evaluating_ = true;
  plan_recomputes_all_ = true;  // inference keeps no activations: recomputing would save nothing
  budget_text_ = budget_text;
  real_oom_ = false;
}

std::vector<MicroBatch> SplitRecovery::split(int64_t m) const {
  auto parts = split_batch(local_batch_, m);
  for (auto& part : parts) part.weight = static_cast<double>(part.length) / static_cast<double>(global_batch_);
  return parts;
}

OomDecision SplitRecovery::restart(int64_t m, bool recompute_all) const {
  OomDecision d;
  d.restart_step = true;
  for (const auto& part : split(m)) d.next.push_back({part, recompute_all});
  return d;
}

void SplitRecovery::give_up(const c10::OutOfMemoryError& error) const {
  throw std::runtime_error("out of memory in " + where_ + " even with micro-batch 1" +
                           (evaluating_ ? "" : " and every block recomputed") + ": budget " + budget_text_ +
                           " is too small for this model (" + error.what_without_backtrace() + ")");
}

OomDecision SplitRecovery::on_out_of_memory(const PendingMicroBatch& failed, bool partial_sums,
                                            const c10::OutOfMemoryError& error) {
  if (auto* alloc = BudgetAllocator::installed()) alloc->fail_allocation_after(0);  // an injected failure fires once
  ++recoveries_;
  const bool injected = std::string(error.what()).find("(injected)") != std::string::npos;
  real_oom_ = real_oom_ || !injected;
  const std::string what = std::string(injected ? "out of memory (injected)" : "out of memory") + " in " + where_;
  const int64_t length = failed.part.length;
  if (partial_sums) {
    // Partial sums over earlier micro-batches cannot be taken back exactly: redo the step.
    if (!failed.recompute_all) {
      say(what + " after gradients were accumulated: redoing the step, recomputing every block");
      return restart(length, true);
    }
    if (length < 2) give_up(error);
    say(what + " after gradients were accumulated: redoing the step with micro-batch " + std::to_string(length / 2));
    return restart(length / 2, false);
  }
  OomDecision d;
  if (!failed.recompute_all && !plan_recomputes_all_) {
    say(what + ": redoing the micro-batch of " + std::to_string(length) + " samples with every block recomputed");
    d.next.push_back({failed.part, true});
    return d;
  }
  if (length < 2) give_up(error);
  const auto halves = split_in_two(failed.part, global_batch_);
  say(what + ": micro-batch of " + std::to_string(length) + " samples split into " + std::to_string(halves[0].length) +
      " + " + std::to_string(halves[1].length));
  d.next = {{halves[0], false}, {halves[1], false}};
  return d;
}

SplitRecovery::NextSteps SplitRecovery::next_steps(int64_t micro_batch, int64_t smallest_completed,
                                                  bool recomputes_all) const {
  if (smallest_completed < micro_batch) {
    say("re-plan: micro-batch " + std::to_string(micro_batch) + " -> " + std::to_string(smallest_completed) +
        " after a real out-of-memory error");
    return {smallest_completed, recomputes_all};
  }
  if (!recomputes_all) say("re-plan: recompute every block after a real out-of-memory error");
  return {micro_batch, true};
}

}  // namespace memfit
