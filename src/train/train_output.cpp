// What `memfit train` prints and writes: the header, the plan, progress lines, the summary,
// the JSON-lines log and the HTML report.
#include <torch/torch.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>

#include "memfit/errors.h"
#include "memfit/measure/breakdown.h"
#include "memfit/measure/size.h"
#include "memfit/report/html_report.h"
#include "memfit/report/report.h"
#include "trainer_impl.h"

namespace memfit {
namespace {

std::string fixed2(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", v);
  return buf;
}

std::string recompute_text(const Plan& plan) {
  return plan.config.checkpoint.describe() + (plan.checkpoint_pinned ? " (pinned)" : " (chosen by the plan)");
}

}  // namespace

JsonLog::JsonLog(const std::string& path) : path_(path) {
  if (path_.empty()) return;
  tmp_ = path_ + ".tmp";
  out_.open(tmp_);
  check_option(static_cast<bool>(out_), "json_log", "'" + path_ + "'", "cannot create " + tmp_);
}

JsonLog::~JsonLog() {
  if (out_.is_open()) {  // an interrupted run leaves no half-written log
    out_.close();
    std::remove(tmp_.c_str());
  }
}

void JsonLog::write(const nlohmann::json& line) {
  if (out_.is_open()) out_ << line.dump() << "\n";
}

void JsonLog::commit() {
  if (!out_.is_open()) return;
  out_.flush();
  out_.close();
  std::filesystem::rename(tmp_, path_);
}

void StepHistory::add(const StepPoint& point) {
  last_ = point;
  if (point.step % stride_ != 0 && std::isnan(point.eval_loss)) return;  // between kept points
  if (points_.size() == kCapacity) {
    // Keep every other point (evaluations always), and take half as many from now on.
    size_t kept = 0;
    for (size_t i = 0; i < points_.size(); ++i) {
      if (i % 2 == 0 || !std::isnan(points_[i].eval_loss)) points_[kept++] = points_[i];
    }
    points_.resize(kept);
    stride_ *= 2;
  }
  if (points_.size() < kCapacity) points_.push_back(point);
}

nlohmann::json StepHistory::json() const {
  nlohmann::json out = nlohmann::json::array();
  for (const auto& p : points_) {
    nlohmann::json j{{"step", p.step}, {"loss", p.loss}, {"live_bytes", p.live_bytes}, {"peak_bytes", p.peak_bytes}};
    if (!std::isnan(p.eval_loss)) j["eval_loss"] = p.eval_loss;
    out.push_back(j);
  }
  if (last_.step > 0 && (points_.empty() || points_.back().step != last_.step)) {  // the last step, always
    out.push_back({{"step", last_.step}, {"loss", last_.loss}, {"live_bytes", last_.live_bytes}, {"peak_bytes", last_.peak_bytes}});
  }
  return out;
}

void print_header(TrainerState& t) {
  t.out << "memfit train: " << t.w.description << "\n";
  t.out << "  " << t.parameter_count << " parameters (" << format_bytes(t.parameter_bytes)
        << "), batch " << t.o.batch << ", " << t.o.optimizer.describe() << ", " << at::get_num_threads()
        << " threads, " << t.o.device.str() << "\n";
  for (const auto& n : t.w.notes) t.out << "  note: " << n << "\n";
  if (!t.sdp) return;
  const int64_t stepped = t.sdp->zero_stage() > 0 ? t.sdp->owned_bytes() : t.sdp->parameter_bytes();
  t.out << "  rank " << t.sdp->rank() << " of " << t.sdp->world_size() << " (" << t.context->backend_name() << " via "
        << t.o.distributed.master << "), ZeRO stage " << t.sdp->zero_stage() << ": samples " << t.local.start << " to "
        << t.local.start + t.local.length - 1 << " of each batch; the optimizer steps " << format_bytes(stepped)
        << " of the parameters\n";
}

void print_plan(TrainerState& t) {
  const Plan& p = t.plan;
  t.out << "\nPlan for a budget of " << format_bytes(t.budget) << " (" << t.budget << " bytes, 3% kept free):\n";
  t.out << "  micro-batch " << p.config.micro_batch_size() << " x " << p.config.accumulation()
        << " accumulation steps, precision " << precision_name(p.config.precision) << ", recompute " << recompute_text(p)
        << "\n";
  t.out << "  predicted peak " << format_bytes(p.predicted_peak) << "; the plain step would need "
        << format_bytes(p.plain_predicted_peak);
  if (p.plain_predicted_seconds > 0 && p.predicted_seconds > 0) {
    t.out << "; predicted step time " << fixed2(p.predicted_seconds / p.plain_predicted_seconds) << "x the plain step";
  }
  t.out << "\n  planned in " << fixed2(t.summary.planning_seconds) << " s"
        << (t.costs_source.cached ? ", the measurements read from the profile cache (--replan measures again)"
                                  : ", measuring the model" + std::string(t.costs_source.path.empty() ? "" : " (cached for the next run)"))
        << "\n";
  for (const auto& n : p.notes) t.out << "  note: " << n << "\n";
  t.out << "  budget covers tensor storage (LibTorch's allocator); BLAS/oneDNN workspaces are outside it\n\n"
        << std::flush;  // the plan shows before training starts, also through a pipe (memfit launch)
}

void print_progress(TrainerState& t, int64_t step, const nlohmann::json& line) {
  const int64_t first = t.start_step, total = t.o.steps;
  const int64_t every = t.o.progress_every > 0 ? t.o.progress_every : std::max<int64_t>(1, (total - first) / 20);
  const bool eval = line.contains("eval_loss");
  if (!t.o.progress || !(t.tty || step % every == 0 || step == total || eval)) return;
  const double seconds = line.at("seconds").get<double>();
  const double per_sec = static_cast<double>(t.o.batch * t.w.sample_tokens) / seconds;
  const int width = 24;
  const int filled = static_cast<int>(width * (step - first) / std::max<int64_t>(1, total - first));
  const std::string eval_text = eval ? "  eval " + std::to_string(line.at("eval_loss").get<double>()).substr(0, 6) : "";
  char text[512];
  std::snprintf(text, sizeof text, "%s[%s%s] step %lld/%lld  loss %.4f%s  %.0f %s/s  live %s  peak %s / %s",
                t.tty ? "\r" : "", std::string(static_cast<size_t>(filled), '#').c_str(),
                std::string(static_cast<size_t>(width - filled), '.').c_str(), static_cast<long long>(step),
                static_cast<long long>(total), line.at("loss").get<double>(), eval_text.c_str(), per_sec,
                t.w.sample_tokens > 1 ? "tok" : "samples", format_bytes(line.at("live_bytes").get<int64_t>()).c_str(),
                format_bytes(line.at("peak_bytes").get<int64_t>()).c_str(), format_bytes(t.budget).c_str());
  t.out << text << (t.tty ? "" : "\n") << std::flush;
}

namespace {

void print_phase_times(TrainerState& t) {
  const Phase phases[] = {Phase::kData, Phase::kForward, Phase::kBackward, Phase::kRecompute, Phase::kOptimizer, Phase::kEval};
  double total = 0;
  for (Phase p : phases) total += static_cast<double>(t.tracker->phase_time_ns(p));
  nlohmann::json profile;
  t.out << "  time per phase:";
  for (Phase p : phases) {
    const double s = static_cast<double>(t.tracker->phase_time_ns(p)) / 1e9;
    profile[phase_name(p)] = s;
    t.out << " " << phase_name(p) << " " << fixed2(s) << " s (" << fixed2(100.0 * s * 1e9 / std::max(total, 1.0)) << "%)";
  }
  t.out << "\n";
  t.log->write({{"type", "profile"}, {"seconds", profile}});
}

}  // namespace

void print_summary(TrainerState& t) {
  const TrainSummary& s = t.summary;
  t.out << "\nSummary: " << (s.steps - t.start_step) << " steps, " << s.samples << " samples in " << fixed2(s.seconds)
        << " s; final loss " << s.final_loss;
  if (t.o.eval_every > 0) t.out << ", held-out loss " << s.eval_loss;
  t.out << "\n  peak " << format_bytes(s.peak_bytes) << " (" << s.peak_bytes << " bytes) of a " << format_bytes(t.budget)
        << " budget; out-of-memory recoveries: " << s.oom_recoveries << "\n";
  if (s.skipped_steps > 0) t.out << "  optimizer steps skipped by the loss scaler (inf/NaN gradients): " << s.skipped_steps << "\n";
  if (s.skipped_updates > 0) {
    t.out << "  parameter updates skipped by the 8-bit optimizer (inf/NaN gradients; weights and state kept): "
          << s.skipped_updates << "\n";
  }
  t.out << "  state at the optimizer step"
        << (t.sdp ? " per rank (ZeRO stage " + std::to_string(t.sdp->zero_stage()) + ")" : "")
        << "; activations and the rest come on top, up to the peak:\n";
  for (const auto& r : s.ranks) {
    t.out << "    " << (t.sdp ? "rank " + std::to_string(r.rank) + ": " : "") << "weights " << format_bytes(r.bytes.weights)
          << ", gradients " << format_bytes(r.bytes.gradients) << ", optimizer state "
          << format_bytes(r.bytes.optimizer_state) << "\n";
  }
  print_phase_times(t);
}

nlohmann::json step_document(TrainerState& t, const KnownStorage& known) {
  const StepAnalysis a = analyze_step(*t.tracker, known, t.w.chain->size());
  std::vector<std::string> names;
  std::vector<bool> recomputed;
  for (int i = 0; i < t.w.chain->size(); ++i) {
    names.push_back(t.w.chain->block(i).name);
    recomputed.push_back(t.plan.config.checkpoint.recomputes(i));
  }
  nlohmann::json d = step_chart_document("memfit train: " + t.w.description, t.o.device.str(), a, names, recomputed);
  d["budget_bytes"] = t.budget;
  return d;
}

void write_report(TrainerState& t) {
  if (t.o.report_html.empty()) return;
  if (t.last_step_doc.is_null()) {  // stopped before the last step: no step was recorded
    t.last_step_doc = {{"title", "memfit train (stopped early): " + t.w.description},
                       {"device", t.o.device.str()},
                       {"budget_bytes", t.budget}};
  }
  const Plan& p = t.plan;
  const TrainSummary& s = t.summary;
  nlohmann::json rows = nlohmann::json::array();
  rows.push_back({"budget", format_bytes(t.budget)});
  rows.push_back({"micro-batch x accumulation",
                  std::to_string(p.config.micro_batch_size()) + " x " + std::to_string(p.config.accumulation())});
  rows.push_back({"precision", precision_name(p.config.precision)});
  rows.push_back({"recomputed blocks", recompute_text(p)});
  rows.push_back({"optimizer", p.config.optimizer.describe()});
  rows.push_back({"predicted peak", format_bytes(p.predicted_peak)});
  rows.push_back({"measured peak (run)", format_bytes(s.peak_bytes)});
  rows.push_back({"plain step, predicted", format_bytes(p.plain_predicted_peak)});
  nlohmann::json& d = t.last_step_doc;
  d["plan"] = {{"rows", rows}, {"config", step_config_json(p.config)}};
  if (s.ranks.size() > 1) {
    std::vector<RankStateBytes> ranks;
    for (const auto& r : s.ranks) ranks.push_back(r.bytes);
    d["ranks"] = ranks_json(ranks);
    d["zero_stage"] = s.zero_stage;
    if (t.sharded_weights()) {
      int64_t largest = 0;
      for (const auto& b : t.sdp->block_bytes()) largest = std::max(largest, b.full);
      d["largest_gathered_block_bytes"] = largest;
    }
  }
  d["steps"] = t.history.json();
  write_html_report(t.o.report_html, d);
  t.out << "  report: " << t.o.report_html << "\n";
}

}  // namespace memfit
