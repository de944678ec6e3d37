// What a training run records and writes: the steps chart, the summary's JSON, the events' fan-out,
// the JSON-lines log and the HTML report.
#include <torch/torch.h>

#include <cmath>
#include <cstdio>
#include <filesystem>

#include "memfit/errors.h"
#include "memfit/measure/size.h"
#include "memfit/report/html_report.h"
#include "trainer_impl.h"

namespace memfit {

void StepHistory::add(const StepPoint& point) {
  last_ = point;
  if (point.step % stride_ != 0 && !point.eval_loss) return;  // between kept points
  if (points_.size() == kCapacity) {
    // Keep every other point (evaluations always), and take half as many from now on.
    size_t kept = 0;
    for (size_t i = 0; i < points_.size(); ++i) {
      if (i % 2 == 0 || points_[i].eval_loss) points_[kept++] = points_[i];
    }
    points_.resize(kept);
    stride_ *= 2;
  }
  if (points_.size() < kCapacity) points_.push_back(point);
}

std::vector<StepPoint> StepHistory::points() const {
  std::vector<StepPoint> out = points_;
  if (last_.step > 0 && (out.empty() || out.back().step != last_.step)) out.push_back(last_);
  return out;
}

nlohmann::json TrainSummary::json() const {
  nlohmann::json j = {{"type", "summary"},          {"first_step", first_step},
          {"steps", steps},             {"samples", samples},
          {"final_loss", final_loss},   {"evaluated", evaluated},
          {"eval_loss", eval_loss},     {"peak_bytes", peak_bytes},
          {"host_peak_bytes", host_peak_bytes},
          {"budget_bytes", budget_bytes}, {"oom_recoveries", oom_recoveries},
          {"skipped_steps", skipped_steps}, {"skipped_updates", skipped_updates},
          {"planning_seconds", planning_seconds}, {"profile_cached", profile_cached},
          {"weights_sha256", weights_sha256},
          {"world_size", world_size},   {"zero_stage", zero_stage},
          {"seconds", seconds},         {"phase_seconds", phase_seconds},
          {"interrupted", interrupted}, {"report_file", report_file},
          {"ranks", ranks_json(ranks)}, {"plan", plan_json(plan)}};
  if (cuda) {
    j["cuda"] = {{"max_memory_allocated", cuda->peak_allocated}, {"max_memory_reserved", cuda->peak_reserved},
                 {"num_alloc_retries", cuda->num_alloc_retries}, {"num_ooms", cuda->num_ooms},
                 {"outside_bytes", cuda_outside_bytes}};
  }
  return j;
}

// --- observers --------------------------------------------------------------------------------

void Observers::on_start(const StartEvent& e) {
  for (auto* o : observers_) o->on_start(e);
}
void Observers::on_plan(const PlanEvent& e) {
  for (auto* o : observers_) o->on_plan(e);
}
void Observers::on_step(const StepEvent& e) {
  for (auto* o : observers_) o->on_step(e);
}
void Observers::on_eval(const EvalEvent& e) {
  for (auto* o : observers_) o->on_eval(e);
}
void Observers::on_save(const SaveEvent& e) {
  for (auto* o : observers_) o->on_save(e);
}
void Observers::on_note(const std::string& note) {
  for (auto* o : observers_) o->on_note(note);
}
void Observers::on_summary(const TrainSummary& s) {
  for (auto* o : observers_) o->on_summary(s);
}

JsonLog::JsonLog(const std::string& path) : path_(path), tmp_(path + ".tmp") {
  out_.open(tmp_);
  check_option(static_cast<bool>(out_), "json_log", "'" + path_ + "'", "cannot create " + tmp_);
}

JsonLog::~JsonLog() {
  if (!out_.is_open()) return;  // committed
  out_.close();
  std::remove(tmp_.c_str());
}

void JsonLog::write(const nlohmann::json& line) {
  if (out_.is_open()) out_ << line.dump() << "\n";
}

void JsonLog::on_plan(const PlanEvent& e) {
  nlohmann::json line = plan_json(e.plan);
  line["type"] = "plan";
  line["planning_seconds"] = e.planning_seconds;
  line["profile_cached"] = e.profile_cached;
  write(line);
}

void JsonLog::on_step(const StepEvent& e) {
  nlohmann::json line{{"type", "step"},          {"step", e.step},           {"loss", e.loss},
                      {"samples", e.samples},    {"seconds", e.seconds},     {"live_bytes", e.live_bytes},
                      {"peak_bytes", e.peak_bytes}, {"host_peak_bytes", e.host_peak_bytes},
                      {"oom_recoveries", e.oom_recoveries}, {"tokens_per_sample", e.tokens_per_sample},
                      {"micro_batch", e.micro_batch},       {"recomputed_blocks", e.recomputed_blocks}};
  if (e.eval_loss) line["eval_loss"] = *e.eval_loss;
  write(line);
}

void JsonLog::on_note(const std::string& note) { write({{"type", "note"}, {"text", note}}); }

void JsonLog::on_summary(const TrainSummary& s) {
  write({{"type", "profile"}, {"seconds", s.phase_seconds}});
  write(s.json());
  out_.flush();
  out_.close();
  std::filesystem::rename(tmp_, path_);
}

// --- the HTML report --------------------------------------------------------------------------

namespace {

// What went to the host: the plan's and the run's host peaks, and the last step's host bytes by
// category at their peak (fp32 masters are weights there).
void add_host_rows(ReportDocument& d, const Plan& p, const RunRecord& record) {
  d.plan_rows.push_back({"offloaded to the host", p.config.offload.describe()});
  d.plan_rows.push_back({"host peak: predicted / measured (run)",
                         format_bytes(p.predicted_host_peak) + " / " + format_bytes(record.summary.host_peak_bytes)});
  if (!record.last_host_step) return;
  const Categories& c = record.last_host_step->at_peak;
  d.plan_rows.push_back({"host at its peak (last step, " + std::string(phase_name(record.last_host_step->peak_phase)) + ")",
                         "weights (fp32 masters) " + format_bytes(c.weights) + ", gradients " + format_bytes(c.gradients) +
                             ", optimizer state " + format_bytes(c.optimizer_state) + ", activations " +
                             format_bytes(c.activations) + ", other " + format_bytes(c.other)});
}

}  // namespace

ReportDocument Trainer::Impl::report_document() const {
  ReportDocument d;
  d.title = std::string("memfit train") + (record.last_step ? "" : " (stopped early)") + ": " + workload.description;
  d.device = options.step.device.str();
  d.budget_bytes = plan.budget;
  d.step = record.last_step;
  d.block_names = workload.chain->block_names();
  for (int i = 0; i < workload.chain->size(); ++i) d.block_recomputed.push_back(plan.plan.config.checkpoint.recomputes(i));
  const Plan& p = plan.plan;
  const StepConfig& c = p.config;
  d.plan_rows = {{"budget", format_bytes(plan.budget)},
                 {"micro-batch x accumulation", std::to_string(c.micro_batch_size()) + " x " + std::to_string(c.accumulation())},
                 {"precision", precision_name(c.precision)},
                 {"recomputed blocks", c.checkpoint.describe() + (p.checkpoint_pinned ? " (pinned)" : " (chosen by the plan)")},
                 {"optimizer", c.optimizer.describe()},
                 {"predicted peak", format_bytes(p.predicted_peak)},
                 {"measured peak (run)", format_bytes(record.summary.peak_bytes)},
                 {"plain step, predicted", format_bytes(p.plain_predicted_peak)}};
  if (c.offload.any()) add_host_rows(d, p, record);
  d.plan_config = c;
  d.ranks = record.summary.ranks;
  d.zero_stage = options.distributed.zero_stage;
  for (const auto& b : plan.job->planner().request().gathered_blocks) {
    d.largest_gathered_block_bytes = std::max(d.largest_gathered_block_bytes, b.full);
  }
  d.steps = record.history.points();
  return d;
}

void Trainer::Impl::write_report() {
  if (options.report_html.empty()) return;
  write_html_report(options.report_html, report_document().to_json());
  record.summary.report_file = options.report_html;
}

}  // namespace memfit
