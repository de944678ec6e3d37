#include "memfit/trainer.h"

#include <openssl/evp.h>
#include <torch/torch.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <deque>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <limits>
#include <memory>
#include <sstream>

#include "memfit/accumulation.h"
#include "memfit/breakdown.h"
#include "memfit/budget_allocator.h"
#include "memfit/grads.h"
#include "memfit/html_report.h"
#include "memfit/memory_tracker.h"
#include "memfit/metrics.h"
#include "memfit/planner.h"
#include "memfit/report.h"
#include "memfit/size.h"
#include "memfit/step.h"

namespace fs = std::filesystem;

namespace memfit {
namespace {

using Clock = std::chrono::steady_clock;
double seconds_since(Clock::time_point t0) {
  return std::chrono::duration<double>(Clock::now() - t0).count();
}

std::string fmt_ratio(double v) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.2f", v);
  return buf;
}

constexpr double kMargin = 0.03;  // the plan keeps 3% of the budget free for what it cannot see

}  // namespace

std::string weights_sha256(const torch::nn::Module& module) {
  // OpenSSL 3's EVP interface (the SHA256_* functions are deprecated there).
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> ctx(EVP_MD_CTX_new(), &EVP_MD_CTX_free);
  if (!ctx || EVP_DigestInit_ex(ctx.get(), EVP_sha256(), nullptr) != 1) throw std::runtime_error("sha256: cannot initialise OpenSSL's digest");
  for (const auto& p : module.parameters()) {
    auto c = p.detach().contiguous();
    EVP_DigestUpdate(ctx.get(), c.data_ptr(), static_cast<size_t>(c.numel()) * c.element_size());
  }
  unsigned char digest[EVP_MAX_MD_SIZE];
  unsigned int length = 0;
  EVP_DigestFinal_ex(ctx.get(), digest, &length);
  std::string hex;
  char two[3];
  for (unsigned int i = 0; i < length; ++i) {
    std::snprintf(two, sizeof two, "%02x", digest[i]);
    hex += two;
  }
  return hex;
}

nlohmann::json TrainSummary::json() const {
  return {{"type", "summary"},          {"steps", steps},
          {"samples", samples},         {"final_loss", final_loss},
          {"eval_loss", eval_loss},     {"peak_bytes", peak_bytes},
          {"budget_bytes", budget_bytes}, {"oom_recoveries", oom_recoveries},
          {"weights_sha256", weights_sha256},
          {"world_size", world_size},   {"zero_stage", zero_stage},
          {"ranks", [this] {
             auto a = nlohmann::json::array();
             for (const auto& r : ranks) {
               a.push_back({{"rank", r.rank}, {"weights", r.weights}, {"gradients", r.gradients},
                            {"optimizer_state", r.optimizer_state}});
             }
             return a;
           }()},
          {"plan", {{"micro_batch", plan.micro_batch},
                    {"precision", precision_name(plan.precision)},
                    {"checkpoint", plan.checkpoint.recomputed_blocks()},
                    {"predicted_peak_bytes", plan.predicted_peak}}}};
}

namespace {

// --- state files -------------------------------------------------------------------------

void fsync_path(const fs::path& p) {
  FILE* f = std::fopen(p.c_str(), "rb");
  if (f == nullptr) return;
  ::fsync(fileno(f));
  std::fclose(f);
}

void save_state(const fs::path& dir, Workload& w, torch::optim::Optimizer& optimizer,
                const nlohmann::json& meta) {
  fs::create_directories(dir);
  torch::serialize::OutputArchive archive;
  torch::serialize::OutputArchive model, opt;
  w.chain->save(model);
  optimizer.save(opt);
  archive.write("model", model);
  archive.write("optimizer", opt);
  archive.write("meta", c10::IValue(meta.dump()));
  {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    archive.write("rng_cpu", gen.get_state());
  }
  // A temporary file, flushed to disk, then renamed: a kill at any moment leaves the
  // previous state.pt intact.
  const fs::path tmp = dir / ("state.pt.tmp" + std::to_string(::getpid()));
  archive.save_to(tmp.string());
  fsync_path(tmp);
  fs::rename(tmp, dir / "state.pt");
}

nlohmann::json load_state(const fs::path& dir, Workload& w, torch::optim::Optimizer& optimizer,
                          const std::string& expected_model, int64_t expected_batch) {
  const fs::path file = dir / "state.pt";
  if (!fs::exists(file)) {
    throw std::runtime_error("cannot resume: no saved state in '" + dir.string() + "' (expected " +
                             file.string() + ")");
  }
  torch::serialize::InputArchive archive;
  nlohmann::json meta;
  try {
    archive.load_from(file.string());
    c10::IValue meta_value;
    if (!archive.try_read("meta", meta_value)) throw std::runtime_error("no meta record");
    meta = nlohmann::json::parse(meta_value.toStringRef());
  } catch (const std::exception& e) {
    std::string what = e.what();
    what = what.substr(0, what.find('\n'));
    throw std::runtime_error("cannot resume: corrupt or truncated state file " + file.string() + " (" + what + ")");
  }
  if (meta.value("model", "") != expected_model) {
    throw std::runtime_error("cannot resume: " + file.string() + " holds '" + meta.value("model", "?") +
                             "', not '" + expected_model + "' (same model flags needed)");
  }
  if (meta.value("batch", int64_t{0}) != expected_batch) {
    throw std::runtime_error("cannot resume: " + file.string() + " was trained with --batch " +
                             std::to_string(meta.value("batch", int64_t{0})) + ", not " + std::to_string(expected_batch));
  }
  try {
    torch::serialize::InputArchive model, opt;
    archive.read("model", model);
    archive.read("optimizer", opt);
    w.chain->load(model);
    optimizer.load(opt);
    at::Tensor rng;
    archive.read("rng_cpu", rng);
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(rng);
  } catch (const c10::Error& e) {
    std::string what = e.what_without_backtrace();
    what = what.substr(0, what.find('\n'));
    throw std::runtime_error("cannot resume: state file " + file.string() + " does not match the model (" + what + ")");
  }
  return meta;
}

// A JSON-lines log written to FILE.tmp and renamed to FILE when the run ends.
class JsonLog {
 public:
  explicit JsonLog(const std::string& path) : path_(path) {
    if (path_.empty()) return;
    tmp_ = path_ + ".tmp";
    out_.open(tmp_);
    if (!out_) throw std::invalid_argument("invalid --json-log '" + path_ + "': cannot create " + tmp_);
  }
  ~JsonLog() {
    if (out_.is_open()) {  // an interrupted run leaves no half-written log
      out_.close();
      std::remove(tmp_.c_str());
    }
  }
  void write(const nlohmann::json& j) {
    if (out_.is_open()) out_ << j.dump() << "\n";
  }
  void commit() {
    if (!out_.is_open()) return;
    out_.flush();
    out_.close();
    fs::rename(tmp_, path_);
  }

 private:
  std::string path_, tmp_;
  std::ofstream out_;
};

// Every parameter as raw float32, in order: for comparing runs within a tolerance.
void dump_weights(const std::string& path, const std::vector<at::Tensor>& params) {
  std::ofstream f(path, std::ios::binary);
  if (!f) throw std::invalid_argument("invalid --dump-weights '" + path + "': cannot create it");
  for (const auto& p : params) {
    const at::Tensor c = p.detach().to(at::kFloat).contiguous();
    f.write(static_cast<const char*>(c.data_ptr()), static_cast<std::streamsize>(c.numel() * 4));
  }
}

std::vector<int64_t> grad_versions(const std::vector<at::Tensor>& params) {
  std::vector<int64_t> v;
  v.reserve(params.size());
  for (const auto& p : params) v.push_back(p.grad().defined() ? static_cast<int64_t>(p.grad()._version()) : -1);
  return v;
}

}  // namespace

TrainSummary train(const TrainOptions& options, std::ostream& out) {
  // Ranks hold equal weights: rank 0 alone writes the log, the report and the weights dump.
  TrainOptions o = options;
  const bool primary = o.distributed.rank == 0;
  if (!primary) {
    o.json_log.clear();
    o.report_html.clear();
    o.dump_weights.clear();
  }
  if (o.batch < 1) throw std::invalid_argument("invalid --batch " + std::to_string(o.batch) + ": expected a positive integer");
  if (o.steps < 1) throw std::invalid_argument("invalid --steps " + std::to_string(o.steps) + ": expected a positive integer");
  if (o.micro_batch < 0 || o.micro_batch > o.batch) {
    throw std::invalid_argument("invalid --micro-batch " + std::to_string(o.micro_batch) + ": expected 1 to --batch (" +
                                std::to_string(o.batch) + ")");
  }
  if (o.save_every < 1) throw std::invalid_argument("invalid --save-every " + std::to_string(o.save_every) + ": expected >= 1");
  if (o.eval_every < 0) throw std::invalid_argument("invalid --eval-every " + std::to_string(o.eval_every) + ": expected >= 0");
  for (int64_t s : o.inject_oom) {
    if (s < 1) throw std::invalid_argument("invalid --inject-oom step " + std::to_string(s) + ": steps are numbered from 1");
  }
  // auto: fp32 and the mixed precisions this device runs; the planner measures and chooses.
  const std::vector<Precision> precisions = precision_candidates(o.precision, c10::kCPU);
  std::vector<std::string> notes;

  validate(o.distributed);
  const int world = o.distributed.world_size;
  if (o.batch < world) {
    throw std::invalid_argument("invalid --batch " + std::to_string(o.batch) + ": each of the " + std::to_string(world) +
                                " ranks needs at least one sample");
  }
  const BatchSlice local = rank_slice(o.batch, o.distributed.rank, world);  // this rank's samples
  if (o.micro_batch > local.length) {
    throw std::invalid_argument("invalid --micro-batch " + std::to_string(o.micro_batch) + ": expected 1 to this rank's share of --batch (" +
                                std::to_string(local.length) + " of " + std::to_string(o.batch) + " over " + std::to_string(world) + " ranks)");
  }
  if (world > 1 && o.distributed.zero_stage > 0 && o.precision == "fp16") {
    throw std::invalid_argument("--precision fp16 with --zero 1 or 2 is not supported: the loss scaler's overflow check would see one shard only");
  }

  auto& alloc = BudgetAllocator::install();
  auto tracker = std::make_shared<MemoryTracker>();
  TrackerScope scope(tracker);
  std::unique_ptr<DistributedContext> context;  // first: a bad --master fails before any work
  if (world > 1) context = std::make_unique<DistributedContext>(o.distributed);

  Workload w = make_workload(o.model);
  const auto params = w.chain->parameters();
  int64_t weight_bytes = 0, largest_param = 0;
  for (const auto& p : params) {
    weight_bytes += static_cast<int64_t>(p.storage().nbytes());
    largest_param = std::max<int64_t>(largest_param, static_cast<int64_t>(p.storage().nbytes()));
  }
  std::unique_ptr<ShardedDataParallel> sdp;
  if (context) {
    sdp = std::make_unique<ShardedDataParallel>(*context, params, o.distributed.zero_stage);
    context->check_same_on_all_ranks({{"--batch", o.batch}, {"--steps", o.steps}, {"--seed", static_cast<int64_t>(o.model.seed)},
                                      {"--save (given or not)", o.save_dir.empty() ? 0 : 1}, {"--save-every", o.save_every},
                                      {"--resume (given or not)", o.resume_dir.empty() ? 0 : 1}});
    largest_param = sdp->largest_optimized_parameter_bytes();  // AdamW's temporaries: this rank's parameters only
  }
  const bool sharded_optimizer = sdp && sdp->zero_stage() > 0;
  torch::optim::AdamW optimizer(sdp ? sdp->optimized_parameters() : params, torch::optim::AdamWOptions(o.learning_rate));

  out << "memfit train: " << w.description << "\n";
  out << "  " << parameter_count(*w.chain) << " parameters (" << format_bytes(weight_bytes) << "), batch "
      << o.batch << ", AdamW lr " << o.learning_rate << ", " << at::get_num_threads() << " threads\n";
  if (sdp) {
    out << "  rank " << sdp->rank() << " of " << world << " (" << context->backend_name() << " via " << o.distributed.master
        << "), ZeRO stage " << sdp->zero_stage() << ": samples " << local.start << " to " << local.start + local.length - 1
        << " of each batch; AdamW over " << format_bytes(sdp->zero_stage() > 0 ? sdp->owned_bytes() : weight_bytes)
        << " of the parameters\n";
  }

  // Resume first: the plan and the position come from the saved state.
  int64_t start_step = 0;
  nlohmann::json resumed;
  if (!o.resume_dir.empty()) {
    if (sharded_optimizer) {
      // The file holds the whole AdamW state (the single-process format): keep this rank's share.
      torch::optim::AdamW full(params, torch::optim::AdamWOptions(o.learning_rate));
      resumed = load_state(o.resume_dir, w, full, w.description, o.batch);
      sdp->keep_owned_state(full, optimizer);
    } else {
      resumed = load_state(o.resume_dir, w, optimizer, w.description, o.batch);
    }
    start_step = resumed.at("step").get<int64_t>();
    out << "  resumed from " << o.resume_dir << " at step " << start_step << "\n";
  }
  at::Tensor rng_after_resume;
  {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    rng_after_resume = gen.get_state();
  }

  // --- plan: measure, predict, choose (planner.h) ---
  TrainPlan plan;
  plan.notes = notes;
  const Batch first_batch = w.data->train_batch(start_step, o.batch, o.model.seed).slice(local.start, local.length);
  // Per rank: AdamW's exp_avg and exp_avg_sq for the parameters this rank steps, and the
  // gradients kept through the optimizer step (only this rank's share at ZeRO stage 2).
  const RankStateBytes rank_state = sdp ? sdp->predicted_state_bytes() : RankStateBytes{weight_bytes, weight_bytes, 2 * weight_bytes};
  PlanRequest request;
  request.batch = local.length;
  request.precisions = precisions;
  request.micro_batch = o.micro_batch;
  if (o.checkpoint != "auto") request.checkpoint = CheckpointPlan::parse(o.checkpoint, w.chain->size());
  request.keep_grads = o.keep_grads;
  request.margin = kMargin;
  request.optimizer_state_bytes = rank_state.optimizer_state;
  request.gradient_bytes = rank_state.gradients;
  request.largest_update_bytes = largest_param;
  // Saving gathers the whole AdamW state on rank 0 of a sharded run.
  request.extra_bytes = sharded_optimizer && primary && !o.save_dir.empty() ? 2 * weight_bytes - rank_state.optimizer_state : 0;
  // A resumed run's optimizer state already exists: the planner counts it from the request,
  // so the planner's measurements must not see it twice (they are relative to live bytes).
  Planner planner(w, first_batch, request, *tracker);
  {
    auto gen = at::detail::getDefaultCPUGenerator();
    std::lock_guard<std::mutex> lock(gen.mutex());
    gen.set_state(rng_after_resume);  // measuring drew dropout masks: training must not notice
  }
  if (start_step == 0) torch::manual_seed(o.model.seed);

  const Plan plain_step = planner.evaluate(local.length, precisions.front(), CheckpointPlan::none());
  plan.plain_predicted_peak = plain_step.predicted_peak;
  plan.plain_step_seconds = plain_step.predicted_seconds;
  const int64_t floor_bytes = planner.floor_bytes();
  Plan chosen;
  int64_t budget = o.budget_bytes;
  if (budget == 0) {
    if (o.micro_batch > 0 || o.checkpoint != "auto") {
      throw std::invalid_argument("--budget is required when --checkpoint or --micro-batch pin the configuration");
    }
    // The default lies halfway between the smallest plan and the plain step: the plain step
    // does not fit, so the plan matters.
    budget = (floor_bytes + plan.plain_predicted_peak) / 2 >> 10 << 10;
    plan.notes.push_back("budget " + format_bytes(budget) + ": the default, halfway between the smallest plan (" +
                         format_bytes(floor_bytes) + ") and the plain step (" + format_bytes(plan.plain_predicted_peak) + ")");
  }
  if (!resumed.is_null() && resumed.contains("plan")) {
    // A resumed run continues with the plan it saved (the same micro-batches, precision and
    // schedule: the same stream of numbers).
    const auto& p = resumed["plan"];
    plan.micro_batch = p.at("micro_batch").get<int64_t>();
    plan.precision = parse_precision(p.value("precision", std::string("fp32")));
    plan.checkpoint_mode = p.at("checkpoint_mode").get<std::string>();
    if (p.contains("segments")) {
      plan.checkpoint.segments = p.at("segments").get<std::vector<std::pair<int, int>>>();
    } else {
      plan.checkpoint = CheckpointPlan::of_blocks(p.at("checkpoint").get<std::vector<int>>(), w.chain->size());
    }
    plan.predicted_peak = p.value("predicted_peak_bytes", int64_t{0});
    plan.notes.push_back("resumed with the saved plan");
  } else {
    chosen = planner.plan(budget);
    const bool pinned = o.micro_batch > 0 && o.checkpoint != "auto" && precisions.size() == 1;
    if (!chosen.feasible && pinned) {
      // The user fixed the configuration: run it, and let out-of-memory recovery split.
      chosen = planner.evaluate(o.micro_batch, precisions.front(), *request.checkpoint, budget);
      plan.notes.push_back("the pinned configuration is predicted to need " + format_bytes(chosen.predicted_peak) +
                           ", over the budget: micro-batches will be split when memory runs out");
    } else if (!chosen.feasible) {
      throw std::runtime_error("budget " + format_bytes(budget) + " (" + std::to_string(budget) +
                               " bytes) is below what any plan needs: the smallest budget that works is " +
                               format_bytes(floor_bytes) + " (" + std::to_string(floor_bytes) + " bytes)");
    }
    plan.micro_batch = chosen.micro_batch;
    plan.precision = chosen.precision;
    plan.checkpoint = chosen.checkpoint;
    plan.checkpoint_mode = o.checkpoint;
    plan.predicted_peak = chosen.predicted_peak;
    plan.predicted_step_seconds = chosen.predicted_seconds;
    for (const auto& n : chosen.notes) plan.notes.push_back(n);
  }
  if (context && resumed.is_null()) {
    // Every rank trains with rank 0's plan: each rank timed its own profile and could choose
    // differently, and equal precision and micro-batches keep ranks equal to one process.
    const int n = w.chain->size();
    std::vector<int64_t> mine{plan.micro_batch, static_cast<int64_t>(plan.precision)};
    mine.resize(2 + static_cast<size_t>(n), -1);  // per block: its segment's first block, or -1
    for (const auto& [first, last] : plan.checkpoint.segments) {
      for (int i = first; i <= last; ++i) mine[2 + static_cast<size_t>(i)] = first;
    }
    const auto all = context->all_gather(mine, "agreeing on the plan");
    if (all[0] != mine) {
      CheckpointPlan ckpt;
      for (int i = 0; i < n; ++i) {
        const int64_t first = all[0][2 + static_cast<size_t>(i)];
        if (first < 0) continue;
        if (ckpt.segments.empty() || ckpt.segments.back().first != first) ckpt.segments.emplace_back(static_cast<int>(first), i);
        ckpt.segments.back().second = i;
      }
      const Plan adopted = planner.evaluate(std::min(all[0][0], local.length), static_cast<Precision>(all[0][1]), ckpt, budget);
      plan.micro_batch = adopted.micro_batch;
      plan.precision = adopted.precision;
      plan.checkpoint = adopted.checkpoint;
      plan.predicted_peak = adopted.predicted_peak;
      plan.predicted_step_seconds = adopted.predicted_seconds;
      plan.notes.push_back("using rank 0's plan (this rank's own choice differed)");
    }
  }
  const Precision precision = plan.precision;
  if (world > 1 && o.distributed.zero_stage > 0 && precision == Precision::kFP16) {
    throw std::invalid_argument("--precision fp16 with --zero 1 or 2 is not supported: the loss scaler's overflow check would see one shard only");
  }
  GradScaler scaler(GradScalerOptions{65536.0, 2.0, 0.5, 2000, precision == Precision::kFP16});
  alloc.set_budget(budget);

  out << "\nPlan for a budget of " << format_bytes(budget) << " (" << budget << " bytes, " << kMargin * 100
      << "% kept free):\n";
  out << "  micro-batch " << plan.micro_batch << " x " << (local.length + plan.micro_batch - 1) / plan.micro_batch
      << " accumulation steps, precision " << precision_name(plan.precision) << ", recompute "
      << plan.checkpoint.describe() << (plan.checkpoint_mode == "auto" ? " (chosen by the plan)" : " (--checkpoint " + plan.checkpoint_mode + ")")
      << "\n";
  out << "  predicted peak " << format_bytes(plan.predicted_peak) << "; the plain step would need "
      << format_bytes(plan.plain_predicted_peak);
  if (plan.plain_step_seconds > 0 && plan.predicted_step_seconds > 0) {
    out << "; predicted step time " << fmt_ratio(plan.predicted_step_seconds / plan.plain_step_seconds) << "x the plain step";
  }
  out << "\n";
  for (const auto& n : plan.notes) out << "  note: " << n << "\n";
  out << "  budget covers tensor storage (LibTorch's CPU allocator); BLAS/oneDNN workspaces are outside it\n\n"
      << std::flush;  // the plan shows before training starts, also through a pipe (memfit launch)

  JsonLog log(o.json_log);
  log.write({{"type", "plan"},
             {"budget_bytes", budget},
             {"micro_batch", plan.micro_batch},
             {"precision", precision_name(plan.precision)},
             {"checkpoint", plan.checkpoint.recomputed_blocks()},
             {"checkpoint_mode", plan.checkpoint_mode},
             {"predicted_peak_bytes", plan.predicted_peak},
             {"plain_predicted_peak_bytes", plan.plain_predicted_peak}});

  // --- train ---
  StepOptions so;
  so.precision = plan.precision;
  so.checkpoint = plan.checkpoint;
  so.set_to_none = !o.keep_grads;
  so.scaler = precision == Precision::kFP16 ? &scaler : nullptr;
  TrainSummary summary;
  summary.plan = plan;
  summary.budget_bytes = budget;
  LeakDetector leaks;
  tracker->reset_phase_times();
  const auto run_start = Clock::now();
  nlohmann::json steps_json = nlohmann::json::array();
  nlohmann::json last_step_doc;
  const int64_t report_every = std::max<int64_t>(1, (o.steps - start_step) / 20);
  const bool tty = o.progress && isatty(fileno(stdout));

  auto eval_now = [&]() {
    const int64_t count = std::min(o.eval_batches, w.data->eval_batch_count(o.batch));
    double total = 0;
    for (int64_t i = 0; i < count; ++i) total += eval_loss(w, w.data->eval_batch(i, o.batch), plan.precision);
    return count > 0 ? total / static_cast<double>(count) : 0.0;
  };
  auto meta_for = [&](int64_t step) {
    return nlohmann::json{{"version", 1},
                          {"step", step},
                          {"batch", o.batch},
                          {"seed", o.model.seed},
                          {"model", w.description},
                          {"parameters", parameter_count(*w.chain)},
                          {"plan", {{"micro_batch", plan.micro_batch},
                                    {"precision", precision_name(plan.precision)},
                                    {"checkpoint", plan.checkpoint.recomputed_blocks()},
                                    {"segments", plan.checkpoint.segments},
                                    {"checkpoint_mode", plan.checkpoint_mode},
                                    {"predicted_peak_bytes", plan.predicted_peak}}}};
  };

  // This rank's micro-batches, each weighted by its share of the global batch: with the
  // gradients SUM-reduced over the ranks, a step equals one process taking the whole batch.
  auto split_local = [&](int64_t m) {
    auto parts = split_batch(local.length, m);
    for (auto& part : parts) part.weight = static_cast<double>(part.length) / static_cast<double>(o.batch);
    return parts;
  };
  RankState own_state;
  own_state.rank = o.distributed.rank;

  for (int64_t step = start_step + 1; step <= o.steps; ++step) {
    if (auto leak = leaks.observe(step, tracker->current())) {
      out << (tty ? "\n" : "") << "warning: " << leak->message() << "\n";
      log.write({{"type", "warning"}, {"leak_bytes_per_step", leak->bytes_per_step}});
    }
    const bool last = step == o.steps;
    tracker->reset_peak();
    if (last && !o.report_html.empty()) tracker->start_recording();
    const auto t0 = Clock::now();
    Batch batch;
    {
      PhaseGuard data(Phase::kData);
      batch = w.data->train_batch(step - 1, o.batch, o.model.seed).slice(local.start, local.length);
    }
    // Each pending micro-batch may be marked to recompute every block: gradients with
    // recomputation are bit-equal to plain ones, so that is the first, exact, answer to an
    // out-of-memory error; splitting in two comes next.
    struct Pending {
      MicroBatch mb;
      bool recompute_all;
    };
    std::deque<Pending> pending;
    for (const auto& mb : split_local(plan.micro_batch)) pending.push_back({mb, false});
    bool inject = std::find(o.inject_oom.begin(), o.inject_oom.end(), step) != o.inject_oom.end();
    bool real_oom = false;
    int64_t smallest_ok = plan.micro_batch;
    double loss = 0;
    const CheckpointPlan all_blocks = CheckpointPlan::all(w.chain->size());
    auto restart_step = [&](int64_t m, bool recompute_all) {
      pending.clear();
      for (const auto& mb : split_local(m)) pending.push_back({mb, recompute_all});
      loss = 0;
    };
    while (!pending.empty()) {
      const Pending current = pending.front();
      const MicroBatch& mb = current.mb;
      const auto versions = grad_versions(params);
      at::Tensor rng_before;
      {
        auto gen = at::detail::getDefaultCPUGenerator();
        std::lock_guard<std::mutex> lock(gen.mutex());
        rng_before = gen.get_state();
      }
      try {
        if (inject) alloc.fail_allocation_after(8);  // fails a few allocations into the forward
        inject = false;
        StepOptions attempt = so;
        if (current.recompute_all) attempt.checkpoint = all_blocks;
        loss += forward_backward(w, batch.slice(mb.start, mb.length), mb.weight, attempt);
        alloc.fail_allocation_after(0);
        smallest_ok = std::min(smallest_ok, mb.length);
        pending.pop_front();
      } catch (const c10::OutOfMemoryError& e) {
        alloc.fail_allocation_after(0);
        ++summary.oom_recoveries;
        const bool injected = std::string(e.what()).find("(injected)") != std::string::npos;
        real_oom = real_oom || !injected;
        const std::string what = injected ? "out of memory (injected)" : "out of memory";
        const char* nl = tty ? "\n" : "";
        {
          auto gen = at::detail::getDefaultCPUGenerator();
          std::lock_guard<std::mutex> lock(gen.mutex());
          gen.set_state(rng_before);  // the failed attempt's random draws are taken back
        }
        if (grad_versions(params) != versions) {
          // The failure came after gradients were accumulated. The first micro-batch's are
          // simply dropped; partial sums over earlier micro-batches cannot be taken back
          // exactly, so then the whole step is redone.
          const bool none_before = std::all_of(versions.begin(), versions.end(), [](int64_t v) { return v < 0; });
          zero_grad(params, true);
          if (!none_before) {
            if (!current.recompute_all) {
              restart_step(mb.length, true);
              out << nl << what << " in step " << step << " after gradients were accumulated: redoing the step, recomputing every block\n";
            } else if (mb.length >= 2) {
              restart_step(mb.length / 2, false);
              out << nl << what << " in step " << step << " after gradients were accumulated: redoing the step with micro-batch " << mb.length / 2 << "\n";
            } else {
              throw std::runtime_error("out of memory in step " + std::to_string(step) +
                                       " even with micro-batch 1 and every block recomputed: budget " +
                                       format_bytes(budget) + " is too small for this model");
            }
            continue;
          }
        }
        pending.pop_front();
        if (!current.recompute_all && so.checkpoint.recomputed_blocks().size() < static_cast<size_t>(w.chain->size())) {
          pending.push_front({mb, true});
          out << nl << what << " in step " << step << ": redoing the micro-batch of " << mb.length
              << " samples with every block recomputed\n";
        } else if (mb.length >= 2) {
          const auto halves = split_in_two(mb, o.batch);
          pending.push_front({halves[1], false});
          pending.push_front({halves[0], false});
          out << nl << what << " in step " << step << ": micro-batch of " << mb.length << " samples split into "
              << halves[0].length << " + " << halves[1].length << "\n";
        } else {
          throw std::runtime_error("out of memory in step " + std::to_string(step) +
                                   " even with micro-batch 1 and every block recomputed: budget " +
                                   format_bytes(budget) + " is too small for this model (" + e.what_without_backtrace() + ")");
        }
      }
    }
    if (sdp) {
      sdp->reduce_gradients();
      const at::Tensor total = at::tensor({loss}, at::kDouble);
      context->all_reduce_sum(total, "summing the loss");
      loss = total.item<double>();  // the global batch's mean loss
    }
    KnownStorage known;
    so.after_optimizer = [&] {
      if (last && !o.report_html.empty()) {
        tracker->stop_recording();
        known = known_storage(params, &optimizer);
      }
      if (last) {  // this rank's state bytes, while gradients and optimizer state are all present
        const Categories live = classify_live(*tracker, known_storage(params, &optimizer));
        own_state.weights = live.weights;
        own_state.gradients = live.gradients;
        own_state.optimizer_state = live.optimizer_state;
      }
    };
    try {
      optimizer_step(optimizer, so);
    } catch (const c10::OutOfMemoryError& e) {
      throw std::runtime_error("out of memory in the optimizer step of step " + std::to_string(step) +
                               ": budget " + format_bytes(budget) + " cannot hold weights, gradients and " +
                               "AdamW state (" + format_bytes(4 * weight_bytes) + ") plus its temporaries");
    }
    so.after_optimizer = nullptr;
    if (sdp) sdp->finish_step(so.set_to_none);  // owners broadcast the updated parameters
    if (real_oom) {
      // A real out-of-memory error is likely to repeat: the following steps use what worked.
      if (smallest_ok < plan.micro_batch) {
        out << (tty ? "\n" : "") << "re-plan: micro-batch " << plan.micro_batch << " -> " << smallest_ok
            << " after a real out-of-memory error\n";
        plan.micro_batch = smallest_ok;
      } else if (so.checkpoint.recomputed_blocks().size() < static_cast<size_t>(w.chain->size())) {
        out << (tty ? "\n" : "") << "re-plan: recompute every block after a real out-of-memory error\n";
        so.checkpoint = all_blocks;
        plan.checkpoint = all_blocks;
        plan.checkpoint_mode = "all";
      }
    }
    const double secs = seconds_since(t0);
    const int64_t peak = tracker->peak();
    summary.peak_bytes = std::max(summary.peak_bytes, peak);
    summary.samples += o.batch;
    summary.losses.push_back(loss);
    summary.final_loss = loss;
    summary.steps = step;
    nlohmann::json sj{{"type", "step"},  {"step", step},          {"loss", loss},
                      {"samples", o.batch}, {"seconds", secs},      {"live_bytes", tracker->current()},
                      {"peak_bytes", peak}, {"oom_recoveries", summary.oom_recoveries}};
    if (o.eval_every > 0 && (step % o.eval_every == 0 || last)) {
      summary.eval_loss = eval_now();
      sj["eval_loss"] = summary.eval_loss;
    }
    log.write(sj);
    steps_json.push_back({{"step", step}, {"loss", loss}, {"live_bytes", tracker->current()}, {"peak_bytes", peak}});
    if (sj.contains("eval_loss")) steps_json.back()["eval_loss"] = summary.eval_loss;
    if (o.progress && (tty || step % report_every == 0 || last || sj.contains("eval_loss"))) {
      const double per_sec = static_cast<double>(o.batch * w.sample_tokens) / secs;
      const int width = 24;
      const int filled = static_cast<int>(width * (step - start_step) / std::max<int64_t>(1, o.steps - start_step));
      char line[512];
      std::snprintf(line, sizeof line, "%s[%s%s] step %lld/%lld  loss %.4f%s  %.0f %s/s  live %s  peak %s / %s",
                    tty ? "\r" : "", std::string(static_cast<size_t>(filled), '#').c_str(),
                    std::string(static_cast<size_t>(width - filled), '.').c_str(), static_cast<long long>(step),
                    static_cast<long long>(o.steps), loss,
                    sj.contains("eval_loss") ? (std::string("  eval ") + std::to_string(summary.eval_loss).substr(0, 6)).c_str() : "",
                    per_sec, w.sample_tokens > 1 ? "tok" : "samples", format_bytes(tracker->current()).c_str(),
                    format_bytes(peak).c_str(), format_bytes(budget).c_str());
      out << line << (tty ? "" : "\n") << std::flush;
    }
    if (!o.save_dir.empty() && (step % o.save_every == 0 || last)) {
      if (sharded_optimizer) {
        // Rank 0 saves the whole AdamW state, gathered from its owners: the single-process format.
        torch::optim::AdamW full(params, torch::optim::AdamWOptions(o.learning_rate));
        sdp->gather_optimizer_state(optimizer, full);
        if (primary) save_state(o.save_dir, w, full, meta_for(step));
      } else if (primary) {
        save_state(o.save_dir, w, optimizer, meta_for(step));
      }
    }
    if (last && !o.report_html.empty()) {
      StepAnalysis a = analyze_step(*tracker, known, w.chain->size());
      std::vector<std::string> names;
      std::vector<bool> recomputed;
      for (int i = 0; i < w.chain->size(); ++i) {
        names.push_back(w.chain->block(i).name);
        recomputed.push_back(plan.checkpoint.recomputes(i));
      }
      nlohmann::json d = step_chart_document("memfit train: " + w.description, a, names, recomputed);
      d["budget_bytes"] = budget;
      last_step_doc = d;
    }
  }
  if (tty) out << "\n";
  summary.weights_sha256 = weights_sha256(*w.chain);
  if (!o.dump_weights.empty()) dump_weights(o.dump_weights, params);
  summary.world_size = world;
  summary.zero_stage = o.distributed.zero_stage;
  if (context) {
    const auto all = context->all_gather({own_state.weights, own_state.gradients, own_state.optimizer_state}, "gathering state bytes");
    for (int r = 0; r < world; ++r) {
      const auto& v = all[static_cast<size_t>(r)];
      summary.ranks.push_back({r, v[0], v[1], v[2]});
    }
  } else {
    summary.ranks.push_back(own_state);
  }
  summary.plan = plan;

  // --- summary ---
  const double total = seconds_since(run_start);
  out << "\nSummary: " << (summary.steps - start_step) << " steps, " << summary.samples << " samples in "
      << fmt_ratio(total) << " s; final loss " << summary.final_loss;
  if (o.eval_every > 0) out << ", held-out loss " << summary.eval_loss;
  out << "\n  peak " << format_bytes(summary.peak_bytes) << " (" << summary.peak_bytes << " bytes) of a "
      << format_bytes(budget) << " budget; out-of-memory recoveries: " << summary.oom_recoveries << "\n";
  out << "  state at the optimizer step" << (sdp ? " per rank (ZeRO stage " + std::to_string(sdp->zero_stage()) + ")" : "")
      << "; activations and the rest come on top, up to the peak:\n";
  for (const auto& r : summary.ranks) {
    out << "    " << (sdp ? "rank " + std::to_string(r.rank) + ": " : "") << "weights " << format_bytes(r.weights) << ", gradients "
        << format_bytes(r.gradients) << ", optimizer state " << format_bytes(r.optimizer_state) << "\n";
  }
  out << "  time per phase:";
  const Phase phases[] = {Phase::kData, Phase::kForward, Phase::kBackward, Phase::kRecompute, Phase::kOptimizer, Phase::kEval};
  double phase_total = 0;
  for (Phase p : phases) phase_total += static_cast<double>(tracker->phase_time_ns(p));
  nlohmann::json profile;
  for (Phase p : phases) {
    const double s = static_cast<double>(tracker->phase_time_ns(p)) / 1e9;
    profile[phase_name(p)] = s;
    out << " " << phase_name(p) << " " << fmt_ratio(s) << " s (" << fmt_ratio(100.0 * s * 1e9 / std::max(phase_total, 1.0)) << "%)";
  }
  out << "\n";
  log.write({{"type", "profile"}, {"seconds", profile}});
  if (!o.report_html.empty() && !last_step_doc.is_null()) {
    nlohmann::json rows = nlohmann::json::array();
    rows.push_back({"budget", format_bytes(budget)});
    rows.push_back({"micro-batch x accumulation", std::to_string(plan.micro_batch) + " x " +
                                                    std::to_string((local.length + plan.micro_batch - 1) / plan.micro_batch)});
    rows.push_back({"precision", precision_name(plan.precision)});
    rows.push_back({"recomputed blocks", plan.checkpoint.describe() + (plan.checkpoint_mode == "auto" ? " (chosen by the plan)" : " (--checkpoint " + plan.checkpoint_mode + ")")});
    rows.push_back({"predicted peak", format_bytes(plan.predicted_peak)});
    rows.push_back({"measured peak (run)", format_bytes(summary.peak_bytes)});
    rows.push_back({"plain step, predicted", format_bytes(plan.plain_predicted_peak)});
    last_step_doc["plan"] = {{"rows", rows}};
    if (summary.ranks.size() > 1) {
      std::vector<RankStateBytes> ranks;
      for (const auto& r : summary.ranks) ranks.push_back({r.weights, r.gradients, r.optimizer_state});
      last_step_doc["ranks"] = ranks_json(ranks);
      last_step_doc["zero_stage"] = summary.zero_stage;
    }
    last_step_doc["steps"] = steps_json;
    write_html_report(o.report_html, last_step_doc);
    out << "  report: " << o.report_html << "\n";
  }
  log.write(summary.json());
  log.commit();
  return summary;
}

}  // namespace memfit
