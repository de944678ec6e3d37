#include "train_output.h"

#include <fmt/format.h>

#include <algorithm>
#include <cstdio>

#include "plan_output.h"

namespace memfit::cli {

void TrainOutput::end_progress_line() {
  if (!line_open_) return;
  fmt::print("\n");
  line_open_ = false;
}

void TrainOutput::on_start(const StartEvent& e) {
  fmt::print("memfit train: {}\n", e.description);
  fmt::print("  {} parameters ({}), batch {}, {}, {} threads, {}\n", e.parameters, format_bytes(e.parameter_bytes), e.batch,
             e.optimizer, e.threads, e.device);
  for (const auto& n : e.notes) fmt::print("  note: {}\n", in_flag_terms(n));
  if (!e.strategy.empty()) {
    fmt::print("  {}; samples {} to {} of each batch\n", e.strategy, e.local_start, e.local_start + e.local_length - 1);
  }
}

void TrainOutput::on_plan(const PlanEvent& e) {
  const std::string source = e.profile_cached ? ", the measurements read from the profile cache (--replan measures again)"
                                              : std::string(", measuring the model") + (e.profile_stored ? " (cached for the next run)" : "");
  fmt::print("\n");
  print_plan(e.plan, e.block_names, nullptr, fmt::format("planned in {:.2f} s{}", e.planning_seconds, source));
  fmt::print("  budget covers tensor storage (LibTorch's allocator); BLAS/oneDNN workspaces are outside it\n\n");
  std::fflush(stdout);  // the plan shows before training starts, also through a pipe (memfit launch)
}

void TrainOutput::on_step(const StepEvent& e) {
  const int64_t every = progress_.every > 0 ? progress_.every : std::max<int64_t>(1, (e.last_step - e.first_step + 1) / 20);
  if (!progress_.show || !(progress_.terminal || e.step % every == 0 || e.step == e.last_step || e.eval_loss)) return;
  const int64_t total = std::max<int64_t>(1, e.last_step - e.first_step + 1);
  constexpr int kWidth = 24;
  const int filled = static_cast<int>(kWidth * (e.step - e.first_step + 1) / total);
  const double per_second = static_cast<double>(e.samples * e.tokens_per_sample) / e.seconds;
  const std::string eval = e.eval_loss ? fmt::format("  eval {:.4f}", *e.eval_loss) : "";
  fmt::print("{}[{}{}] step {}/{}  loss {:.4f}{}  {:.0f} {}/s  live {}  peak {} / {}{}", progress_.terminal ? "\r" : "",
             std::string(static_cast<size_t>(filled), '#'), std::string(static_cast<size_t>(kWidth - filled), '.'), e.step,
             e.last_step, e.loss, eval, per_second, e.tokens_per_sample > 1 ? "tok" : "samples", format_bytes(e.live_bytes),
             format_bytes(e.peak_bytes), format_bytes(e.budget_bytes), progress_.terminal ? "" : "\n");
  line_open_ = progress_.terminal;
  std::fflush(stdout);
}

void TrainOutput::on_note(const std::string& note) {
  end_progress_line();
  fmt::print("{}\n", in_flag_terms(note));
}

namespace {

void print_phase_times(const TrainSummary& s) {
  double total = 0;
  for (const auto& [phase, seconds] : s.phase_seconds) total += seconds;
  fmt::print("  time per phase:");
  for (const char* phase : {"data", "forward", "backward", "recompute", "optimizer", "eval"}) {
    const auto it = s.phase_seconds.find(phase);
    if (it == s.phase_seconds.end()) continue;
    fmt::print(" {} {:.2f} s ({:.2f}%)", phase, it->second, 100.0 * it->second / std::max(total, 1e-9));
  }
  fmt::print("\n");
}

void print_rank_states(const TrainSummary& s) {
  const bool ranks = s.ranks.size() > 1;
  fmt::print("  state at the optimizer step{}; activations and the rest come on top, up to the peak:\n",
             ranks ? fmt::format(" per rank (ZeRO stage {})", s.zero_stage) : "");
  for (size_t r = 0; r < s.ranks.size(); ++r) {
    const RankStateBytes& b = s.ranks[r];
    fmt::print("    {}weights {}, gradients {}, optimizer state {}\n", ranks ? fmt::format("rank {}: ", r) : "",
               format_bytes(b.weights), format_bytes(b.gradients), format_bytes(b.optimizer_state));
  }
}

}  // namespace

void TrainOutput::on_summary(const TrainSummary& s) {
  end_progress_line();
  fmt::print("\nSummary: {} steps, {} samples in {:.2f} s; final loss {:.6g}", s.steps - s.first_step + 1, s.samples, s.seconds,
             s.final_loss);
  if (s.evaluated) fmt::print(", held-out loss {:.6g}", s.eval_loss);
  fmt::print("\n  peak {} ({} bytes) of a {} budget; out-of-memory recoveries: {}\n", format_bytes(s.peak_bytes), s.peak_bytes,
             format_bytes(s.budget_bytes), s.oom_recoveries);
  if (s.cuda) {
    fmt::print("  CUDA: max_memory_reserved {} ({} bytes; predicted {}), {} outside the allocator; allocator retries {}, "
               "out-of-memory errors {}\n",
               format_bytes(s.cuda->peak_reserved), s.cuda->peak_reserved, format_bytes(s.plan.reserved.peak_reserved),
               format_bytes(s.cuda_outside_bytes), s.cuda->num_alloc_retries, s.cuda->num_ooms);
  }
  if (s.plan.config.offload.any()) {
    fmt::print("  host peak {} ({} bytes; predicted {}): {} offloaded\n", format_bytes(s.host_peak_bytes), s.host_peak_bytes,
               format_bytes(s.plan.predicted_host_peak), s.plan.config.offload.describe());
  }
  if (s.skipped_steps > 0) fmt::print("  optimizer steps skipped by the loss scaler (inf/NaN gradients): {}\n", s.skipped_steps);
  if (s.skipped_updates > 0) {
    fmt::print("  parameter updates skipped by the 8-bit optimizer (inf/NaN gradients; weights and state kept): {}\n",
               s.skipped_updates);
  }
  print_rank_states(s);
  print_phase_times(s);
  if (!s.report_file.empty()) fmt::print("  report: {}\n", s.report_file);
  std::fflush(stdout);
}

}  // namespace memfit::cli
