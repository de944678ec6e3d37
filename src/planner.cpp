#include "memfit/planner.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>

#include "memfit/budget_allocator.h"
#include "memfit/grads.h"
#include "memfit/size.h"
#include "memfit/step.h"

namespace memfit {
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// The value at m of the line through (m1, v1) and (m2, v2), never below zero.
double fit(int64_t m1, double v1, int64_t m2, double v2, int64_t m) {
  if (m2 == m1) return v1;
  const double slope = (v2 - v1) / static_cast<double>(m2 - m1);
  return std::max(0.0, v1 + slope * static_cast<double>(m - m1));
}

int64_t fit_bytes(int64_t m1, int64_t v1, int64_t m2, int64_t v2, int64_t m) {
  return static_cast<int64_t>(std::llround(fit(m1, static_cast<double>(v1), m2, static_cast<double>(v2), m)));
}

int64_t rng_state_bytes() {
  auto gen = at::detail::getDefaultCPUGenerator();
  std::lock_guard<std::mutex> lock(gen.mutex());
  return static_cast<int64_t>(gen.get_state().storage().nbytes());
}

}  // namespace

ChainProfile profile_chain(Workload& w, const Batch& batch, int64_t m, Precision precision, MemoryTracker& tracker) {
  ChainProfile prof;
  prof.micro_batch = m;
  const Batch part = batch.slice(0, m);
  Chain& chain = *w.chain;
  const int n = chain.size();
  const auto device = part.input.device().type();
  at::Tensor x = part.input;
  // Dropout draws must not disturb the caller's random stream.
  at::Tensor rng;
  {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    rng = gen.get_state();
  }
  for (int i = 0; i < n; ++i) {
    BlockCost c;
    const auto block_params = chain.block(i).module->parameters();
    for (const auto& p : block_params) c.param_bytes += static_cast<int64_t>(p.storage().nbytes());
    const bool last = i == n - 1;
    at::Tensor xi = x.is_floating_point() ? x.detach().requires_grad_(true) : x;

    {  // inside a checkpointed segment: no grad
      at::NoGradGuard no_grad;
      Autocast autocast(device, precision);
      const int64_t live0 = tracker.current();
      tracker.reset_peak();
      at::Tensor y = chain.block(i).forward(xi);
      c.forward_nograd_peak = tracker.peak() - live0;
    }
    at::Tensor next_input;
    c.forward_seconds = c.backward_seconds = 1e30;
    for (int run = 0; run < 2; ++run) {  // bytes are the same each run; the faster time counts
      const auto uses = xi.use_count();
      const auto storage_uses = xi.storage().use_count();
      const int64_t live0 = tracker.current();
      tracker.reset_peak();
      auto t0 = Clock::now();
      at::Tensor y, out;
      {
        Autocast autocast(device, precision);
        y = chain.block(i).forward(xi);
        out = last ? w.loss(y, part.target) : y;  // the last block carries the loss
      }
      c.forward_seconds = std::min(c.forward_seconds, seconds_since(t0));
      c.forward_peak = tracker.peak() - live0;
      if (i > 0 && run == 0) {
        // Did this block keep its input for backward? Then the previous output stays alive.
        prof.blocks.back().output_kept = xi.use_count() > uses || xi.storage().use_count() > storage_uses;
      }
      if (!last) next_input = y.detach();
      y = at::Tensor();
      c.output_bytes = static_cast<int64_t>(out.storage().nbytes());
      c.kept_bytes = tracker.current() - live0 - c.output_bytes;  // internal: without the output
      at::Tensor g = at::ones_like(out);
      const int64_t live1 = tracker.current();
      tracker.reset_peak();
      t0 = Clock::now();
      out.backward(g);
      c.backward_seconds = std::min(c.backward_seconds, seconds_since(t0));
      c.backward_peak = tracker.peak() - live1;
      out = at::Tensor();
      g = at::Tensor();
      zero_grad(block_params, true);
      if (xi.requires_grad()) xi.mutable_grad().reset();
    }
    if (last) {
      c.output_kept = true;  // the loss lives until backward
    }
    prof.blocks.push_back(c);
    x = next_input;
  }
  for (auto& c : prof.blocks) {
    if (c.output_kept) c.kept_bytes += c.output_bytes;
  }
  {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(rng);
  }
  return prof;
}

Planner::Planner(Workload& workload, const Batch& batch, const PlanRequest& request, MemoryTracker& tracker)
    : workload_(workload), request_(request) {
  TORCH_CHECK(request.batch >= 1, "memfit::Planner: batch must be >= 1, got ", request.batch);
  for (const auto& p : workload.chain->parameters()) {
    weight_bytes_ += static_cast<int64_t>(p.storage().nbytes());
    largest_param_ = std::max<int64_t>(largest_param_, static_cast<int64_t>(p.storage().nbytes()));
  }
  batch_bytes_ = static_cast<int64_t>(batch.input.storage().nbytes() + batch.target.storage().nbytes());
  // Two sizes, a quarter and a half of the batch (at least 1 and 2): small enough to be
  // quick, large enough that timings are not noise and per-sample parts dominate.
  const int64_t a = std::max<int64_t>(1, request.batch / 4);
  const int64_t b = std::min<int64_t>(request.batch, std::max<int64_t>(a + 1, request.batch / 2));
  profile_chain(workload, batch, a, request.precision, tracker);  // first-touch costs out of the way
  small_ = profile_chain(workload, batch, a, request.precision, tracker);
  large_ = b > a ? profile_chain(workload, batch, b, request.precision, tracker) : small_;

  // Calibrate: one real forward + backward of the plain chain at the larger size. What the
  // per-block model misses (the loss's buffers, engine bookkeeping) is mostly proportional
  // to activations, so the ratio measured / modelled scales every block's bytes.
  auto params = workload.chain->parameters();
  zero_grad(params, true);
  StepOptions plain;
  plain.precision = request.precision;
  const int64_t live0 = tracker.current();
  tracker.reset_peak();
  forward_backward(workload, batch.slice(0, b), 1.0, plain);
  const int64_t measured = tracker.peak() - live0;
  zero_grad(params, true);
  ChainCosts modelled = costs_at(b);
  modelled.fixed_bytes = 0;
  modelled.gradients_present = false;
  const int64_t predicted = evaluate_schedule(modelled, {}).peak_bytes;
  if (predicted > 0) calibration_ = std::clamp(static_cast<double>(measured) / static_cast<double>(predicted), 0.8, 1.5);
}

ChainCosts Planner::costs_at(int64_t m) const {
  ChainCosts c;
  const int64_t m1 = small_.micro_batch, m2 = large_.micro_batch;
  for (size_t i = 0; i < small_.blocks.size(); ++i) {
    const BlockCost& s = small_.blocks[i];
    const BlockCost& l = large_.blocks[i];
    BlockCost f;
    // Below the smallest measured size a micro-batch is not assumed any faster: fixed
    // per-call costs dominate there, and extrapolating a noisy line down to zero would make
    // tiny micro-batches look free.
    const int64_t mt = std::max(m, m1);
    f.forward_seconds = fit(m1, s.forward_seconds, m2, l.forward_seconds, mt);
    f.backward_seconds = fit(m1, s.backward_seconds, m2, l.backward_seconds, mt);
    f.output_bytes = fit_bytes(m1, s.output_bytes, m2, l.output_bytes, m);
    f.output_kept = l.output_kept;
    f.kept_bytes = fit_bytes(m1, s.kept_bytes, m2, l.kept_bytes, m);
    f.forward_peak = fit_bytes(m1, s.forward_peak, m2, l.forward_peak, m);
    f.forward_nograd_peak = fit_bytes(m1, s.forward_nograd_peak, m2, l.forward_nograd_peak, m);
    f.backward_peak = fit_bytes(m1, s.backward_peak, m2, l.backward_peak, m);
    f.param_bytes = s.param_bytes;
    for (int64_t* v : {&f.kept_bytes, &f.forward_peak, &f.forward_nograd_peak, &f.backward_peak}) {
      *v = static_cast<int64_t>(std::llround(static_cast<double>(*v) * calibration_));
    }
    c.blocks.push_back(f);
  }
  const int64_t optimizer = request_.optimizer_state_bytes >= 0 ? request_.optimizer_state_bytes : 2 * weight_bytes_;
  c.fixed_bytes = weight_bytes_ + optimizer + batch_bytes_;
  c.gradients_present = m < request_.batch || request_.keep_grads;
  c.segment_overhead_bytes = rng_state_bytes();
  return c;
}

Schedule Planner::uniform(int64_t m, int segments) const {
  // checkpoint_sequential: `segments` runs of equal length, all but the last checkpointed.
  const ChainCosts c = costs_at(m);
  const int n = static_cast<int>(c.blocks.size());
  const int length = (n + segments - 1) / segments;
  std::vector<std::pair<int, int>> s;
  for (int start = 0; start + length < n; start += length) s.emplace_back(start, std::min(n, start + length) - 1);
  return evaluate_schedule(c, s);
}

Plan Planner::plan(int64_t budget) const {
  if (budget <= 0) budget = request_.budget_bytes;
  Plan p;
  p.budget_bytes = budget;
  p.precision = request_.precision;
  const int64_t B = request_.batch;
  const auto usable = static_cast<int64_t>(static_cast<double>(budget) * (1.0 - request_.margin));
  const int64_t optimizer = request_.optimizer_state_bytes >= 0 ? request_.optimizer_state_bytes : 2 * weight_bytes_;
  // The optimizer step: weights, gradients, AdamW state, the batch and two temporaries.
  const int64_t optimizer_peak = 2 * weight_bytes_ + optimizer + batch_bytes_ + 2 * largest_param_;

  const Schedule plain = evaluate_schedule(costs_at(B), {});
  p.plain_predicted_peak = std::max(plain.peak_bytes, optimizer_peak);
  p.plain_predicted_seconds = plain.seconds;

  std::vector<int64_t> sizes;
  if (request_.micro_batch > 0) {
    sizes.push_back(request_.micro_batch);
  } else {
    for (int64_t m = B; m >= 1; m = m == 1 ? 0 : (m + 1) / 2) sizes.push_back(m);
  }
  const int64_t smallest_m = sizes.back();
  const ChainCosts smallest_costs = costs_at(smallest_m);
  p.floor_bytes = static_cast<int64_t>(std::ceil(
      static_cast<double>(std::max(smallest_peak(smallest_costs), optimizer_peak)) / (1.0 - request_.margin)));

  double best_seconds = 0;
  for (int64_t m : sizes) {
    if (optimizer_peak > usable) break;
    const ChainCosts costs = costs_at(m);
    const Schedule s = solve_schedule(costs, usable);
    if (!s.feasible) continue;
    const int64_t full = B / m, rest = B % m;
    double seconds = static_cast<double>(full) * s.seconds;
    if (rest > 0) seconds += evaluate_schedule(costs_at(rest), s.segments).seconds;
    if (!p.feasible || seconds < 0.99 * best_seconds) {  // ties go to the larger micro-batch
      p.feasible = true;
      best_seconds = seconds;
      p.micro_batch = m;
      p.accumulation = (B + m - 1) / m;
      p.checkpoint.segments = s.segments;
      p.predicted_peak = std::max(s.peak_bytes, optimizer_peak);
      p.predicted_seconds = seconds;
    }
  }
  if (!p.feasible) {
    p.notes.push_back("no plan fits " + format_bytes(budget) + ": the smallest budget that works is " +
                      format_bytes(p.floor_bytes) + " (" + std::to_string(p.floor_bytes) + " bytes)");
  }
  return p;
}

Verification verify_plan(Workload& w, Planner& planner, Plan& plan, MemoryTracker& tracker, int64_t batch,
                         bool measure_plain) {
  Verification v;
  auto params = w.chain->parameters();
  auto& alloc = BudgetAllocator::install();
  const Batch data = w.data->train_batch(0, batch, 0);
  // Three steps; the second and third are in steady state (optimizer state exists).
  auto run_steps = [&](const StepOptions& so, int64_t* peak) {
    torch::optim::AdamW optimizer(params, torch::optim::AdamWOptions(1e-3));
    double best = 1e30;
    for (int step = 1; step <= 3; ++step) {
      tracker.reset_peak();
      const auto t0 = Clock::now();
      train_step(w, optimizer, data, so);
      const double s = seconds_since(t0);
      if (step >= 2) {
        best = std::min(best, s);
        if (peak) *peak = std::max(*peak, tracker.peak());
      }
    }
    return best;
  };
  if (measure_plain) {
    StepOptions plain;
    plain.precision = plan.precision;
    v.plain_seconds = run_steps(plain, nullptr);
  }
  for (;; ++v.attempts) {
    StepOptions so;
    so.micro_batch = plan.micro_batch;
    so.precision = plan.precision;
    so.checkpoint = plan.checkpoint;
    int64_t peak = 0;
    bool oom = false;
    {
      BudgetGuard budget(plan.budget_bytes);
      try {
        v.measured_seconds = run_steps(so, &peak);
      } catch (const c10::OutOfMemoryError&) {
        oom = true;
        zero_grad(params, true);
      }
    }
    v.measured_peak = peak;
    if (!oom || v.attempts >= 3) {
      if (oom) v.notes.push_back("the plan still ran out of memory after 3 attempts");
      break;
    }
    // Tighten: plan for a smaller budget (5% less each time) and try again.
    const int64_t tighter = static_cast<int64_t>(static_cast<double>(plan.budget_bytes) * (1.0 - 0.05 * v.attempts));
    Plan again = planner.plan(tighter);
    v.notes.push_back("measured peak exceeded the budget: planned again for " + format_bytes(tighter));
    if (!again.feasible) break;
    const int64_t real_budget = plan.budget_bytes;
    plan = again;
    plan.budget_bytes = real_budget;
  }
  (void)alloc;
  return v;
}

nlohmann::json plan_json(const Plan& p, const Verification* v) {
  nlohmann::json j;
  j["budget_bytes"] = p.budget_bytes;
  j["feasible"] = p.feasible;
  j["floor_bytes"] = p.floor_bytes;
  if (p.feasible) {
    j["plan"] = {{"micro_batch", p.micro_batch},
                 {"accumulation", p.accumulation},
                 {"precision", precision_name(p.precision)},
                 {"checkpoint", p.checkpoint.recomputed_blocks()},
                 {"segments", p.checkpoint.segments}};
    const double plain = p.plain_predicted_seconds > 0 ? p.plain_predicted_seconds : 1;
    j["predicted"] = {{"peak_bytes", p.predicted_peak}, {"step_time_ratio", p.predicted_seconds / plain}};
  } else {
    j["plan"] = nullptr;
  }
  j["plain"] = {{"predicted_peak_bytes", p.plain_predicted_peak}};
  if (v != nullptr && p.feasible) {
    j["measured"] = {{"peak_bytes", v->measured_peak},
                     {"step_time_ratio", v->plain_seconds > 0 ? v->measured_seconds / v->plain_seconds : 0.0}};
    j["verify_attempts"] = v->attempts;
  }
  j["notes"] = p.notes;
  if (v != nullptr) {
    for (const auto& n : v->notes) j["notes"].push_back(n);
  }
  return j;
}

}  // namespace memfit
