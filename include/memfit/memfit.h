// memfit.h — the library in one include, layer by layer (ARCHITECTURE.md). The built-in
// models and data are apart: include "memfit/zoo/workloads.h" for them.
#pragma once

#include "memfit/compat.h"
#include "memfit/digest.h"
#include "memfit/errors.h"

// measure/: exact bytes from the allocator, the hard budget, where the bytes go, and what a
// CUDA device would reserve (its caching allocator modelled; its budget enforced).
#include "memfit/measure/breakdown.h"
#include "memfit/measure/budget_allocator.h"
#include "memfit/measure/cuda_allocator_conf.h"
#include "memfit/measure/cuda_allocator_model.h"
#include "memfit/measure/cuda_budget.h"
#include "memfit/measure/cuda_reserved.h"
#include "memfit/measure/memory_space.h"
#include "memfit/measure/memory_tracker.h"
#include "memfit/measure/size.h"

// techniques/: each a small API, usable on its own.
#include "memfit/techniques/accumulation.h"
#include "memfit/techniques/activation_offload.h"
#include "memfit/techniques/autocast.h"
#include "memfit/techniques/cache.h"
#include "memfit/techniques/checkpoint.h"
#include "memfit/techniques/evaluation.h"
#include "memfit/techniques/grad_scaler.h"
#include "memfit/techniques/grads.h"
#include "memfit/techniques/metrics.h"
#include "memfit/techniques/optimizer_8bit.h"
#include "memfit/techniques/rng.h"

// runtime/: a workload (chain, data, loss), the optimizer and the step configuration as
// values, and the step runner composing the techniques.
#include "memfit/runtime/chain.h"
#include "memfit/runtime/dataset.h"
#include "memfit/runtime/oom_recovery.h"
#include "memfit/runtime/optimizer.h"
#include "memfit/runtime/optimizer_offload.h"
#include "memfit/runtime/step.h"
#include "memfit/runtime/step_config.h"
#include "memfit/runtime/torchscript.h"
#include "memfit/runtime/workload.h"

// plan/: profiles, the checkpoint-schedule DP, the planner (pure search), the plan job
// (measure, then search), verification, per-rank state.
#include "memfit/plan/batch_shape.h"
#include "memfit/plan/cost_fit.h"
#include "memfit/plan/job.h"
#include "memfit/plan/optimizer_costs.h"
#include "memfit/plan/partwise.h"
#include "memfit/plan/plan.h"
#include "memfit/plan/plan_ask.h"
#include "memfit/plan/plan_request.h"
#include "memfit/plan/plan_steps.h"
#include "memfit/plan/planner.h"
#include "memfit/plan/profile.h"
#include "memfit/plan/profile_cache.h"
#include "memfit/plan/rank_states.h"
#include "memfit/plan/reserved_check.h"
#include "memfit/plan/reserved_fit.h"
#include "memfit/plan/schedule.h"
#include "memfit/plan/timing_rounds.h"
#include "memfit/plan/verify.h"

// report/: `memfit report`, the HTML report's document and the page.
#include "memfit/report/document.h"
#include "memfit/report/html_report.h"
#include "memfit/report/report.h"

// train/: the Trainer and its events, the strategies over a process group (one process, ZeRO
// 0-2, ZeRO 3), saved state.
#include "memfit/train/events.h"
#include "memfit/train/process_group.h"
#include "memfit/train/saved_state.h"
#include "memfit/train/single_process.h"
#include "memfit/train/stop_signal.h"
#include "memfit/train/strategy.h"
#include "memfit/train/strategy_registry.h"
#include "memfit/train/trainer.h"
#include "memfit/train/zero_replicated.h"
#include "memfit/train/zero_sharded.h"
