// The Trainer driven from C++ on a user's own model, data and loss (no built-in workload): it
// trains under the budget with any optimizer family, its parts run one by one, resume is exact.
#include "test_util.h"

#include <malloc.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <set>
#include <utility>

#include <nlohmann/json.hpp>

namespace memfit {
namespace {

// y = a noisy linear map of x at each of 64 positions: a regression a small MLP learns
// quickly, whose activations (64 positions x 256 wide per sample) outweigh its weights, so that
// the budget decides the plan. The data tensors themselves count against the budget.
Workload user_workload(uint64_t seed) {
  torch::manual_seed(seed);
  const at::Tensor x = torch::randn({512, 64, 32});
  const at::Tensor y = x.matmul(torch::randn({32, 4})) + 0.01 * torch::randn({512, 64, 4});
  Workload w;
  w.name = "user-mlp";
  w.description = "a user's MLP on a regression";
  w.chain = std::make_shared<Chain>();
  w.chain->add("in", torch::nn::Sequential(torch::nn::Linear(32, 256), torch::nn::ReLU()).ptr());
  w.chain->add("hidden", torch::nn::Sequential(torch::nn::Linear(256, 256), torch::nn::ReLU()).ptr());
  w.chain->add("out", torch::nn::Linear(256, 4).ptr());
  w.data = std::make_shared<TensorDataset>(x, y, "regression");
  w.loss = [](const at::Tensor& out, const at::Tensor& target) { return torch::mse_loss(out, target); };
  w.seed = seed;
  return w;
}

TrainOptions small_options(OptimizerFamily family, double momentum) {
  TrainOptions o;
  o.step.batch = 32;
  o.steps = 12;
  o.step.precision = Precision::kFP32;
  o.pin_precision = true;
  o.step.optimizer.family = family;
  o.step.optimizer.momentum = momentum;
  o.step.optimizer.lr = family == OptimizerFamily::kSGD ? 0.02 : 3e-3;
  o.eval_every = 0;
  return o;
}

TEST(TrainerTest, UserModelTrainsUnderABudgetWithEveryFamily) {
  test::use_memfit_allocator();
  for (auto [family, momentum] : {std::pair{OptimizerFamily::kAdamW, 0.0}, std::pair{OptimizerFamily::kSGD, 0.9},
                                  std::pair{OptimizerFamily::kAdam, 0.0}, std::pair{OptimizerFamily::kRMSprop, 0.0}}) {
    Workload w = user_workload(1);
    TrainObserver quiet;
    // The plain step (batch 32) needs about 14 MB: 10 MiB leaves micro-batching to the plan.
    // (Recomputation is pinned off: on this 3-block chain it is under-predicted; see the note.)
    TrainOptions o = small_options(family, momentum);
    o.budget_bytes = 10 << 20;
    o.pin_checkpoint = true;  // step.checkpoint: none
    const TrainSummary s = train(w, o, quiet);
    const std::string name = optimizer_family_name(family);
    EXPECT_LE(s.peak_bytes, s.budget_bytes) << name;
    EXPECT_LT(s.plan.predicted_peak, s.plan.plain_predicted_peak) << name << ": the budget makes the plan matter";
    EXPECT_GT(s.plan.config.accumulation(), 1) << name;
    EXPECT_LT(s.losses.back(), s.losses.front()) << name;
    EXPECT_EQ(s.plan.config.optimizer.family, family);
    // The plan counted this optimizer's state: its prediction holds within 5% of the run.
    const double error = std::abs(static_cast<double>(s.plan.predicted_peak - s.peak_bytes)) / static_cast<double>(s.peak_bytes);
    EXPECT_LE(error, 0.05) << name << " (" << s.plan.config.describe() << "): predicted " << s.plan.predicted_peak
                           << ", measured " << s.peak_bytes;
    const int64_t weights = parameter_bytes(*w.chain);
    const int64_t expected_state = family == OptimizerFamily::kSGD ? weights : family == OptimizerFamily::kRMSprop ? weights : 2 * weights;
    EXPECT_EQ(s.ranks.at(0).optimizer_state, expected_state) << name;
  }
}

TEST(TrainerTest, PartsRunOneByOneAndResumeIsExact) {
  test::use_memfit_allocator();
  const auto dir = std::filesystem::temp_directory_path() / ("memfit-trainer-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  TrainOptions o = small_options(OptimizerFamily::kSGD, 0.9);
  o.budget_bytes = 64 << 20;
  o.steps = 6;
  o.step.micro_batch = 8;  // pinned: a plan chosen by timings could differ between the two runs
  o.pin_checkpoint = true;  // step.checkpoint: none
  TrainObserver quiet;

  Workload straight_w = user_workload(2);
  const TrainSummary straight = train(straight_w, o, quiet);

  Workload first_w = user_workload(2);
  struct Dbg0 : TrainObserver { void on_note(const std::string& n) override { std::cerr << "NOTE " << n << "\n"; }
    void on_step(const StepEvent& e) override { std::cerr << "FIRST " << e.step << " L" << e.tokens_per_sample << " m" << e.micro_batch << " r" << e.recomputed_blocks << " peak " << e.peak_bytes << " live " << e.live_bytes << "\n"; } } dbg0;
  TrainOptions first_half = o;
  first_half.steps = 3;
  first_half.save_dir = dir.string();
  Trainer first(first_w, first_half);
  EXPECT_THROW(first.step(1), c10::Error);  // each part needs the ones before it, run once
  first.set_up();
  EXPECT_THROW(first.set_up(), c10::Error);
  EXPECT_THROW(first.evaluate(), c10::Error);
  const Plan& plan = first.plan();
  EXPECT_TRUE(plan.feasible);
  EXPECT_THROW(first.plan(), c10::Error);
  for (int64_t step = 1; step <= 3; ++step) EXPECT_TRUE(std::isfinite(first.step(step)));
  EXPECT_GT(first.evaluate(), 0.0);
  first.summarize();

  Workload resumed_w = user_workload(2);
  TrainOptions second_half = o;
  second_half.resume_dir = dir.string();
  const TrainSummary resumed = train(resumed_w, second_half, quiet);
  ASSERT_EQ(resumed.losses.size(), 3u);
  for (size_t i = 0; i < 3; ++i) EXPECT_EQ(resumed.losses[i], straight.losses[3 + i]) << "step " << 4 + i;
  EXPECT_EQ(resumed.weights_sha256, straight.weights_sha256);
  EXPECT_EQ(resumed.final_loss, straight.final_loss);
  std::filesystem::remove_all(dir);
}

// Evaluation follows the training step's recovery rule: a micro-batch that runs out of memory is
// split in two (inference has nothing to recompute), and the loss is the same to float tolerance.
// What each step ran, as the Trainer reports it.
class StepsSeen : public TrainObserver {
 public:
  void on_step(const StepEvent& e) override { steps.push_back(e); }
  std::vector<StepEvent> steps;
};

// A user's data whose batches are as long as padding makes them (16 to 64 characters), planned
// on a typical batch of 32: each batch is planned from its length before it runs.
class PlannedOnAShorterBatch : public Dataset {
 public:
  PlannedOnAShorterBatch(std::shared_ptr<Dataset> data, int64_t length) : data_(std::move(data)), length_(length) {}
  std::string describe() const override { return data_->describe(); }
  Batch train_batch(int64_t index, int64_t batch_size, uint64_t seed) const override {
    return data_->train_batch(index, batch_size, seed);
  }
  Batch plan_batch(int64_t index, int64_t batch_size, uint64_t seed) const override {
    const Batch cut = data_->plan_batch(index, batch_size, seed).cut(length_);
    return {cut.input.contiguous(), cut.target.contiguous()};
  }
  bool lengths_vary() const override { return true; }
  Batch eval_batch(int64_t index, int64_t batch_size) const override { return data_->eval_batch(index, batch_size); }
  int64_t eval_batch_count(int64_t batch_size) const override { return data_->eval_batch_count(batch_size); }

 private:
  std::shared_ptr<Dataset> data_;
  int64_t length_;
};

// The small GPT on batches of 16 to 64 characters, planned on one of 32.
ModelOptions varying_length_model() {
  ModelOptions m = test::small_gpt(5);
  m.gpt.layers = 4;
  m.gpt.dropout = 0.0;
  m.shortest = 16;
  return m;
}

Workload varying_length_workload(const ModelOptions& m) {
  Workload w = make_workload(m);
  w.data = std::make_shared<PlannedOnAShorterBatch>(w.data, m.gpt.seq / 2);
  return w;
}

// 8 fp32 steps of 16 samples; `plain` the same with one micro-batch and no budget.
TrainOptions varying_length_options() {
  TrainOptions o;
  o.step.batch = 16;
  o.steps = 8;
  o.pin_precision = true;  // step.precision: fp32
  o.step.optimizer.state = StatePrecision::kFP32;
  o.eval_every = 0;
  return o;
}

TrainOptions plain_options(TrainOptions o) {
  o.budget_bytes = int64_t{1} << 40;
  o.step.micro_batch = 16;
  o.pin_checkpoint = true;  // step.checkpoint: none
  return o;
}

// Batches up to twice as long as the planned one need smaller micro-batches or more recompute
// under the budget: chosen before they run, so no out-of-memory error; every step under the
// budget, and the losses of the same batches trained plainly (micro-batches change only the
// order of float sums).
TEST(TrainerTest, BatchesOfVaryingLengthArePlannedFromTheirLengthBeforeTheyRun) {
  test::use_memfit_allocator();
  const ModelOptions m = varying_length_model();
  TrainOptions o = varying_length_options();
  Workload plain_w = varying_length_workload(m);
  TrainObserver quiet;
  const TrainSummary reference = train(plain_w, plain_options(o), quiet);

  o.budget_bytes = reference.plan.plain_predicted_peak * 45 / 100;
  Workload w = varying_length_workload(m);
  StepsSeen seen;
  const TrainSummary s = train(w, o, seen);
  EXPECT_EQ(s.oom_recoveries, 0);
  EXPECT_LE(s.peak_bytes, o.budget_bytes);
  ASSERT_EQ(s.losses.size(), reference.losses.size());
  for (size_t i = 0; i < s.losses.size(); ++i) EXPECT_NEAR(s.losses[i], reference.losses[i], 1e-4 * reference.losses[i]) << i;
  const int64_t planned = s.plan.config.micro_batch_size();
  const auto recomputed = static_cast<int64_t>(s.plan.config.checkpoint.recomputed_blocks().size());
  const bool lowered_when_longer = std::any_of(seen.steps.begin(), seen.steps.end(), [&](const StepEvent& e) {
    return e.tokens_per_sample > m.gpt.seq / 2 && (e.micro_batch < planned || e.recomputed_blocks > recomputed);
  });
  EXPECT_TRUE(lowered_when_longer) << "no longer batch ran in smaller micro-batches or with more recompute than the plan";
}

// Saved mid-run and resumed: the resumed run plans each batch's shape from the measurements the
// first run made (the profile cache keeps the shorter lengths' too), so it splits every batch as
// the run straight through did: the same losses and weights, bit for bit.
TEST(TrainerTest, ARunOfVaryingLengthsResumesExactly) {
  test::use_memfit_allocator();
  const auto dir = std::filesystem::temp_directory_path() / ("memfit-varying-" + std::to_string(::getpid()));
  std::filesystem::remove_all(dir);
  const ModelOptions m = varying_length_model();
  const auto run = [&m](const TrainOptions& o, TrainObserver& observer) {  // no model of an earlier run left alive
    Workload w = varying_length_workload(m);
    return train(w, o, observer);
  };
  TrainOptions o = varying_length_options();
  TrainOptions plain = plain_options(o);
  plain.steps = 1;
  TrainObserver quiet;
  o.budget_bytes = run(plain, quiet).plan.plain_predicted_peak * 45 / 100;
  o.profile_cache.dir = (dir / "cache").string();

  StepsSeen seen;
  const TrainSummary straight = run(o, seen);
  std::set<std::pair<int64_t, int64_t>> configurations;  // (micro-batch, blocks recomputed)
  for (const StepEvent& e : seen.steps) configurations.insert({e.micro_batch, e.recomputed_blocks});
#if !defined(__SANITIZE_ADDRESS__)  // ASan slows each kind of operation its own way: its timed plans are no real build's
  ASSERT_GT(configurations.size(), 1u) << "every batch ran one configuration: no shape was planned apart";
#endif
  for (const auto& file : std::filesystem::directory_iterator(dir / "cache")) {
    std::ifstream in(file.path());
    const nlohmann::json kept = nlohmann::json::parse(in);
    EXPECT_EQ(kept.at("costs").at("lengths").size(), 2u) << file.path() << ": the lengths L0/2 and L0/4 not kept";
  }

  TrainOptions first_half = o;
  first_half.steps = 4;
  first_half.save_dir = (dir / "state").string();
  run(first_half, quiet);
  TrainOptions second_half = o;
  second_half.resume_dir = first_half.save_dir;
  const TrainSummary resumed = run(second_half, quiet);
  ASSERT_EQ(resumed.losses.size(), 4u);
  for (size_t i = 0; i < 4; ++i) EXPECT_EQ(resumed.losses[i], straight.losses[4 + i]) << "step " << 5 + i;
  EXPECT_EQ(resumed.weights_sha256, straight.weights_sha256);
  std::filesystem::remove_all(dir);
}

TEST(TrainerTest, EvaluationSplitsAMicroBatchThatRunsOutOfMemory) {
  test::use_memfit_allocator();
  Workload w = user_workload(4);
  TrainOptions o = small_options(OptimizerFamily::kSGD, 0.9);
  o.budget_bytes = 64 << 20;
  o.steps = 1;
  o.step.micro_batch = 8;
  o.pin_checkpoint = true;  // step.checkpoint: none
  o.eval_batches = 2;
  struct Notes : TrainObserver {
    std::vector<std::string> lines;
    void on_note(const std::string& note) override { lines.push_back(note); }
  } notes;
  Trainer trainer(w, o);
  trainer.add_observer(notes);
  trainer.set_up();
  trainer.plan();
  const double whole = trainer.evaluate();
  BudgetAllocator::installed()->fail_allocation_after(3);  // inside the first micro-batch's forward
  const double split = trainer.evaluate();
  EXPECT_NEAR(split, whole, 1e-6 * std::abs(whole));
  const std::string expected = "out of memory (injected) in evaluation: micro-batch of 8 samples split into 4 + 4";
  EXPECT_TRUE(std::any_of(notes.lines.begin(), notes.lines.end(), [&](const std::string& l) { return l == expected; }))
      << "no note '" << expected << "'";
}

TEST(TrainerTest, BadOptionsAreNamedBeforeAnyWork) {
  test::use_memfit_allocator();
  Workload w = user_workload(3);
  auto option_of = [&](TrainOptions o) {
    try {
      check_train_options(o, w);
    } catch (const OptionError& e) {
      return e.option();
    }
    return std::string("(accepted)");
  };
  TrainOptions o = small_options(OptimizerFamily::kAdamW, 0);
  EXPECT_EQ(option_of(o), "(accepted)");
  TrainOptions bad = o;
  bad.step.micro_batch = 33;
  EXPECT_EQ(option_of(bad), "micro_batch");
  bad = o;
  bad.inject_oom = {13};
  EXPECT_EQ(option_of(bad), "inject_oom");
  bad = o;
  bad.step.optimizer.lr = -1;
  EXPECT_EQ(option_of(bad), "optimizer.lr");
  bad = o;
  bad.eval_batches = 0;
  EXPECT_EQ(option_of(bad), "eval_batches");
}

}  // namespace
}  // namespace memfit

namespace memfit {
namespace {

// The process heap (glibc's arena: bytes in use plus free chunks it keeps) after each step of a
// long run stays where it was after warm-up: per-step records are bounded and preallocated, so
// nothing pins the heap's top between tensors (that grew it by ~20 KB per step).
TEST(TrainerTest, HeapStaysFlatOverManySteps) {
  test::use_memfit_allocator();
  ModelOptions m = test::small_gpt();
  m.gpt.layers = 1;
  m.gpt.seq = 32;
  Workload w = make_workload(m);
  TrainOptions o;
  o.step.batch = 4;
  o.steps = 2300;
  o.budget_bytes = 64 << 20;
  o.pin_precision = true;   // step.precision: fp32
  o.step.micro_batch = 4;
  o.pin_checkpoint = true;  // step.checkpoint: none
  o.eval_every = 0;
  Trainer trainer(w, o);
  trainer.set_up();
  trainer.plan();
  auto heap = [] {
    const struct mallinfo2 m = mallinfo2();
    return static_cast<int64_t>(m.uordblks + m.fordblks);
  };
  int64_t after_warmup = 0;
  for (int64_t step = 1; step <= o.steps; ++step) {
    trainer.step(step);
    if (step == 300) after_warmup = heap();
  }
  const int64_t growth = heap() - after_warmup;
  RecordProperty("heap_growth_bytes", std::to_string(growth));
  EXPECT_LE(growth, 512 << 10) << "the heap grew by " << growth << " bytes over 2000 steps";
}

}  // namespace
}  // namespace memfit
