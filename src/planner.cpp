#include "memfit/planner.h"

#include <ATen/CPUGeneratorImpl.h>
#include <torch/torch.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>
#include <stdexcept>

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
    if (precision != Precision::kFP32) {
      const int64_t element = static_cast<int64_t>(c10::elementSize(precision_dtype(precision)));
      for (const auto& p : autocast_cast_parameters(*chain.block(i).module)) c.cast_bytes += p.numel() * element;
    }
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

std::vector<Precision> precision_candidates(const std::string& text, c10::DeviceType device) {
  if (text == "auto") {
    std::vector<Precision> out{Precision::kFP32};
    for (Precision p : {Precision::kBF16, Precision::kFP16}) {
      if (precision_supported(p, device)) out.push_back(p);
    }
    return out;
  }
  const Precision p = parse_precision(text);  // throws, naming the value and the choices
  std::string why;
  if (!precision_supported(p, device, &why)) throw std::invalid_argument("invalid --precision " + text + ": " + why);
  return {p};
}

Planner::Planner(Workload& workload, const Batch& batch, const PlanRequest& request, MemoryTracker& tracker)
    : workload_(workload), request_(request) {
  TORCH_CHECK(request.batch >= 1, "memfit::Planner: batch must be >= 1, got ", request.batch);
  TORCH_CHECK(!request.precisions.empty(), "memfit::Planner: precisions must name at least one candidate");
  TORCH_CHECK(request.micro_batch >= 0 && request.micro_batch <= request.batch,
              "memfit::Planner: micro_batch must be 0 (searched) or 1 to batch (", request.batch, "), got ",
              request.micro_batch);
  for (const auto& p : workload.chain->parameters()) {
    weight_bytes_ += static_cast<int64_t>(p.storage().nbytes());
    largest_param_ = std::max<int64_t>(largest_param_, static_cast<int64_t>(p.storage().nbytes()));
  }
  batch_bytes_ = static_cast<int64_t>(batch.input.storage().nbytes() + batch.target.storage().nbytes());
  // Two sizes, a quarter and a half of the batch (at least 1 and 2): small enough to be
  // quick, large enough that timings are not noise and per-sample parts dominate.
  const int64_t a = std::max<int64_t>(1, request.batch / 4);
  const int64_t b = std::min<int64_t>(request.batch, std::max<int64_t>(a + 1, request.batch / 2));
  auto params = workload.chain->parameters();
  for (Precision precision : request.precisions) {
    PrecisionProfile pp;
    pp.precision = precision;
    try {
      profile_chain(workload, batch, a, precision, tracker);  // first-touch costs out of the way
      pp.small = profile_chain(workload, batch, a, precision, tracker);
      pp.large = b > a ? profile_chain(workload, batch, b, precision, tracker) : pp.small;
    } catch (const c10::OutOfMemoryError&) {
      throw;
    } catch (const c10::Error& e) {
      // A mixed precision this model cannot run (e.g. GroupNorm under CPU bf16 autocast in
      // 1.13) is dropped from the search, and the plan says why.
      zero_grad(params, true);
      if (precision == request.precisions.front()) throw;
      const std::string what = e.what_without_backtrace();
      profile_notes_.push_back(std::string(precision_name(precision)) + " not considered: it fails on this model (" +
                               what.substr(0, what.find('\n')) + ")");
      continue;
    }
    // The whole plain chain at both sizes. Its bytes at the larger size calibrate the blocks'
    // bytes: what the per-block model misses (the loss's buffers, engine bookkeeping) is
    // mostly proportional to activations. Its seconds are the time model: blocks timed alone
    // miss how the whole chain runs (caches, threads), and small micro-batches pay per-call
    // costs that only a real run shows.
    StepOptions plain;
    plain.precision = precision;
    auto run = [&](int64_t m, int64_t* peak) {
      zero_grad(params, true);
      const int64_t live0 = tracker.current();
      tracker.reset_peak();
      const auto t0 = Clock::now();
      forward_backward(workload, batch.slice(0, m), 1.0, plain);
      const double s = seconds_since(t0);
      if (peak) *peak = tracker.peak() - live0;
      zero_grad(params, true);
      return s;
    };
    int64_t measured = 0;
    pp.chain_seconds_large = std::min(run(b, &measured), run(b, nullptr));
    pp.chain_seconds_small = b > a ? std::min(run(a, nullptr), run(a, nullptr)) : pp.chain_seconds_large;
    if (request.batch > b) {
      // The whole batch too, for the time line above b (where micro-batching is decided), but
      // with every block recomputed, so that profiling needs little more memory than the
      // smallest plan. The same run at b, against the plain one there, says what recomputing
      // costs; that ratio takes it out again.
      plain.checkpoint = CheckpointPlan::all(workload.chain->size());
      const double all_large = std::min(run(b, nullptr), run(b, nullptr));
      const double all_full = std::min(run(request.batch, nullptr), run(request.batch, nullptr));
      plain.checkpoint = CheckpointPlan::none();
      pp.chain_seconds_full = all_large > 0 ? all_full * pp.chain_seconds_large / all_large : all_full;
    }
    profiles_.push_back(pp);
    ChainCosts modelled = costs_at(b, profiles_.back());
    modelled.fixed_bytes = 0;
    modelled.gradients_present = false;
    const int64_t predicted = evaluate_schedule(modelled, {}).peak_bytes;
    if (predicted > 0) {
      profiles_.back().calibration =
          std::clamp(static_cast<double>(measured) / static_cast<double>(predicted), 0.8, 1.5);
    }
  }
}

const PrecisionProfile& Planner::profile(Precision precision) const {
  for (const auto& p : profiles_) {
    if (p.precision == precision) return p;
  }
  TORCH_CHECK(false, "memfit::Planner: precision ", precision_name(precision), " was not profiled");
}

ChainCosts Planner::costs_at(int64_t m) const { return costs_at(m, profiles_.front()); }
ChainCosts Planner::costs_at(int64_t m, Precision precision) const { return costs_at(m, profile(precision)); }

ChainCosts Planner::costs_at(int64_t m, const PrecisionProfile& p) const {
  ChainCosts c;
  const ChainProfile& small = p.small;
  const ChainProfile& large = p.large;
  const int64_t m1 = small.micro_batch, m2 = large.micro_batch;
  double block_seconds = 0;
  for (size_t i = 0; i < small.blocks.size(); ++i) {
    const BlockCost& s = small.blocks[i];
    const BlockCost& l = large.blocks[i];
    BlockCost f;
    // Below the smallest measured size a block is not assumed any faster: fixed per-call
    // costs dominate there (these seconds only divide the chain's time among blocks).
    const int64_t mt = std::max(m, m1);
    f.forward_seconds = fit(m1, s.forward_seconds, m2, l.forward_seconds, mt);
    f.backward_seconds = fit(m1, s.backward_seconds, m2, l.backward_seconds, mt);
    block_seconds += f.forward_seconds + f.backward_seconds;
    f.output_bytes = fit_bytes(m1, s.output_bytes, m2, l.output_bytes, m);
    f.output_kept = l.output_kept;
    f.kept_bytes = fit_bytes(m1, s.kept_bytes, m2, l.kept_bytes, m);
    f.forward_peak = fit_bytes(m1, s.forward_peak, m2, l.forward_peak, m);
    f.forward_nograd_peak = fit_bytes(m1, s.forward_nograd_peak, m2, l.forward_nograd_peak, m);
    f.backward_peak = fit_bytes(m1, s.backward_peak, m2, l.backward_peak, m);
    f.param_bytes = s.param_bytes;
    f.cast_bytes = s.cast_bytes;
    for (int64_t* v : {&f.kept_bytes, &f.forward_peak, &f.forward_nograd_peak, &f.backward_peak}) {
      *v = static_cast<int64_t>(std::llround(static_cast<double>(*v) * p.calibration));
    }
    c.blocks.push_back(f);
  }
  // The plain chain's measured seconds at m: the line through the two measured sizes, never
  // falling with m and never below zero at m = 0 (a fixed cost per micro-batch is real; a
  // negative one would make small micro-batches look cheaper per sample than they are).
  double chain = p.chain_seconds_large;
  const int64_t B = request_.batch;
  if (m > m2 && B > m2 && p.chain_seconds_full > 0) {
    // Above the larger profiled size: the line to the whole batch's estimate.
    const double slope = std::max(0.0, (p.chain_seconds_full - p.chain_seconds_large) / static_cast<double>(B - m2));
    chain = p.chain_seconds_large + slope * static_cast<double>(m - m2);
  } else if (m2 > m1) {
    const double slope = std::max(0.0, (p.chain_seconds_large - p.chain_seconds_small) / static_cast<double>(m2 - m1));
    const double intercept = p.chain_seconds_large - slope * static_cast<double>(m2);
    chain = intercept >= 0 ? intercept + slope * static_cast<double>(m)
                           : p.chain_seconds_large * static_cast<double>(m) / static_cast<double>(m2);
  }
  if (block_seconds > 0) {
    const double scale = chain / block_seconds;
    for (auto& f : c.blocks) {
      f.forward_seconds *= scale;
      f.backward_seconds *= scale;
    }
  }
  c.fixed_bytes = weight_bytes_ + optimizer_state_bytes() + batch_bytes_;
  c.gradients_present = m < request_.batch || request_.keep_grads;
  c.segment_overhead_bytes = rng_state_bytes();
  return c;
}

int64_t Planner::optimizer_state_bytes() const {
  return request_.optimizer_state_bytes >= 0 ? request_.optimizer_state_bytes : 2 * weight_bytes_;  // AdamW
}

int64_t Planner::optimizer_peak() const {
  // The optimizer step: weights, gradients, AdamW state, the batch, AdamW's two temporaries of
  // the largest parameter it updates, and what else lives then (state gathered for saving).
  const int64_t optimizer = optimizer_state_bytes();
  const int64_t gradients = request_.gradient_bytes >= 0 ? request_.gradient_bytes : weight_bytes_;
  const int64_t largest = request_.largest_update_bytes >= 0 ? request_.largest_update_bytes : largest_param_;
  return weight_bytes_ + gradients + optimizer + batch_bytes_ + 2 * largest + request_.extra_bytes;
}

double Planner::step_seconds(int64_t m, const PrecisionProfile& p, const std::vector<std::pair<int, int>>& segments) const {
  const int64_t B = request_.batch;
  const int64_t full = B / m, rest = B % m;
  double seconds = static_cast<double>(full) * evaluate_schedule(costs_at(m, p), segments).seconds;
  if (rest > 0) seconds += evaluate_schedule(costs_at(rest, p), segments).seconds;
  return seconds;
}

Schedule Planner::uniform(int64_t m, int segments) const {
  const ChainCosts c = costs_at(m);
  const int n = static_cast<int>(c.blocks.size());
  const int length = (n + segments - 1) / segments;
  std::vector<std::pair<int, int>> s;
  for (int start = 0; start + length < n; start += length) s.emplace_back(start, std::min(n, start + length) - 1);
  return evaluate_schedule(c, s);
}

Plan Planner::evaluate(int64_t m, Precision precision, const CheckpointPlan& checkpoint, int64_t budget) const {
  if (budget <= 0) budget = request_.budget_bytes;
  TORCH_CHECK(m >= 1 && m <= request_.batch, "memfit::Planner::evaluate: micro-batch must be 1 to ", request_.batch,
              ", got ", m);
  const PrecisionProfile& pp = profile(precision);
  Plan p;
  p.budget_bytes = budget;
  p.baseline_precision = profiles_.front().precision;
  const Schedule plain = evaluate_schedule(costs_at(request_.batch), {});
  p.plain_predicted_peak = std::max(plain.peak_bytes, optimizer_peak());
  p.plain_predicted_seconds = plain.seconds;
  p.micro_batch = m;
  p.accumulation = (request_.batch + m - 1) / m;
  p.precision = precision;
  p.checkpoint = checkpoint;
  p.predicted_peak = std::max(evaluate_schedule(costs_at(m, pp), checkpoint.segments).peak_bytes, optimizer_peak());
  p.predicted_seconds = step_seconds(m, pp, checkpoint.segments);
  const auto usable = static_cast<int64_t>(static_cast<double>(budget) * (1.0 - request_.margin));
  p.feasible = p.predicted_peak <= usable;
  p.floor_bytes = floor_bytes();
  return p;
}

int64_t Planner::floor_bytes() const {
  // The smallest peak over precisions at the smallest micro-batch allowed, margin included.
  const int64_t m = request_.micro_batch > 0 ? request_.micro_batch : 1;
  int64_t smallest = std::numeric_limits<int64_t>::max();
  for (const auto& pp : profiles_) {
    const ChainCosts c = costs_at(m, pp);
    const int64_t s = request_.checkpoint ? evaluate_schedule(c, request_.checkpoint->segments).peak_bytes : smallest_peak(c);
    smallest = std::min(smallest, std::max(s, optimizer_peak()));
  }
  return static_cast<int64_t>(std::ceil(static_cast<double>(smallest) / (1.0 - request_.margin)));
}

Plan Planner::plan(int64_t budget) const {
  if (budget <= 0) budget = request_.budget_bytes;
  Plan p;
  p.budget_bytes = budget;
  p.precision = p.baseline_precision = profiles_.front().precision;
  p.notes = profile_notes_;
  const int64_t B = request_.batch;
  const auto usable = static_cast<int64_t>(static_cast<double>(budget) * (1.0 - request_.margin));
  const int64_t opt_peak = optimizer_peak();

  const Schedule plain = evaluate_schedule(costs_at(B), {});
  p.plain_predicted_peak = std::max(plain.peak_bytes, opt_peak);
  p.plain_predicted_seconds = plain.seconds;

  std::vector<int64_t> sizes;
  if (request_.micro_batch > 0) {
    sizes.push_back(request_.micro_batch);
  } else {
    for (int64_t m = B; m >= 1; m = m == 1 ? 0 : (m + 1) / 2) sizes.push_back(m);
  }
  p.floor_bytes = floor_bytes();

  // The fastest fitting plan of each precision, then the fastest of those. Ties (within 1%)
  // go to the larger micro-batch, and to the earlier precision.
  std::vector<Plan> best_of;
  for (const auto& pp : profiles_) {
    Plan best;
    if (opt_peak <= usable) {
      for (int64_t m : sizes) {
        const ChainCosts costs = costs_at(m, pp);
        const Schedule s = request_.checkpoint ? evaluate_schedule(costs, request_.checkpoint->segments)
                                               : solve_schedule(costs, usable);
        if (!s.feasible || s.peak_bytes > usable) continue;
        const double seconds = step_seconds(m, pp, s.segments);
        if (!best.feasible || seconds < 0.99 * best.predicted_seconds) {
          best.feasible = true;
          best.micro_batch = m;
          best.accumulation = (B + m - 1) / m;
          best.precision = pp.precision;
          best.checkpoint.segments = s.segments;
          best.predicted_peak = std::max(s.peak_bytes, opt_peak);
          best.predicted_seconds = seconds;
        }
      }
    }
    best_of.push_back(best);
  }
  const Plan* chosen = nullptr;
  for (const auto& b : best_of) {
    if (b.feasible && (chosen == nullptr || b.predicted_seconds < 0.99 * chosen->predicted_seconds)) chosen = &b;
  }
  if (chosen == nullptr) {
    p.notes.push_back("no plan fits " + format_bytes(budget) + ": the smallest budget that works is " +
                      format_bytes(p.floor_bytes) + " (" + std::to_string(p.floor_bytes) + " bytes)");
    return p;
  }
  p.feasible = true;
  p.micro_batch = chosen->micro_batch;
  p.accumulation = chosen->accumulation;
  p.precision = chosen->precision;
  p.checkpoint = chosen->checkpoint;
  p.predicted_peak = chosen->predicted_peak;
  p.predicted_seconds = chosen->predicted_seconds;
  // Say plainly why this precision, when there was a choice.
  char buf[160];
  for (const auto& b : best_of) {
    if (&b == chosen) continue;
    const char* name = precision_name(b.precision);
    if (!b.feasible) {
      std::snprintf(buf, sizeof buf, "%s considered: no %s plan fits", name, name);
    } else {
      std::snprintf(buf, sizeof buf, "%s: its best plan is predicted %.2fx the time of the %s plan chosen", name,
                    b.predicted_seconds / chosen->predicted_seconds, precision_name(chosen->precision));
    }
    p.notes.push_back(buf);
  }
  if (profiles_.size() > 1 && p.precision != p.baseline_precision) {
    p.notes.push_back(std::string("precision ") + precision_name(p.precision) +
                      " chosen: mixed precision measured faster on this device (pass --precision fp32 to forbid it)");
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
    plain.precision = plan.baseline_precision;
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
  j["plain"] = {{"precision", precision_name(p.baseline_precision)}, {"predicted_peak_bytes", p.plain_predicted_peak}};
  if (v != nullptr && p.feasible) {
    j["measured"] = {{"peak_bytes", v->measured_peak},
                     {"step_time_ratio", v->plain_seconds > 0 ? v->measured_seconds / v->plain_seconds : 0.0},
                     {"step_seconds", v->measured_seconds},
                     {"plain_step_seconds", v->plain_seconds}};
    j["verify_attempts"] = v->attempts;
  }
  j["notes"] = p.notes;
  if (v != nullptr) {
    for (const auto& n : v->notes) j["notes"].push_back(n);
  }
  return j;
}

}  // namespace memfit
