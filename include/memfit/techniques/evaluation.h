// evaluation.h — evaluation without autograd: no graph, no saved activations.
//
//   double loss = memfit::evaluate([&] { return loss_fn(model(x), y).item<double>(); });
//
// Runs under c10::InferenceMode (stronger than NoGradGuard: no version counters or views
// tracking either) and tags the tracker's phase as eval. Tensors created inside are inference
// tensors: don't feed them to training afterwards.
#pragma once

#include <c10/core/InferenceMode.h>

#include <utility>

#include "memfit/measure/memory_tracker.h"

namespace memfit {

template <class Fn>
auto evaluate(Fn&& fn) {
  c10::InferenceMode inference;
  PhaseGuard phase(Phase::kEval);
  return std::forward<Fn>(fn)();
}

}  // namespace memfit
